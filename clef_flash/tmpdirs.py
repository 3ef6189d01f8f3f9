"""Temporary folders that no exit leaves behind, SIGKILL included.

The Core AI runtime compiles an asset into a ``TemporaryDirectory`` before it runs it (a compiled
fp32 copy of the weights: 7.5 GB for a real-width 4-layer slice); a process killed there would
strand it in the system's temp folder. Each process therefore takes a folder of its own,
``.clef-tmp-<pid>-*``, as ``tempfile``'s default while it runs the runtime; the folder is removed
when the block ends, and folders of processes that no longer exist are swept on the next use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = ".clef-tmp-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the folders of processes that are gone; returns what was removed."""
    gone = []
    for p in Path(parent).glob(PREFIX + "*"):
        try:
            pid = int(p.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def owned_folder(parent: Path | None = None, label: str = "") -> Path:
    """A new folder of this process's own in ``parent`` (the system's temp folder by default), the
    folders of processes that are gone swept first; the caller removes it."""
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_orphans(parent)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{label + '-' if label else ''}", dir=parent))


@contextlib.contextmanager
def owned_tempdir(parent: Path | None = None):
    """A folder of this process's own as ``tempfile``'s default for the block; removed at its end."""
    from .interrupts import removed_at_a_forced_stop

    folder = owned_folder(parent)
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    removed_at_a_forced_stop(folder)  # the runtime's compiled copy: gone with a stop that cannot wait for it
    try:
        yield folder
    finally:
        tempfile.tempdir = before
        shutil.rmtree(folder, ignore_errors=True)
        removed_at_a_forced_stop(folder, keep=False)
