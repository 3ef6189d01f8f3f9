"""Atomic outputs: temp sibling on the same file system, fsync, rename; a lock per output.

A bundle appears complete or not at all. ``staged_dir`` builds into ``.<name>.tmp-<pid>-<rand>``
next to the final path and swaps it in with one rename (RENAME_EXCHANGE where the kernel has it,
so ``--overwrite`` never leaves the final path holding a partial bundle).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import IntegrityError, OutputError, UsageError
from .interrupts import check_interrupted, removed_at_a_forced_stop

_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temp sibling and a rename (never follows a symlink)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        raise UsageError(f"{path}: refusing to write through a symlink")
    tmp = path.with_name(f".{path.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        check_interrupted()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def read_json(path: Path, error: type = IntegrityError, hint: str = "") -> Any:
    """A JSON file's value, or one typed error naming the file: missing (with ``hint``), a folder,
    or not JSON. Every reader of a release's, a bundle's or a dist's JSON files goes through here."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: missing" + (f"; {hint}" if hint else "")) from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a JSON file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not JSON ({exc})") from None


def dumps_json(obj: Any, sort_keys: bool = False) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n").encode("utf-8")


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, dumps_json(obj))


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(final: Path) -> list[Path]:
    """Remove temp / old siblings of ``final`` left by a run that no longer exists."""
    removed = []
    parent = final.parent
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        for tag in (_TMP_TAG, _OLD_TAG):
            prefix = f".{final.name}{tag}"
            if p.name.startswith(prefix):
                pid_text = p.name[len(prefix) :].split("-", 1)[0]
                if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    removed.append(p)
    return removed


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def check_output_path(final: Path, overwrite: bool) -> None:
    """Refuse symlinks, existing bundles without ``--overwrite``, unwritable parents — before work."""
    if final.is_symlink():
        raise UsageError(f"{final}: output path is a symlink; refusing to follow it")
    if final.exists() and not overwrite:
        raise UsageError(f"{final}: already exists; pass --overwrite to replace it")
    parent = final.parent
    for p in [parent, *parent.parents]:
        if p.is_symlink() and p == parent:
            break
        if p.exists():
            if not p.is_dir():
                raise UsageError(f"{p}: not a folder")
            break
    # root ignores permission bits, so probe by creating a file rather than trusting os.access.
    probe_root = parent if parent.exists() else next(p for p in parent.parents if p.exists())
    probe = probe_root / f".{final.name}.probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{probe_root}: output folder is not writable ({exc.strerror})") from None


def check_free_space(where: Path, need: int, what: str) -> None:
    """Fail before the expensive work when ``what`` (``need`` bytes) cannot fit at ``where``."""
    where = Path(where)
    probe = next(p for p in [where, *where.parents] if p.exists())
    free = shutil.disk_usage(probe).free
    if free < need:
        raise OutputError(f"{where}: not enough free space for {what} (needs about {need:,} bytes, {free:,} free)")


def _missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    out = []
    for p in [path, *path.parents]:
        if p.exists() or p.is_symlink():
            break
        out.append(p)
    return out


@contextlib.contextmanager
def output_lock(final: Path) -> Iterator[None]:
    """One writer per output path: a second concurrent build gets a clear error at once. The lock
    file goes when the lock does, and the folders made for it go too when nothing landed in them
    (a failed build leaves no empty ``--out`` behind)."""
    made = _missing_parents(final.parent)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{final}: another build is writing this output (lock {lock_path.name})") from None
        try:  # the file may have been unlinked by the holder we waited for: lock the one on disk
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)  # while still holding it: a waiter re-checks the inode above
        os.close(fd)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty


@contextlib.contextmanager
def staged_dir(final: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp sibling folder; on success it replaces ``final`` in one step, else vanishes."""
    final = Path(final)
    remove_stale(final)
    tmp = final.with_name(f".{final.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir(parents=True)
    removed_at_a_forced_stop(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        check_interrupted()  # an interrupt swallowed on the way (a __del__, a native callback) lands nothing
        if final.exists() or final.is_symlink():
            if final.is_symlink() or not overwrite:
                raise UsageError(f"{final}: appeared during the build; not replacing it")
            if not _rename_exchange(tmp, final):
                old = final.with_name(f".{final.name}{_OLD_TAG}{os.getpid()}-{secrets.token_hex(4)}")
                os.rename(final, old)
                os.rename(tmp, final)
                tmp = old
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        removed_at_a_forced_stop(tmp, keep=False)



@contextlib.contextmanager
def staged_files(folder: Path, names: tuple[str, ...], overwrite: bool) -> Iterator[Path]:
    """A temp folder for files that land in ``folder`` under ``names`` together, or not at all.

    A ``folder`` that does not exist yet is itself staged (``staged_dir``): a failure leaves no
    folder behind. In an existing one the files are made in a temp subfolder and renamed over their
    names at the end, in the order given; anything else in the folder is left alone. A killed
    run's temp subfolder is swept by the next one."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        check_output_path(folder, overwrite=False)
        with staged_dir(folder, overwrite=False) as tmp:
            yield tmp
        return
    for name in names:
        check_output_path(folder / name, overwrite)
    remove_stale(folder / names[0])
    tmp = folder / f".{names[0]}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        check_interrupted()
        for name in names:
            os.replace(tmp / name, folder / name)
        _fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
