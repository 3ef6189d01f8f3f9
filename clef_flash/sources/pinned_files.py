"""The release's pinned files read and checked against their pins (every model's build and gate)."""

from __future__ import annotations

from pathlib import Path

from ..digest import sha256_file
from ..errors import IntegrityError
from .pinning import BACKBONE_CONFIG, TOKENIZER_FILES
from .pins import Pins
from .safetensors import INDEX_FILE, shard_files


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
    are hashed two at a time (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    check_pinned(source, pins, pins_path, names)

    def digest(name: str) -> str:
        size = (source / name).stat().st_size
        if size > (256 << 20):
            log(f"hashing {name} ({size:,} bytes)")
        return sha256_file(source / name)

    with ThreadPoolExecutor(max_workers=2) as pool:
        actual = dict(zip(names, pool.map(digest, names)))
    compare(source, pins, actual, pins_path)
    return actual


def _own_pins_missing(source: Path, pins_path: Path | None) -> str:
    """Where a release folder without its own pins.json was checked against the published pins (the
    default): what to do instead, else ""."""
    from ..data import default_pins

    if pins_path is None or (Path(source) / "pins.json").is_file():
        return ""
    try:
        default = Path(pins_path).resolve() == default_pins().resolve()
    except OSError:
        return ""
    return (f"{source} has no pins.json, so the published clef-flash pins were used; pin the folder "
            f"(clef-export pin {source}) or pass --pins") if default else ""


def check_pinned(source: Path, pins: Pins, pins_path: Path, names: list[str]) -> None:
    for name in names:
        path = source / name
        if name not in pins.files:
            hint = _own_pins_missing(source, pins_path)
            raise IntegrityError(f"{path}: not pinned in {pins_path}; " + (hint or "re-pin the release (clef-export pin) "
                                 "so the backbone's files are pinned"))
        if not path.is_file():
            raise IntegrityError(f"{path}: missing")


def compare(source: Path, pins: Pins, actual: dict[str, str], pins_path: Path | None = None) -> None:
    for name, digest in actual.items():
        if digest != pins.files[name]:
            hint = _own_pins_missing(source, pins_path)
            raise IntegrityError(f"{source / name}: sha256 mismatch (expected {pins.files[name][:12]}…, "
                                 f"got {digest[:12]}…)" + (f"; {hint}" if hint else ""))
