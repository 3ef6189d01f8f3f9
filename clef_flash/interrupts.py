"""Ctrl-C and SIGTERM, the same at any moment of any command: exit 130, one line, nothing landed.

How it works: docs/modules.md."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")
_flag = threading.Event()
_deferring = [0]


class Interrupt(BaseException):
    """Ctrl-C or SIGTERM: the command stops, lands nothing, and exits 130."""


class Interrupted(Exception):
    """Raised inside runtime work once a signal came: an ordinary exception, so the coroutines and
    the runtime's context managers unwind normally (``KeyboardInterrupt`` would stop the loop)."""


def _in_import(frame) -> bool:
    """Whether the signal came while a module was being imported: raising there leaves it half
    initialised (a native one, torch or the Core AI runtime, can then abort the process at exit)."""
    depth = 0
    while frame is not None and depth < 400:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame, depth = frame.f_back, depth + 1
    return False


_redelivering = threading.Event()
REDELIVER_S = 0.05  # how soon a signal that came during an import is sent again


_raised = threading.Event()  # an Interrupt was raised: the command is unwinding


def _redeliver(signum: int) -> None:
    """The signal sent again shortly (from a thread): the handler then runs where the import has
    ended, so the command stops there rather than at its next safe point, or at its end. Not once
    the command is unwinding (a safe point raised it meanwhile): a second Interrupt inside its
    clean-up, or inside the runtime's teardown, is what aborts a native runtime."""
    time.sleep(REDELIVER_S)
    _redelivering.clear()
    if not _raised.is_set():
        os.kill(os.getpid(), signum)


def _interrupt() -> Interrupt:
    _raised.set()
    return Interrupt()


# A signal while runtime calls are in flight waits for them to return (the runtime aborts the process
# when interrupted inside a call); one call lasts minutes at 9B on the Linux CPU runtime. Past this
# grace the command stops anyway: its folders in progress removed, exit 130, nothing landed.
STOP_GRACE_S = 3.0
_in_progress: set[str] = set()  # folders a forced stop removes: staged bundles, the runtime's compiled copies
_stopping = threading.Event()


def removed_at_a_forced_stop(folder, keep: bool = True) -> None:
    """``folder`` is work in progress (``keep``) or no longer (``keep=False``): a forced stop removes it."""
    (_in_progress.add if keep else _in_progress.discard)(str(folder))


def _stop_after_grace() -> None:
    """Exit 130 once ``STOP_GRACE_S`` has passed with the runtime's calls still in flight (a thread:
    the main one is inside them). ``os._exit``: no teardown of a runtime that is mid-call."""
    time.sleep(STOP_GRACE_S)
    if not _deferring[0]:
        return  # the calls returned: the command unwinds as usual
    stop_now("interrupted: nothing was written (a runtime call in flight was stopped)")


def stop_now(message: str) -> None:
    """Exit 130 now: ``message`` on stderr, the folders in progress removed. ``os._exit``: no
    teardown of a runtime that is mid-call (that aborts the process)."""
    import shutil
    import sys

    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        for folder in sorted(_in_progress):
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(130)


def _on_signal(signum, frame) -> None:
    _flag.set()
    if _deferring[0]:
        if not _stopping.is_set():  # the runtime's calls return first, or the grace runs out
            _stopping.set()
            threading.Thread(target=_stop_after_grace, name="clef-stop", daemon=True).start()
        return  # run_async raises it when they have returned
    if _in_import(frame):
        if not _redelivering.is_set():
            _redelivering.set()
            threading.Thread(target=_redeliver, args=(signum,), daemon=True).start()
        return
    raise _interrupt()


def install() -> None:
    """The handlers for this process (the CLI's main thread). A signal that lands in a ``__del__``
    or a callback is not printed as "Exception ignored": the flag keeps it, and the next landing
    step or runtime boundary acts on it."""
    import sys

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)  # a closed terminal: the same stop, nothing landed
    if getattr(sys.unraisablehook, "_clef_interrupts", False):
        return
    previous = sys.unraisablehook

    def unraisable(info) -> None:
        if isinstance(info.exc_value, Interrupt):
            return
        previous(info)

    unraisable._clef_interrupts = True  # type: ignore[attr-defined]
    sys.unraisablehook = unraisable


def done() -> None:
    """The command has finished (what it wrote is whole): a signal from now on changes nothing,
    and the interpreter's teardown must not die of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def interrupted() -> bool:
    return _flag.is_set()


def check_interrupted() -> None:
    if _flag.is_set():
        raise _interrupt()


def refuse_if_interrupted() -> None:
    """At the start of a runtime call: none starts after a signal."""
    if _flag.is_set():
        raise Interrupted()


def clear() -> None:
    """Forget a signal (tests that send one in-process)."""
    _flag.clear()
    _raised.clear()
    _stopping.clear()


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(make())`` with signals deferred until the runtime's calls have returned."""
    import asyncio

    check_interrupted()
    _deferring[0] += 1
    try:
        result: Any = asyncio.run(make())
    except Interrupted:
        result = None
    finally:
        _deferring[0] -= 1
    check_interrupted()
    return result


async def gather_all(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that waits for every call before raising the first error: no call is left
    in flight when the loop closes."""
    import asyncio

    out = await asyncio.gather(*aws, return_exceptions=True)
    for x in out:
        if isinstance(x, Interrupted):
            raise x
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out  # type: ignore[return-value]


def die_with_parent(env_name: str) -> None:
    """A child process ends when the process that started it ends, a SIGKILL included (Linux:
    ``PR_SET_PDEATHSIG``): ``env_name`` holds the parent's pid, set by the parent when it started
    the child. If the parent was gone before the call, the child ends now. Elsewhere a no-op (the
    child's next write to its parent's pipe fails instead)."""
    import os
    import sys

    parent = os.environ.get(env_name)
    if not sys.platform.startswith("linux") or not parent:
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:
        os._exit(1)
