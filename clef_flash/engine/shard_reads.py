"""One read of a shard, start to end: every byte hashed for the shard's pin, and the compressed
tensors' rows handed to the quantizer from the same buffers (``ahead``'s process reads the release
this way).

How it works: docs/modules.md."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..direct_io import open_direct, refused
from ..errors import IntegrityError

ALIGN = 4096  # O_DIRECT: file offset, length and buffer address in whole blocks of this
PIECE_BYTES = 16 << 20  # bytes read at a time
BUFFERS = 4  # in flight: one being read, one hashed, one or two quantized


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    tensor: int  # index into the reader's tensors; -1: bytes only hashed
    r0: int = 0
    r1: int = 0


def spans(size: int, tensors, piece_bytes: int = PIECE_BYTES, start: int = 0) -> list[Span]:
    """The file's bytes ``[start, size)`` as consecutive spans: each tensor's rows in pieces of about
    ``piece_bytes`` (whole rows), the bytes between them in pieces of ``piece_bytes``."""
    out: list[Span] = []

    def gap(a: int, b: int) -> None:
        for s in range(a, b, piece_bytes):
            out.append(Span(s, min(b, s + piece_bytes), -1))

    at = start
    for i, t in sorted(enumerate(tensors), key=lambda it: it[1].offset):
        if t.offset + t.nbytes > size:
            raise IntegrityError(f"ends inside {t.name}")
        if t.offset < at:
            raise ValueError(f"{t.name}: bytes [{t.offset}, {t.offset + t.nbytes}) overlap another tensor's")
        gap(at, t.offset)
        rows = t.shape[0]
        row = t.nbytes // rows
        step = max(1, piece_bytes // row)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            out.append(Span(t.offset + r0 * row, t.offset + r1 * row, i, r0, r1))
        at = t.offset + t.nbytes
    gap(at, size)
    return out


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + nbytes]


class ShardReader:
    """``path`` read once in file order. ``tensors()`` yields ``(index, rows)`` for each of
    ``tensors`` (``weights.TensorInfo``) in file order, ``rows`` an iterator of ``(r0, r1, raw uint8)``
    row blocks (each valid until the next is asked for); once it is exhausted, ``digest`` is the
    file's sha256 (``hashed``). ``only``: read just the bytes of ``tensors`` (nothing hashed).
    ``direct=False``: plain reads (a test's second route)."""

    def __init__(self, path: Path, tensors, hashed: bool = True, piece_bytes: int = PIECE_BYTES,
                 direct: bool = True, only: bool = False) -> None:
        self.path = Path(path)
        self.tensors_info = list(tensors)
        self.hashed = hashed
        self.digest: str | None = None
        if only:  # the file's size is not looked at: a short file is found by its reads
            self.hashed = False
            lo = min((t.offset for t in self.tensors_info), default=0)
            size = max((t.offset + t.nbytes for t in self.tensors_info), default=0)
            self._spans = [s for s in spans(size, self.tensors_info, piece_bytes, lo) if s.tensor >= 0]
        else:
            try:
                self._spans = spans(self.path.stat().st_size, self.tensors_info, piece_bytes)
            except IntegrityError as exc:
                raise IntegrityError(f"{self.path}: {exc}") from None
        longest = max((s.end - s.start for s in self._spans), default=0)
        self._bufs = [_aligned(-(-longest // ALIGN) * ALIGN + 2 * ALIGN) for _ in range(BUFFERS)]
        self._free: queue.Queue = queue.Queue()
        for i in range(BUFFERS):
            self._free.put(i)
        self._hashing: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._fd, self.direct = open_direct(self.path, os.O_RDONLY) if direct else (os.open(self.path, os.O_RDONLY), False)
        self._threads = [threading.Thread(target=self._read, name="clef-shard-read", daemon=True),
                         threading.Thread(target=self._hash, name="clef-shard-hash", daemon=True)]
        for th in self._threads:
            th.start()

    def _pread(self, view: memoryview, offset: int, need: int, span: Span) -> int:
        got = 0
        while got < need:
            try:
                n = os.preadv(self._fd, [view[got:]], offset + got)
            except OSError as exc:
                if not refused(self._fd, exc):
                    raise
                self.direct = False  # O_DIRECT refused the read: plain reads from here
                continue
            if n == 0:
                inside = self.tensors_info[span.tensor].name if span.tensor >= 0 else f"the bytes before {offset + need}"
                raise IntegrityError(f"{self.path}: ends inside {inside}")
            got += n
        return got

    def _read(self) -> None:
        try:
            for span in self._spans:
                b = self._free.get()
                if self._stop.is_set():
                    self._hashing.put(EOFError("stopped"))  # the hasher ends too, with no digest
                    return
                lo = span.start - span.start % ALIGN
                hi = -(-span.end // ALIGN) * ALIGN
                self._pread(memoryview(self._bufs[b])[: hi - lo], lo, span.end - lo, span)
                self._hashing.put((span, b, lo))
            self._hashing.put(None)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread)
            self._hashing.put(exc)

    def _hash(self) -> None:
        h = hashlib.sha256() if self.hashed else None
        while True:
            item = self._hashing.get()
            if item is None or isinstance(item, BaseException):
                if item is None and h is not None:
                    self.digest = h.hexdigest()
                self._out.put(item)
                return
            span, b, lo = item
            if h is not None:
                h.update(memoryview(self._bufs[b])[span.start - lo: span.end - lo])
            if span.tensor < 0:
                self._free.put(b)
            else:
                self._out.put(item)

    def _next(self):
        item = self._out.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def tensors(self):
        pending = self._next()
        while pending is not None:
            index = pending[0].tensor

            def rows():
                nonlocal pending
                while pending is not None and pending[0].tensor == index:
                    span, b, lo = pending
                    yield span.r0, span.r1, self._bufs[b][span.start - lo: span.end - lo]
                    self._free.put(b)
                    pending = self._next()

            yield index, rows()
            while pending is not None and pending[0].tensor == index:  # rows the caller left
                self._free.put(pending[1])
                pending = self._next()

    def close(self) -> None:
        self._stop.set()
        for _ in range(BUFFERS):
            self._free.put(0)  # a reader waiting for a buffer sees the stop
        for th in self._threads:
            th.join(timeout=10)
        os.close(self._fd)

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensor_rows(folder: Path, t, piece_bytes: int = PIECE_BYTES, direct: bool = True):
    """One tensor's ``(r0, r1, raw uint8)`` row blocks, read as ``ShardReader`` reads (``O_DIRECT``: a
    reader of the release that would otherwise fill the page cache, at a cost in CPU the build's
    two cores feel, ``ShardReader``)."""
    with ShardReader(Path(folder) / t.file, [t], piece_bytes=piece_bytes, direct=direct, only=True) as reader:
        for _, rows in reader.tensors():
            yield from rows
