"""A release checkpoint's layout: its shards (``model.safetensors.index.json`` or one
``model.safetensors``) and each shard's header, read without touching tensor data. Pinning, the
backbone's weights and the lm_head table read checkpoints through these two functions."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import IntegrityError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except (OSError, ValueError, struct.error) as exc:
        raise IntegrityError(f"{path}: not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    check_extent(path, header, 8 + n)
    return {"header": header, "base": 8 + n}


def check_extent(path: Path, header: dict, base: int) -> None:
    """The file holds exactly the bytes its header's tensors span (safetensors indexes its whole
    buffer): a truncated or padded shard is refused here, at pin time and before any build reads it."""
    try:
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        size = Path(path).stat().st_size
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise IntegrityError(f"{path}: not a readable safetensors file (a tensor without data_offsets: {exc})") from None
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot be read ({exc.strerror})") from None
    if size != base + end:
        what = "truncated" if size < base + end else "longer than its tensors"
        raise IntegrityError(f"{path}: {what}: its header's tensors end at byte {base + end:,}, the file has {size:,}")


def shard_files(folder: Path) -> list[str]:
    """The checkpoint's shards: those ``model.safetensors.index.json`` names, else ``model.safetensors``."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        try:
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{folder / INDEX_FILE}: no readable weight_map ({exc})") from None
        for s in shards:
            if not isinstance(s, str) or "/" in s or s.startswith("."):
                raise IntegrityError(f"{folder / INDEX_FILE}: names {s!r} as a shard")
        return shards
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise IntegrityError(f"{folder}: no {SINGLE_FILE} nor {INDEX_FILE}; the release has no backbone checkpoint")
