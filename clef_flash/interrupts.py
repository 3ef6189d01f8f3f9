"""Ctrl-C and SIGTERM, the same at any moment of any command: exit 130, one line, nothing landed.

Two hazards make the default ``KeyboardInterrupt`` unsafe here. The Core AI runtime runs calls on
its own threads and answers through the asyncio loop: an exception that stops the loop while a call
is in flight leaves the runtime calling back into a closed loop, and the process dies natively
(SIGILL / SIGABRT). And an exception raised inside a ``__del__`` or a callback is printed and
dropped, so a build could go on and land.

So every signal sets a flag (``interrupted``) that the landing steps check (``check_interrupted``
before each rename: nothing lands once it is set), and outside runtime work it also raises
``Interrupt`` at once: a ``BaseException`` like ``KeyboardInterrupt`` (no ``except Exception``
swallows it, every ``finally`` and cleanup runs), but not one, so click does not turn it into
"Aborted!" and exit 1 where a command is not inside the CLI's ``_run``. Inside ``run_async``
(runtime work) the signal only sets the flag: each new runtime call is refused (``Interrupted``,
raised by ``refuse_if_interrupted`` where calls start), the calls in flight finish, the loop closes
cleanly, and then ``Interrupt`` is raised.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")
_flag = threading.Event()
_deferring = [0]


class Interrupt(BaseException):
    """Ctrl-C or SIGTERM: the command stops, lands nothing, and exits 130."""


class Interrupted(Exception):
    """Raised inside runtime work once a signal came: an ordinary exception, so the coroutines and
    the runtime's context managers unwind normally (``KeyboardInterrupt`` would stop the loop)."""


def _on_signal(signum, frame) -> None:
    _flag.set()
    if not _deferring[0]:
        raise Interrupt()


def install() -> None:
    """The handlers for this process (the CLI's main thread)."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def interrupted() -> bool:
    return _flag.is_set()


def check_interrupted() -> None:
    if _flag.is_set():
        raise Interrupt()


def refuse_if_interrupted() -> None:
    """At the start of a runtime call: none starts after a signal."""
    if _flag.is_set():
        raise Interrupted()


def clear() -> None:
    """Forget a signal (tests that send one in-process)."""
    _flag.clear()


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(make())`` with signals deferred until the runtime's calls have returned."""
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
    out = await asyncio.gather(*aws, return_exceptions=True)
    for x in out:
        if isinstance(x, Interrupted):
            raise x
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out  # type: ignore[return-value]
