"""A release folder's backbone files: which a build reads (config, index, every shard, the
tokenizer files), each checked against the pins, and the text configuration they describe."""

from __future__ import annotations

from pathlib import Path

from ..digest import sha256_file
from ..errors import IntegrityError
from ..pinning import BACKBONE_CONFIG, TOKENIZER_FILES
from ..pins import Pins
from .contract import TextConfig, read_text_config
from .weights import INDEX_FILE, shard_files

TOKENIZER_DIR = "tokenizer"


def read_files(source: Path) -> list[str]:
    """Every file of the release a backbone build reads: config, index, shards, tokenizer files."""
    names = [BACKBONE_CONFIG]
    if (source / INDEX_FILE).is_file():
        names.append(INDEX_FILE)
    names += shard_files(source)
    names += [f for f in TOKENIZER_FILES if (source / f).is_file()]
    return names


def verify_files(source: Path, pins: Pins, pins_path: Path, names: list[str], log=lambda m: None) -> dict[str, str]:
    """sha256 of each file against its pin; ``IntegrityError`` naming the first that fails. The files
    are hashed two at a time (sha256 runs at about 0.6 GB/s a core here; hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    for name in names:
        path = source / name
        if name not in pins.files:
            raise IntegrityError(f"{path}: not pinned in {pins_path}; re-pin the release (clef-export pin) so the "
                                 f"backbone's files are pinned")
        if not path.is_file():
            raise IntegrityError(f"{path}: missing")

    def digest(name: str) -> str:
        size = (source / name).stat().st_size
        if size > (256 << 20):
            log(f"hashing {name} ({size:,} bytes)")
        return sha256_file(source / name)

    with ThreadPoolExecutor(max_workers=2) as pool:
        actual = dict(zip(names, pool.map(digest, names)))
    for name in names:
        if actual[name] != pins.files[name]:
            raise IntegrityError(f"{source / name}: sha256 mismatch (expected {pins.files[name][:12]}…, "
                                 f"got {actual[name][:12]}…)")
    return actual


def tokenizer_pad(source: Path) -> int | None:
    """The tokenizer's pad token id, when config.json names none (read from tokenizer.json)."""
    import json

    try:
        conf = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pad = conf.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    for t in tok.get("added_tokens", []):
        if t.get("content") == pad:
            return int(t["id"])
    return None


def release_config(source: Path) -> TextConfig:
    """The release's text configuration, its pad token from the tokenizer when config.json names none."""
    return read_text_config(source, tokenizer_pad(source))
