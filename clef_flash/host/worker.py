"""The assets of ``serve`` in a worker process the server replaces: the Core AI runtime grows a
process's memory a little with every call and gives none back (docs/performance.md), so the
server's memory is held flat by running the assets in a child and starting a new one once the
child has grown past a mark (or answered a number of requests). Requests stay queued in the server:
a worker is replaced between two requests, so none is lost or answered twice; a worker that dies
mid-request costs that request a 500, and the next is answered by a new one.

The protocol: length-prefixed pickles over the child's stdin and a duplicate of its stdout (its
fd 1 then points at stderr, so a library's stray print cannot break a frame)."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .requests import RequestError

PARENT_ENV = "CLEF_EXPORT_SERVE_PARENT"
_HEADER = struct.Struct(">Q")
STOP_S = 10.0  # a worker asked to stop that has not, by then, is killed
# the worker's memory mark is taken after this many answers: its first requests load what later
# ones reuse (a tower function a bucket, the allocator's pools); measured from its first answer, a
# tiny worker was replaced every ~10 requests for that warm-up, not for the runtime's growth
WARM_AFTER = 10


class WorkerGone(Exception):
    """The worker ended mid-request (killed, out of memory, a crash in the runtime)."""


@dataclass(frozen=True)
class Reply:
    response: dict[str, Any]
    bucket: str  # the head function that ran
    tokens: int
    decoder: str  # the decoder function that ran


@dataclass(frozen=True)
class WorkerSpec:
    root: Path
    sums: dict[str, str]  # the dist's SHA256SUMS, checked by the server: a worker does not hash again
    engine: str
    device: str


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def anon_bytes(pid: int) -> int | None:
    """A process's anonymous + shared memory (what it holds itself), where /proc says it."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem") if k in fields)
    except (OSError, ValueError):
        return None


class Worker:
    """One child process holding the dist's assets, answering one request at a time."""

    def __init__(self, spec: WorkerSpec, scratch: Path, log=lambda msg: None):
        self.spec, self.scratch, self.log = spec, scratch, log
        self.proc: asyncio.subprocess.Process | None = None
        self.engine = ""  # what runs its decoder (backbone.executor.EngineInfo.describe)
        self.why = ""
        self.answered = 0
        self.base: int | None = None  # its memory after WARM_AFTER answers: the mark grows from there

    async def start(self) -> None:
        env = {**os.environ, "TMPDIR": str(self.scratch), PARENT_ENV: str(os.getpid())}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        self._send(self.spec)
        kind, *rest = await self._recv()
        if kind != "ready":
            raise RuntimeError(f"the worker did not start: {rest[0] if rest else kind}")
        self.engine, self.why = rest

    def _send(self, obj: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(_frame(obj))

    async def _recv(self) -> tuple:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            head = await self.proc.stdout.readexactly(_HEADER.size)
            return pickle.loads(await self.proc.stdout.readexactly(_HEADER.unpack(head)[0]))
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self.proc.wait()
            raise WorkerGone(f"the worker (pid {self.proc.pid}) ended mid-request, exit {code}") from None

    async def answer(self, body: dict[str, Any]) -> Reply:
        """``body`` answered (``RequestError`` when it cannot be; ``WorkerGone`` when the worker died)."""
        try:
            self._send(("answer", body))
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            raise WorkerGone(f"the worker (pid {self.proc.pid}) is gone") from None
        kind, *rest = await self._recv()
        if kind == "refused":
            status, field, reason = rest
            raise RequestError(field, reason, status)
        if kind == "failed":
            raise RuntimeError(rest[0])
        self.answered += 1
        if self.answered == WARM_AFTER:
            self.base = anon_bytes(self.proc.pid)
        return Reply(*rest)

    def grown(self) -> float | None:
        """Its memory's growth since its mark was taken, as a fraction (None before, or where unknown)."""
        now = anon_bytes(self.proc.pid) if self.proc is not None else None
        return None if now is None or not self.base else now / self.base - 1.0

    async def stop(self) -> None:
        """Asked to end (its assets closed); killed if it has not within ``STOP_S``."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self._send(None)
            await self.proc.stdin.drain()
            self.proc.stdin.close()
            await asyncio.wait_for(self.proc.wait(), STOP_S)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):
            self.proc.kill()
            await self.proc.wait()


# ---------------------------------------------------------------- the child


def _main() -> None:
    import signal

    from ..interrupts import die_with_parent

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # the server decides when a worker ends
    die_with_parent(PARENT_ENV)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to the server's log, never into a frame
    inp = sys.stdin.buffer

    def recv() -> Any:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return None
        return pickle.loads(inp.read(_HEADER.unpack(head)[0]))

    def send(obj: Any) -> None:
        out.write(_frame(obj))
        out.flush()

    from .dist import open_checked

    spec = recv()
    try:
        dist = open_checked(spec.root, spec.sums)  # its bundles read (the runtime's own loop: not inside ours)
    except Exception as exc:  # said to the server, which stops
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    asyncio.run(_serve(dist, spec, recv, send))


async def _serve(dist, spec: WorkerSpec, recv, send) -> None:
    from .model import ClefHost

    try:
        host = ClefHost(dist, spec.engine, spec.device)
        await host.__aenter__()
    except Exception as exc:  # said to the server, which stops
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        send(("ready", host.engine.describe(), host.choice.why))
        while True:
            msg = await asyncio.to_thread(recv)
            if msg is None:
                return
            _, body = msg
            try:
                answered = await host.answer(body)
            except RequestError as exc:
                send(("refused", exc.status, exc.field, exc.reason))
            except Exception as exc:  # the request's own failure: the server answers 500 and keeps serving
                send(("failed", f"{type(exc).__name__}: {exc}"))
            else:
                send(("ok", answered.response, answered.bucket, len(answered.encoded.ids), answered.decoder))
    finally:
        await host.__aexit__(None, None, None)


if __name__ == "__main__":
    _main()
