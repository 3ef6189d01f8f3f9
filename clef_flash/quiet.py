"""The Core AI runtime's own lines (``ODIE [default]: Loading function 't512'``) kept off the terminal.

How it works: docs/modules.md."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading

_VERBOSE = False
_LOCK = threading.RLock()
_DEPTH = 0
_KEPT: list[str] = []
_LIMIT = 200  # lines kept for error messages


def set_verbose(value: bool) -> None:
    global _VERBOSE
    _VERBOSE = bool(value)


def captured() -> list[str]:
    """The runtime's lines captured so far in this process (the last ``_LIMIT``)."""
    return list(_KEPT)


def _stderr_is_fd2() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False  # a test runner's capture: it is not the terminal, leave it be


@contextlib.contextmanager
def native_stderr():
    """fd 2 captured for the block (nested blocks share the outer capture)."""
    global _DEPTH
    if _VERBOSE:
        yield
        return
    with _LOCK:
        _DEPTH += 1
        outer = _DEPTH == 1
    if not outer:
        try:
            yield
        finally:
            with _LOCK:
                _DEPTH -= 1
        return
    sys.stdout.flush()
    swap = _stderr_is_fd2()
    if swap:
        sys.stderr.flush()
    saved = os.dup(2)
    old_stderr = sys.stderr
    sink = tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 2)
    if swap:  # our own lines still reach the terminal, through a duplicate of the original fd 2
        sys.stderr = open(os.dup(saved), "w", buffering=1, encoding=getattr(old_stderr, "encoding", None) or "utf-8",
                          errors="backslashreplace")
    failed = False
    try:
        yield
    except BaseException as exc:
        from .interrupts import Interrupt

        failed = not isinstance(exc, (Interrupt, KeyboardInterrupt))  # Ctrl-C is one line, not the runtime's
        raise
    finally:
        if swap:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = old_stderr
        os.dup2(saved, 2)
        os.close(saved)
        sink.seek(0)
        lines = sink.read().decode("utf-8", "backslashreplace").splitlines()
        sink.close()
        _KEPT.extend(lines)
        del _KEPT[:-_LIMIT]
        if failed and lines:
            print("the Core AI runtime said:\n  " + "\n  ".join(lines[-20:]), file=sys.stderr)
        with _LOCK:
            _DEPTH -= 1
