"""A release folder's backbone files: which a build reads (config, index, every shard, the
tokenizer files), each checked against the pins, and the text configuration they describe."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..digest import sha256_file
from ..errors import IntegrityError
from ..sources.pinning import BACKBONE_CONFIG, TOKENIZER_FILES
from ..sources.pins import Pins
from .contract import TextConfig, read_text_config
from ..sources.safetensors import INDEX_FILE, shard_files

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
    compare(source, pins, actual)
    return actual


def check_pinned(source: Path, pins: Pins, pins_path: Path, names: list[str]) -> None:
    for name in names:
        path = source / name
        if name not in pins.files:
            raise IntegrityError(f"{path}: not pinned in {pins_path}; re-pin the release (clef-export pin) so the "
                                 f"backbone's files are pinned")
        if not path.is_file():
            raise IntegrityError(f"{path}: missing")


def compare(source: Path, pins: Pins, actual: dict[str, str]) -> None:
    for name, digest in actual.items():
        if digest != pins.files[name]:
            raise IntegrityError(f"{source / name}: sha256 mismatch (expected {pins.files[name][:12]}…, "
                                 f"got {digest[:12]}…)")


class BackgroundHashes:
    """The shards' sha256 taken in a thread while the export runs (the trace is one core of Python;
    this is the other). ``digests()`` joins it (``compare`` then checks them against the pins, so
    nothing lands from a release whose weights are not the pinned ones); ``stop()`` ends it early
    when the build fails for another reason. Reading unverified weights is harmless: they are data,
    nothing of the release is executed, and the bundle is published only after the check."""

    def __init__(self, source: Path, names: list[str]) -> None:
        import threading

        self.source, self.names = source, names
        self._stop = threading.Event()
        self._done: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="clef-shard-hashes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(8 << 20)  # sha256_file's reads, stoppable between blocks
        view = memoryview(buf)
        try:
            for name in self.names:
                h = hashlib.sha256()
                with open(self.source / name, "rb", buffering=0) as fh:
                    while not self._stop.is_set():
                        n = fh.readinto(buf)
                        if not n:
                            break
                        h.update(view[:n])
                if self._stop.is_set():
                    return
                self._done[name] = h.hexdigest()
        except BaseException as exc:  # noqa: BLE001 (re-raised in digests())
            self._error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def digests(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise IntegrityError(f"{self.source}: hashing the shards failed: {self._error}")
        return dict(self._done)


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
