"""Stage 1: the source. Fetch the pinned files with huggingface_hub, locate a snapshot, verify it.

huggingface_hub checks sizes, not content: the sha256 check here is the only guard, and it runs
after every download and before every use.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..digest import sha256_file
from ..errors import IntegrityError, UsageError
from ..layout import LICENSE_FILES
from .pins import HEAD_FILES, Pins


@dataclass(frozen=True)
class FileCheck:
    name: str
    expected: str
    actual: str | None
    ok: bool
    cause: str  # "ok", "missing", "sha256 mismatch", "not a regular file", or a cached copy's mismatch


CACHED_MISMATCH = "cached copy does not match its pin; run `clef-export fetch` to download it again"


def in_hf_cache(path: Path) -> bool:
    """Whether ``path`` is a snapshot entry of a huggingface_hub cache (a link into ``blobs/``)."""
    return path.is_symlink() and path.resolve().parent.name == "blobs"


def remove_copy(path: Path) -> list[Path]:
    """Remove a file that failed its pin so that no later run uses it: in a huggingface_hub cache,
    the snapshot entry and the blob behind it; elsewhere, the file. Returns what was removed."""
    removed = []
    if in_hf_cache(path):
        blob = path.resolve()
        blob.unlink(missing_ok=True)
        removed.append(blob)
    if path.is_symlink() or path.exists():
        path.unlink()
        removed.append(path)
    return removed


def check_source(source: Path, pins: Pins, names: tuple[str, ...] | None = None) -> list[FileCheck]:
    """sha256 of every pinned file under ``source`` (or of ``names``; symlinks into an HF cache
    are followed)."""
    source = Path(source)
    if not source.is_dir():
        raise IntegrityError(f"{source}: source folder not found")
    checks: list[FileCheck] = []
    for name, expected in sorted(pins.files.items()):
        if names is not None and name not in names:
            continue
        path = source / name
        if not path.exists():
            # the head's files are required; other pinned files (the lm_head shard) only when present
            required = name in HEAD_FILES
            checks.append(FileCheck(name, expected, None, not required, "missing" if required else "absent (optional)"))
            continue
        if not path.is_file():
            checks.append(FileCheck(name, expected, None, False, "not a regular file"))
            continue
        actual = sha256_file(path)
        ok = actual == expected
        cause = "ok" if ok else CACHED_MISMATCH if in_hf_cache(path) else "sha256 mismatch"
        checks.append(FileCheck(name, expected, actual, ok, cause))
    return checks


def require_verified(source: Path, pins: Pins, names: tuple[str, ...] | None = HEAD_FILES) -> list[FileCheck]:
    """``check_source`` of the head's files (by default), raising ``IntegrityError`` on the first
    failed file."""
    checks = check_source(source, pins, names)
    for c in checks:
        if not c.ok:
            detail = f" (expected {c.expected[:12]}…, got {c.actual[:12]}…)" if c.actual else ""
            raise IntegrityError(f"{Path(source) / c.name}: {c.cause}{detail}")
    return checks


def _check_revision(pins: Pins, revision: str | None, allow_unpinned: bool) -> str:
    if pins.revision is None:
        raise UsageError(f"{pins.hf_id}: a local release, not a Hub commit; there is nothing to fetch")
    rev = revision or pins.revision
    if rev != pins.revision and not allow_unpinned:
        raise UsageError(
            f"revision {rev!r} is not the pinned commit {pins.revision}; pass --allow-unpinned to fetch it anyway"
        )
    return rev


def fetch(
    pins: Pins,
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    local_dir: Path | None = None,
    allow_unpinned: bool = False,
    backbone: bool = False,
    log=lambda msg: None,
) -> Path:
    """Download the head's pinned files by commit (``hf_hub_download``), verify each, return their
    folder. (The lm_head shard is fetched on its own, by ``lm-head-table``.) ``backbone``: every
    other pinned file too (config, index, every shard, tokenizer files: what a backbone build reads).

    Honours ``HF_HOME``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` through huggingface_hub itself.
    Bytes that do not match their pin never stay where a later run would use them: a copy already
    there (in the cache or ``local_dir``) that fails its pin is removed and downloaded again, and a
    download that fails its pin is removed (the cache's snapshot entry and its blob) before the error.
    """
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import logging as hf_logging

    rev = _check_revision(pins, revision, allow_unpinned)
    hf_logging.set_verbosity_error()  # our one-line errors say what failed; no retry chatter
    folder: Path | None = None
    licence = [f for f in LICENSE_FILES if f in pins.files]  # small; a release's dist/ ships them
    names = list(HEAD_FILES) + (sorted(set(pins.files) - set(HEAD_FILES)) if backbone else licence)
    for name in names:
        where = f"{pins.hf_id}@{rev[:12]}/{name}"
        if local_dir is not None:
            existing: Path | None = Path(local_dir) / name
        else:
            hit = try_to_load_from_cache(pins.hf_id, name, revision=rev, cache_dir=cache_dir)
            existing = Path(hit) if isinstance(hit, str) else None
        if existing is not None and existing.is_file():
            if sha256_file(existing) == pins.files[name]:
                folder = existing.parent if folder is None else folder
                continue  # already here and verified: nothing to download
            removed = remove_copy(existing)
            log(f"{existing}: the copy already there does not match its pin; removed "
                f"{', '.join(str(p) for p in removed)} and downloading it again")
        path = download_file(pins.hf_id, name, rev, where, cache_dir, local_dir)
        actual = sha256_file(path)
        if actual != pins.files[name]:
            removed = remove_copy(path)
            raise IntegrityError(
                f"{path}: sha256 mismatch after download (expected {pins.files[name][:12]}…, got {actual[:12]}…); "
                f"removed {len(removed)} file(s), nothing unverified is left; run `clef-export fetch` again"
            )
        folder = path.parent if folder is None else folder
    assert folder is not None
    return folder


@contextlib.contextmanager
def hub_errors(repo: str, rev: str, where: str, what: str = "download"):
    """huggingface_hub's failures as one-line ``IntegrityError``s naming ``where``."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError:
        raise IntegrityError(f"{repo}@{rev}: revision not found on the Hub ({what} of {where})") from None
    except LocalEntryNotFoundError as exc:  # before EntryNotFoundError: it is a subclass
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise IntegrityError(f"{where}: not in the cache and HF_HUB_OFFLINE is set; run `clef-export fetch` online") from None
        raise IntegrityError(f"{where}: {what} failed ({_cause(exc)})") from None
    except EntryNotFoundError:
        raise IntegrityError(f"{where}: file not found on the Hub") from None
    except RepositoryNotFoundError:
        raise IntegrityError(f"{repo}: repository not found on the Hub") from None
    except HfHubHTTPError as exc:
        code = getattr(getattr(exc, "response", None), "status_code", "?")
        raise IntegrityError(f"{where}: {what} failed (HTTP {code})") from None
    except Exception as exc:  # connection reset, timeout, truncated body: all mean "no verified file"
        raise IntegrityError(f"{where}: {what} failed ({_cause(exc)})") from None


def download_file(repo: str, name: str, rev: str, where: str, cache_dir: Path | None, local_dir: Path | None) -> Path:
    """One ``hf_hub_download`` by commit; its failures as one-line ``IntegrityError``s."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo, rev, where):
        return Path(hf_hub_download(repo, name, revision=rev, cache_dir=str(cache_dir) if cache_dir else None,
                                    local_dir=str(local_dir) if local_dir else None))


def _cause(exc: BaseException) -> str:
    """The innermost cause of a download failure, in one line."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


def cached_snapshot(pins: Pins, cache_dir: Path | None = None) -> Path:
    """The snapshot folder of the pinned revision in the HF cache, with zero network access."""
    from huggingface_hub import try_to_load_from_cache

    folder: Path | None = None
    for name in HEAD_FILES:
        hit = try_to_load_from_cache(pins.hf_id, name, revision=pins.revision, cache_dir=cache_dir)
        if not isinstance(hit, str):
            raise IntegrityError(
                f"{pins.hf_id}@{pins.revision[:12]}/{name}: not in the cache; run `clef-export fetch`"
            )
        folder = Path(hit).parent
    assert folder is not None
    return folder


def resolve_source(source: Path | None, pins: Pins) -> Path:
    """An explicit ``--source`` folder, else the pinned snapshot in the HF cache."""
    if source is not None:
        return Path(source)
    if pins.revision is None:
        raise UsageError(f"{pins.hf_id}: a local release; pass --source with its folder")
    return cached_snapshot(pins)
