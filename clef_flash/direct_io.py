"""``O_DIRECT`` where the file system takes it, plain I/O where it does not (a leaf: os only).

Reads and writes that bypass the page cache: on this project's machines, filling the cache costs
the kernel 0.7-1.2 s of CPU per GB, and a file read once has nothing to gain from it. Buffers,
offsets and lengths must then be whole blocks (4096 covers every device here)."""

from __future__ import annotations

import errno
import os


def open_direct(path, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened with ``O_DIRECT`` added, or without it where the system or
    the file system refuses it (a tmpfs). A file it creates gets ``mode`` (less the umask): data,
    not a program."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, mode), True
        except OSError:
            pass
    return os.open(path, flags, mode), False


def refused(fd: int, exc: OSError) -> bool:
    """Whether ``exc`` is ``O_DIRECT`` refusing an I/O on ``fd`` (``EINVAL`` with the flag set: a
    file system that opens with it and refuses the transfer); if so, ``fd`` is made buffered, and
    the same I/O can be tried again."""
    import fcntl

    flag = getattr(os, "O_DIRECT", 0)
    if exc.errno != errno.EINVAL or not flag or not fcntl.fcntl(fd, fcntl.F_GETFL) & flag:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~flag)
    return True
