"""A compressed build's codes and scales made ahead of the save, while the graph is traced.

How it works: docs/modules.md."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from ..interrupts import die_with_parent

PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
DISK_MARGIN = 1 << 30  # free bytes left beyond the scratch's worst case before this starts
NICE = 10
PARENT_ENV = "CLEF_AHEAD_PARENT_PID"
PARTS = ("codes", "scales")  # what the process makes of each tensor


def _punch(fd: int, offset: int, length: int) -> None:
    """Free a slot's disk blocks and cached pages (Linux ``fallocate``); elsewhere the slot stays
    until the scratch file goes."""
    if not sys.platform.startswith("linux") or length <= 0:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate(ctypes.c_int(fd), ctypes.c_int(PUNCH), ctypes.c_longlong(offset), ctypes.c_longlong(length))
    except (OSError, AttributeError):
        pass


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """``view`` filled from ``offset`` of the file (``os.pread`` and a copy where Python lacks ``preadv``)."""
    while view:
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view], offset)
        else:
            data = os.pread(fd, len(view), offset)
            got = len(data)
            view[:got] = data
        if not got:
            raise OSError(f"the scratch file ends at byte {offset}")
        view, offset = view[got:], offset + got


def job_of(weights, names: list[str], hashed=()) -> dict:
    """The process's job: the release, the scratch file's descriptor, the scheme, each compressed
    tensor's place in the release and slots in the scratch file, in the order to make them, and the
    shards whose sha256 it takes on the way (``hashed``)."""
    tasks = []
    for n in names:
        t = weights.streamed[n]
        tasks.append({"name": n, "file": t.file, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                      "k": weights.exponents[n], "slots": {p: list(weights._slots[(n, p)]) for p in PARTS}})
    return {"folder": str(weights.folder), "fd": weights._fd, "tasks": tasks,
            "scheme": [weights.scheme.bits, weights.scheme.block], "hash": sorted(hashed)}


def start(weights, log: Callable[[str], None] = lambda m: None, hashed=()) -> "Ahead | None":
    """Start making the compressed tensors' codes and scales of ``weights`` (``Fp16Weights``,
    streamed) in a process of their own while the graph is traced; its ``stream`` then reads them
    back. None where there are none, or where the disk could not hold them beside the asset (each
    slot is freed once the save has read it, but a file system without hole punching keeps them all).

    The process reads each shard once, start to end (``shard_reads``), and takes the sha256 of those in
    ``hashed`` from the same read (``Ahead.digests``): the pins' hashes no longer read the release
    a second time.

    Only the compressed ones: the quantizer is the save's CPU (9B int8: 23.6 s of its 34.8 s),
    and its bytes are 0.6x fp16. An fp16 tensor's conversion is cheap and its bytes are what the
    disk pays twice: made ahead too, the 9B fp16 export took 59.8-67.0 s instead of 52.5."""
    import shutil

    names = sorted((n for n in weights.streamed if n in weights.compressed), reverse=True)
    if not names or weights._ahead is not None:
        return None
    need = sum(size for (n, _p), (_off, size) in weights._slots.items() if n in names)
    free = shutil.disk_usage(weights._dir).free
    if free < 2 * need + DISK_MARGIN:
        log(f"{weights._dir}: {free / 1e9:.1f} GB free, {2 * need / 1e9:.1f} GB would hold the weights made ahead "
            "and the asset: made while the asset is written instead")
        return None
    # the order the converter gives them in (the reverse of the names' order, measured), until the save says
    weights._ahead = Ahead(weights, names, log, hashed)
    return weights._ahead


class Ahead:
    """The parent's side: starts the process, follows its progress, and reads each slot back."""

    def __init__(self, weights, names: list[str], log: Callable[[str], None] = lambda m: None, hashed=()) -> None:
        self.w = weights
        self.log = log
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.made: dict[tuple[str, str], int] = {}  # (name, part) -> bytes made
        self.hashed: dict[str, str] = {}  # shard -> sha256, as the process reads them
        self.stopped: str | None = None  # why the process ended before making everything
        self.finished = False
        self._cond = threading.Condition()
        self.proc = subprocess.Popen([sys.executable, "-m", "clef_flash.engine.codes_ahead", json.dumps(job_of(weights, self.names, hashed))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     pass_fds=(weights._fd,), text=True, env={**os.environ, PARENT_ENV: str(os.getpid())})
        self._reader = threading.Thread(target=self._follow, name="clef-ahead", daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            head, _, rest = line.rstrip("\n").partition(" ")
            with self._cond:
                if head == "error":
                    self.stopped = rest
                elif head == "done":
                    self.finished = True
                elif head == "sha":
                    shard, digest = json.loads(rest)
                    self.hashed[shard] = digest
                else:
                    part, _, n = rest.partition(" ")
                    self.made[(self.names[int(head)], part)] = int(n)
                self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            if not self.finished and self.stopped is None:
                self.stopped = f"it exited with status {self.proc.returncode}"
            self._cond.notify_all()

    def digests(self) -> dict[str, str]:
        """The shards' sha256 the process took, once it has read them all or stopped (the save may
        end before it has read a shard nothing compressed lies in)."""
        with self._cond:
            while self.stopped is None and not self.finished:
                self._cond.wait()
            return dict(self.hashed)

    def covers(self, name: str) -> bool:
        return name in self.index

    def order(self, names: list[str]) -> None:
        """The save's order (its first request for each tensor): the process makes the rest in it."""
        wanted = [n for n in dict.fromkeys(names) if n in self.index]
        with self._cond:
            done = sum(1 for n in self.names if all(self.made.get((n, p), -1) == self.w._slots[(n, p)][1] for p in PARTS))
        self.log(f"{done} of {len(self.names)} compressed tensors made ahead when the save began"
                 + ("" if wanted == self.names else "; the shards left read in the save's order"))
        if wanted != self.names:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps([self.index[n] for n in wanted]) + "\n")  # indices: well within a pipe's buffer
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it ended: the save makes what is missing

    def _wait(self, key: tuple[str, str], pos: int) -> int | None:
        """Bytes of ``key`` made once more than ``pos`` are; None if the process stopped first."""
        with self._cond:
            while self.made.get(key, 0) <= pos and self.stopped is None and not self.finished:
                self._cond.wait()
            got = self.made.get(key, 0)
            return got if got > pos else None

    def read(self, name: str, part: str, block_bytes: int, made_here: Callable[[], object]):
        """The part's bytes from its slot, in blocks of ``block_bytes`` in two buffers taken in turn
        (a block stays intact while the next is read, as ``mlirb.inflate`` needs); past where the
        process stopped, ``made_here()``'s bytes. The slot is freed once read."""
        offset, size = self.w._slots[(name, part)]
        bufs = [np.empty(min(block_bytes, size), dtype=np.uint8) for _ in range(2)] if size else []
        pos, i = 0, 0
        while pos < size:
            got = self._wait((name, part), pos)
            if got is None:  # the rest made here, from the same bytes
                yield from _skip(made_here(), pos)
                break
            n = min(block_bytes, got - pos)
            view = memoryview(bufs[i % 2])[:n]
            _pread_into(self.w._fd, view, offset + pos)
            yield view
            pos, i = pos + n, i + 1
        _punch(self.w._fd, offset, size)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._reader.join(timeout=5)


def _skip(chunks, skip: int):
    """``chunks`` without their first ``skip`` bytes."""
    for c in chunks:
        c = memoryview(c).cast("B")
        if skip >= len(c):
            skip -= len(c)
            continue
        yield c[skip:]
        skip = 0


# ----------------------------------------------------------------------------- the process's side


def _make(job: dict) -> None:
    import torch

    from ..errors import ClefError
    from .quantize import Scheme
    from .shard_reads import ShardReader
    from .streamed_weights import TensorBlocks, TensorInfo, _pwrite

    torch.set_num_threads(1)
    # the trace is what the export waits for: it keeps its core, and this process takes what is left
    # of the other (the figures at each niceness: docs/performance.md)
    os.nice(NICE)
    folder = Path(job["folder"])
    blocks = TensorBlocks(folder, Scheme(*job["scheme"]))
    fd, tasks = int(job["fd"]), job["tasks"]
    infos = [TensorInfo(task["name"], task["file"], task["dtype"], tuple(task["shape"]), int(task["offset"])) for task in tasks]
    hashed = set(job.get("hash", ()))
    mine: dict[str, list[int]] = {}  # shard -> its tasks
    for i, t in enumerate(infos):
        mine.setdefault(t.file, []).append(i)
    files = list(dict.fromkeys([t.file for t in infos] + sorted(hashed)))
    rank = {i: i for i in range(len(tasks))}

    def say(line: str) -> None:
        print(line, flush=True)

    def reorder() -> None:
        if select.select([sys.stdin], [], [], 0)[0]:  # the save's order: the shards left in it
            line = sys.stdin.readline()
            if line.strip():
                rank.clear()
                rank.update({i: r for r, i in enumerate(json.loads(line))})

    def first_need(f: str) -> tuple[int, int]:  # a shard only hashed comes after those the save waits for
        return min((rank.get(i, len(tasks)) for i in mine.get(f, ())), default=len(tasks) + 1), files.index(f)

    def make(i: int, rows) -> None:
        task, t = tasks[i], infos[i]
        (c_at, _), (s_at, _) = task["slots"]["codes"], task["slots"]["scales"]
        c_pos = s_pos = 0
        for _r0, codes, scales in blocks._code_blocks(t, int(task["k"]), packed=True, row_blocks=rows):
            c, s = memoryview(codes.numpy()).cast("B"), memoryview(scales.numpy()).cast("B")
            _pwrite(fd, c, c_at + c_pos)
            _pwrite(fd, s, s_at + s_pos)
            c_pos, s_pos = c_pos + len(c), s_pos + len(s)
            say(f"{i} codes {c_pos}")  # the scales are asked first, and whole: said at the tensor's end
        say(f"{i} scales {s_pos}")

    try:
        left = list(files)
        while left:
            reorder()
            f = min(left, key=first_need)
            left.remove(f)
            ids = mine.get(f, [])
            with ShardReader(folder / f, [infos[i] for i in ids], hashed=f in hashed) as reader:
                for j, rows in reader.tensors():
                    make(ids[j], rows)
                    reorder()
            if f in hashed:
                say("sha " + json.dumps([f, reader.digest]))
        say("done")
    except (ClefError, OSError, ValueError) as exc:
        say(f"error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the build's parent reports Ctrl-C; this ends with the worker
    die_with_parent(PARENT_ENV)  # the export worker: nothing is made for a build that is gone
    try:
        _make(json.loads(sys.argv[1]))
    except BrokenPipeError:  # the worker is gone
        pass
    os._exit(0)
