"""Streaming sha256 of files, bytes and folder trees, a tree's size, and a release's SHA256SUMS read (a leaf:
hashlib and the leaves errors and layout)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Streaming sha256 of a file (hashlib's file_digest: large reads, no Python loop)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_files(root: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """Every regular file under ``root`` (relative POSIX path -> sha256), sorted; a symlink is
    listed as ``symlink`` and never followed. ``known``: digests this process has just taken of
    files it wrote (a 16 GB ``main.mlirb`` is not read again for them)."""
    root = Path(root)
    known = known or {}
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "symlink"
        elif p.is_file():
            out[rel] = known[rel] if rel in known else sha256_file(p)
    return out


def tree_hash(root: Path) -> str:
    """One sha256 over a tree's file names and digests."""
    lines = "".join(f"{k}\0{v}\n" for k, v in tree_files(root).items())
    return hashlib.sha256(lines.encode()).hexdigest()


def tree_bytes(root: Path) -> int:
    """The bytes of every regular file under ``root``."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def read_sums(dist: Path) -> dict[str, str]:
    """SHA256SUMS as file -> sha256; a malformed line is an ``IntegrityError`` naming it."""
    from .errors import IntegrityError
    from .layout import SUMS_FILE

    path = Path(dist) / SUMS_FILE
    if not path.is_file():
        raise IntegrityError(f"{path}: missing; a release's dist/ has one (`clef-export release` writes it)")
    out: dict[str, str] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or name.startswith("/") or ".." in name.split("/"):
            raise IntegrityError(f"{path}:{i}: not a `sha256  file` line")
        out[name] = digest
    return out
