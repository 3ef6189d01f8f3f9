"""Progress of long work on stderr: a rich bar on a terminal, plain lines otherwise, never stdout.

``progress(desc, total, unit)`` yields ``tick(n=1)``. On a terminal (stderr is a tty) it draws a
rich bar that disappears when done, leaving one summary line; elsewhere (CI logs, pipes, tests) it
writes a plain line every ``PLAIN_EVERY_S`` seconds and one when done, so a log shows that the work
moves without a line per step. Nothing is written to stdout: ``--json`` stays clean.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Awaitable, Callable, Iterator, TypeVar

T = TypeVar("T")

PLAIN_EVERY_S = 10.0
PLAIN_MARK = "· "  # a plain progress line begins so (the export worker's are relayed by it)


def _terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def progress(desc: str, total: int, unit: str = "", *, terminal: bool | None = None, file=None) -> Iterator[Callable[[int], None]]:
    """A counter for ``total`` steps of ``desc``; thread-safe ``tick``."""
    out = file if file is not None else sys.stderr
    lock = threading.Lock()
    done = [0]
    t0 = time.perf_counter()
    label = f"{desc} ({unit})" if unit else desc
    if terminal if terminal is not None else _terminal():
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        console = Console(file=out, force_terminal=True)
        with Progress(TextColumn("[dim]·[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
            task = bar.add_task(escape(label), total=total)

            def tick(n: int = 1) -> None:
                with lock:
                    done[0] += n
                bar.advance(task, n)

            yield tick
        console.print(f"[dim]·[/] {escape(label)}: {done[0]}/{total} in {time.perf_counter() - t0:.1f} s", highlight=False)
        return
    last = [t0]

    def tick(n: int = 1) -> None:
        with lock:
            done[0] += n
            now = time.perf_counter()
            if now - last[0] >= PLAIN_EVERY_S and done[0] < total:
                last[0] = now
                left = (now - t0) / max(done[0], 1) * (total - done[0])  # at the pace so far
                print(f"{PLAIN_MARK}{label}: {done[0]}/{total} ({now - t0:.0f} s, about {left:.0f} s left)", file=out, flush=True)

    yield tick
    print(f"{PLAIN_MARK}{label}: {done[0]}/{total} in {time.perf_counter() - t0:.1f} s", file=out, flush=True)


def slow_progress(what: str, log, every: float | None = None) -> Callable[[int, int], None]:
    """``step(done, total)`` for one piece of work that may take minutes (a 9B request's decoder layers
    on a CPU): a line every ``PLAIN_EVERY_S`` with what is left at the pace so far, none for work that
    ends sooner (one request of a tiny release: no line)."""
    t0 = time.perf_counter()
    last = [t0]

    def step(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= (PLAIN_EVERY_S if every is None else every) and done < total:
            last[0] = now
            log(f"{what}: decoder layer {done}/{total} ({now - t0:.0f} s, about {(now - t0) / done * (total - done):.0f} s left)")
    return step


def counting(call: Callable[..., Awaitable[T]], tick: Callable[[int], None]) -> Callable[..., Awaitable[T]]:
    """The async ``call`` wrapped to ``tick()`` once each call completes (asset calls, chunk calls);
    after Ctrl-C it refuses to start another (``interrupts``)."""

    from .interrupts import refuse_if_interrupted

    async def wrapped(*args, **kwargs) -> T:  # noqa: D401
        refuse_if_interrupted()  # no runtime call starts after Ctrl-C (interrupts.run_async)
        out = await call(*args, **kwargs)
        tick(1)
        return out

    return wrapped


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``1 record``, ``2 records``: counts in messages read right."""
    return f"{n:,} {noun if n == 1 else (many or noun + 's')}"
