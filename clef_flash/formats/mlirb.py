"""Stable resource names in an MLIR bytecode file (``main.mlirb``).

How it works: docs/modules.md."""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..direct_io import open_direct, refused

MAGIC = b"ML\xefR"
STRING, RESOURCE, RESOURCE_OFFSET = 0, 5, 6
_PAD = 0xCB
_CHUNK = 1 << 20


class BytecodeError(ValueError):
    """Not MLIR bytecode this module understands; the message says where."""


class _Reader:
    def __init__(self, data: bytes | memoryview, pos: int = 0):
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise BytecodeError(f"unexpected end at byte {self.pos}")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        first = self.byte()
        if first & 1:
            return first >> 1
        if first == 0:
            return int.from_bytes(self.take(8), "little")
        n = (first & -first).bit_length()  # trailing zeros + 1 = the encoding's byte count
        rest = self.take(n - 1)
        return int.from_bytes(bytes([first]) + bytes(rest), "little") >> n

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise BytecodeError(f"unexpected end at byte {self.pos} (+{n})")
        out = memoryview(self.data)[self.pos:self.pos + n]
        self.pos += n
        return out

    def cstring(self) -> bytes:
        end = bytes(self.data).find(b"\0", self.pos)
        if end < 0:
            raise BytecodeError(f"unterminated string at byte {self.pos}")
        s = bytes(self.data[self.pos:end])
        self.pos = end + 1
        return s


def varint(value: int) -> bytes:
    """MLIR's prefix varint: the count of trailing zero bits of the first byte gives the length."""
    for n in range(1, 9):
        if value < 1 << (7 * n):
            return ((value << n) | (1 << (n - 1))).to_bytes(n, "little")
    return b"\0" + value.to_bytes(8, "little")


@dataclass(frozen=True)
class Section:
    id: int
    header: int  # offset of the id byte
    start: int  # offset of the data
    length: int


def _sections(fh, size: int) -> list[Section]:
    """The section table, read with seeks (no section data is read)."""
    head = fh.read(min(size, 256))
    if not head.startswith(MAGIC):
        raise BytecodeError("not MLIR bytecode (bad magic)")
    r = _Reader(head, len(MAGIC))
    r.varint()  # bytecode version
    r.cstring()  # producer
    pos = r.pos
    out = []
    while pos < size:
        fh.seek(pos)
        r = _Reader(fh.read(32))
        code = r.byte()
        length = r.varint()
        start = pos + r.pos
        if code & 0x80:
            align = r.varint()
            start = pos + r.pos
            if align & (align - 1):
                raise BytecodeError(f"section alignment {align} at byte {pos} is not a power of two")
            start = (start + align - 1) & ~(align - 1)
        out.append(Section(id=code & 0x7F, header=pos, start=start, length=length))
        pos = start + length
    if pos != size:
        raise BytecodeError(f"sections end at byte {pos}, the file has {size}")
    return out


def _alignment(fh, sec: Section) -> int | None:
    """The section's declared alignment, or None for an unaligned section."""
    fh.seek(sec.header)
    head = _Reader(fh.read(32))
    if not head.byte() & 0x80:
        return None
    head.varint()
    return head.varint()


def _section_header(sec_id: int, length: int, align: int | None, at: int) -> bytes:
    """A section's header written at byte ``at``: with an alignment, padded so the data starts aligned."""
    header = bytearray([sec_id | (0x80 if align else 0)]) + varint(length)
    if align:
        pos = at + len(header) + len(varint(align))
        header += varint(align) + bytes([_PAD]) * ((-pos) % align)
    return bytes(header)


def _read_strings(data: bytes) -> list[bytes]:
    r = _Reader(data)
    n = r.varint()
    sizes = [r.varint() for _ in range(n)][::-1]  # written last string first
    out = []
    for s in sizes:
        chunk = bytes(r.take(s))
        if not chunk.endswith(b"\0"):
            raise BytecodeError("string section entry is not NUL-terminated")
        out.append(chunk[:-1])
    return out


def _write_strings(strings: list[bytes]) -> bytes:
    body = bytearray(varint(len(strings)))
    for s in reversed(strings):
        body += varint(len(s) + 1)
    for s in strings:
        body += s + b"\0"
    return bytes(body)


def _resource_entries(offsets: bytes) -> list[tuple[int, int, int]]:
    """(string index of the key, size of the entry in the resource section, kind) for every
    resource, in the order of the resource section. The section lists external groups (key, n,
    entries) and then dialect groups (dialect index, n, entries) until it ends."""
    r = _Reader(offsets)
    out = []

    def group() -> None:
        for _ in range(r.varint()):
            key, size, kind = r.varint(), r.varint(), r.byte()
            out.append((key, size, kind))

    for _ in range(r.varint()):  # external resource groups
        r.varint()
        group()
    while r.pos < len(offsets):  # dialect resource groups
        r.varint()
        group()
    return out


@dataclass(frozen=True)
class Blob:
    name: str
    start: int  # offset of the data in the file (alignment and size prefix excluded)
    size: int


@dataclass(frozen=True)
class Written:
    """What a writer of bytecode hashed of the bytes it wrote (``inflate``, ``stable_resource_names``):
    the file's sha256 and each resource's data's, in the resource section's order (``blobs``)."""

    renamed: int
    sha256: str
    blobs: tuple[str, ...]
    waits: dict[str, float] | None = None  # ``inflate``: seconds its writer waited, by what for

    def as_json(self) -> dict:
        return {"renamed": self.renamed, "sha256": self.sha256, "blobs": list(self.blobs)}

    @classmethod
    def from_json(cls, d: dict) -> "Written":
        return cls(int(d["renamed"]), str(d["sha256"]), tuple(d["blobs"]))


def _blob_span(fh, start: int, size: int, kind: int) -> tuple[int, int]:
    """(data offset, data size) of a resource entry: a blob's alignment and size prefix excluded."""
    fh.seek(start)
    r = _Reader(fh.read(min(size, 32)))
    if kind != 0:  # not a blob (bool / string resource): the entry's bytes as they are
        data_start, data_size = start, size
    else:
        align = r.varint()
        data_size = r.varint()
        data_start = start + r.pos
        if align > 1:
            data_start = (data_start + align - 1) & ~(align - 1)
        if data_start + data_size > start + size:
            raise BytecodeError(f"blob at byte {start} overruns its entry")
    return data_start, data_size


def blob_sha256(fh, blob: Blob) -> str:
    """sha256 of a blob's data, read where it lies in the open file ``fh``."""
    h = hashlib.sha256()
    fh.seek(blob.start)
    left = blob.size
    while left:
        chunk = fh.read(min(_CHUNK * 8, left))
        if not chunk:
            raise BytecodeError(f"blob {blob.name} at byte {blob.start} is truncated")
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


_READS_IN_FLIGHT = 4  # a virtual disk serves four outstanding reads about twice as fast as one (measured)


def _blocks(path: Path, size: int, block: int, depth: int, reuse):
    """The first ``size`` bytes of ``path`` in order, as ``(slot, view)`` of ``block`` bytes each:
    ``depth`` reads in flight in threads (``os.preadv`` into a ring of ``depth + 1`` page-aligned
    buffers), with ``O_DIRECT`` where the file system takes it (a file just written with
    ``O_DIRECT`` is not in the page cache; nothing is copied through it). Measured on a 15.9 GB
    ``main.mlirb`` just written: 14.9-15.1 s with four 16 MB reads in flight, 27.6-33.5 s with one
    buffered 8 MB read at a time. ``reuse(slot)`` is called before a slot is read into again and
    returns once that slot's last view is no longer in use."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    slots = depth + 1
    bufs = [mmap.mmap(-1, block) for _ in range(slots)]  # anonymous: page-aligned, as O_DIRECT needs
    if block % 4096 == 0 and hasattr(os, "preadv"):  # O_DIRECT is Linux's: so is preadv
        fd, direct = open_direct(path, os.O_RDONLY)
    else:
        fd, direct = os.open(path, os.O_RDONLY), False
    if direct and size:
        try:
            os.preadv(fd, [bufs[0]], 0)
        except OSError as exc:  # a file system that opens with O_DIRECT and refuses the read: buffered
            if not refused(fd, exc):
                os.close(fd)
                raise

    lock = threading.Lock()

    def read(i: int) -> int:
        want = min(block, size - i * block)
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [bufs[i % slots]], i * block)
        else:  # macOS's Python may lack preadv: the same reads, one at a time
            with lock:
                os.lseek(fd, i * block, os.SEEK_SET)
                got = os.readv(fd, [bufs[i % slots]])
        if got < want:
            raise BytecodeError(f"{path} ended at byte {i * block + got} of {size}")
        return want

    n = -(-size // block)
    try:
        with ThreadPoolExecutor(depth) as pool:
            reads, ahead = {}, 0
            for i in range(n):
                while ahead < n and ahead < i + depth:
                    reuse(ahead % slots)
                    reads[ahead] = pool.submit(read, ahead)
                    ahead += 1
                got = reads.pop(i).result()
                yield i % slots, memoryview(bufs[i % slots])[:got]
    finally:
        os.close(fd)


def digests(path: Path, each_blob: bool = True) -> tuple[str, list[tuple[Blob, str | None]]]:
    """The sha256 of the whole file and of each blob's data, in one sequential read: a 16 GB
    backbone's gate read it twice before (the file's hash, then every blob where it lies). The file
    is read by ``_blocks`` (several reads in flight); the file's hash and the blobs' run in two
    threads of their own (hashlib releases the GIL), each in file order, beside the next reads.
    ``each_blob=False``: the file's hash only (each blob's digest ``None``), one hash of each byte."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import closing

    path = Path(path)
    found = blobs(path)
    size = path.stat().st_size
    for b in found:
        if b.start + b.size > size:
            raise BytecodeError(f"blob {b.name} at byte {b.start} is truncated")
    order = sorted(range(len(found)), key=lambda i: found[i].start) if each_blob else []
    hashes = [hashlib.sha256() for _ in found]
    whole = hashlib.sha256()
    pending: dict[int, tuple] = {}  # slot -> the hashes of its last view

    def parts(view: memoryview, pieces: list[tuple[int, int, int]]) -> None:
        for i, lo, hi in pieces:
            hashes[i].update(view[lo:hi])

    def reuse(slot: int) -> None:  # a buffer is read into again once both hashes of its last view are done
        for f in pending.pop(slot, ()):
            f.result()

    live: list[int] = []  # blobs begun and not yet ended, at the current read
    j, at = 0, 0
    # leaving the executors waits for every hash still running (the views keep their buffers alive)
    with ThreadPoolExecutor(1) as file_side, ThreadPoolExecutor(1) as blob_side, \
            closing(_blocks(path, size, _CHUNK * 16, _READS_IN_FLIGHT, reuse)) as views:
        for slot, view in views:
            end = at + len(view)
            while j < len(order) and found[order[j]].start < end:
                live.append(order[j])
                j += 1
            pieces = []
            for i in live:
                b = found[i]
                lo, hi = max(b.start, at), min(b.start + b.size, end)
                if hi > lo:
                    pieces.append((i, lo - at, hi - at))
            live = [i for i in live if found[i].start + found[i].size > end]
            pending[slot] = (file_side.submit(whole.update, view),) + (
                (blob_side.submit(parts, view, pieces),) if pieces else ())
            at = end
    return whole.hexdigest(), [(b, h.hexdigest() if each_blob else None) for b, h in zip(found, hashes)]


def resource_names(path: Path) -> list[str]:
    """The resource keys of a bytecode file, in the order of its resource section."""
    path = Path(path)
    with open(path, "rb") as fh:
        sections = _sections(fh, path.stat().st_size)
        strings, entries = _strings_and_entries(fh, sections)
    return [strings[k].decode() for k, _, _ in entries]


def blobs(path: Path) -> list[Blob]:
    """Every resource of a bytecode file: its key and where its data lies (no data is read)."""
    path = Path(path)
    with open(path, "rb") as fh:
        sections = _sections(fh, path.stat().st_size)
        strings, entries = _strings_and_entries(fh, sections)
        by_id = {s.id: s for s in sections}
        if entries and RESOURCE not in by_id:
            raise BytecodeError("resource offsets without a resource section")
        out, offset = [], by_id[RESOURCE].start if entries else 0
        for key, entry_size, kind in entries:
            data_start, data_size = _blob_span(fh, offset, entry_size, kind)
            out.append(Blob(strings[key].decode(), data_start, data_size))
            offset += entry_size
        if entries and offset != by_id[RESOURCE].start + by_id[RESOURCE].length:
            raise BytecodeError("resource entries do not fill the resource section")
    return out


def _strings_and_entries(fh, sections: list[Section]):
    by_id = {s.id: s for s in sections}
    if STRING not in by_id:
        raise BytecodeError("no string section")
    fh.seek(by_id[STRING].start)
    strings = _read_strings(fh.read(by_id[STRING].length))
    entries = []
    if RESOURCE_OFFSET in by_id:
        fh.seek(by_id[RESOURCE_OFFSET].start)
        entries = _resource_entries(fh.read(by_id[RESOURCE_OFFSET].length))
    return strings, entries


def _hash_prefix(fh, end: int, spans: list[tuple[int, int]]) -> tuple["hashlib._Hash", list[str]]:
    """One sequential read of the file's first ``end`` bytes: the sha256 of those bytes, and of each
    ``(start, size)`` span within them (sorted, not overlapping): the blobs hashed on the way. The
    whole-file hash runs in a second thread (hashlib releases the GIL), so both take one hash's time."""
    from concurrent.futures import ThreadPoolExecutor

    whole = hashlib.sha256()
    parts = [hashlib.sha256() for _ in spans]
    fh.seek(0)
    pos, i = 0, 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        while pos < end:
            chunk = fh.read(min(_CHUNK * 8, end - pos))  # 8 MB: two in flight
            if not chunk:
                raise BytecodeError(f"unexpected end at byte {pos}")
            if pending is not None:
                pending.result()  # in order: the previous chunk is in the whole-file hash
            pending = pool.submit(whole.update, chunk)
            stop = pos + len(chunk)
            while i < len(spans) and spans[i][0] < stop:
                a, size = spans[i]
                lo, hi = max(a, pos), min(a + size, stop)
                if hi > lo:
                    parts[i].update(memoryview(chunk)[lo - pos:hi - pos])
                if a + size <= stop:
                    i += 1
                else:
                    break
            pos = stop
        if pending is not None:
            pending.result()
    return whole, [h.hexdigest() for h in parts]


def _stable_strings(strings: list[bytes], keys: list[int], digests: list[str], prefix: str) -> list[bytes]:
    """The string table with each resource key (``keys``, in resource order) renamed after its
    blob's sha256; two blobs with the same bytes under two keys are kept apart by a suffix."""
    renamed: dict[int, bytes] = {}
    used = set(strings) - {strings[k] for k in keys}  # names that must stay free
    for key, digest in zip(keys, digests):
        name = base = f"{prefix}{digest[:20]}".encode()
        n = 1
        while name in used:
            name = base + b"_%d" % n
            n += 1
        used.add(name)
        renamed[key] = name
    return [renamed.get(i, s) for i, s in enumerate(strings)]


def stable_resource_names(path: Path, prefix: str = "w_") -> Written:
    """Rename every resource of ``path`` after the sha256 of its bytes, in place; returns how many,
    the sha256 of the renamed file (taken in the same single read: ``main.hash`` needs it) and of
    each resource.

    The string section must come after the resource section (MLIR's writer puts it there); the
    file is cut at the string section and everything from there on is written again."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        sections = _sections(fh, size)
        strings, entries = _strings_and_entries(fh, sections)
        ids = [s.id for s in sections]
        string_at = ids.index(STRING)
        tail_start = sections[string_at].header
        if not entries:
            whole, _ = _hash_prefix(fh, size, [])
            return Written(0, whole.hexdigest(), ())
        if RESOURCE in ids and ids.index(RESOURCE) > string_at:
            raise BytecodeError("the string section comes before the resource section")
        resource = sections[ids.index(RESOURCE)]
        spans, offset = [], resource.start
        for _key, entry_size, kind in entries:
            spans.append(_blob_span(fh, offset, entry_size, kind))
            offset += entry_size
        if offset != resource.start + resource.length:
            raise BytecodeError("resource entries do not fill the resource section")
        whole, digests = _hash_prefix(fh, tail_start, spans)
        new_strings = _stable_strings(strings, [k for k, _, _ in entries], digests, prefix)
        tail = bytearray()
        for sec in sections[string_at:]:
            fh.seek(sec.start)
            data = fh.read(sec.length) if sec.id != STRING else _write_strings(new_strings)
            # an aligned section after the strings: padded again from its new place
            tail += _section_header(sec.id, len(data), _alignment(fh, sec), tail_start + len(tail)) + data
        fh.truncate(tail_start)
        fh.seek(tail_start)
        fh.write(tail)
        whole.update(tail)
    return Written(len(entries), whole.hexdigest(), tuple(digests))


def _resource_groups(offsets: bytes) -> tuple[list, list]:
    """The resource offset section as (external groups, dialect groups): each ``(id, [(key, size, kind)])``."""
    r = _Reader(offsets)

    def group() -> list[tuple[int, int, int]]:
        return [(r.varint(), r.varint(), r.byte()) for _ in range(r.varint())]

    external = [(r.varint(), group()) for _ in range(r.varint())]
    dialect = []
    while r.pos < len(offsets):
        dialect.append((r.varint(), group()))
    return external, dialect


def skeleton(path: Path, out: Path) -> int:
    """A copy of ``path`` with every blob's data left out (each declared with size 0): the same
    program, functions and signatures in a few KB, for readers that load the whole file into memory
    (coreai's summary does: 16 GB for a 9B backbone). Returns the bytes written."""
    path, out = Path(path), Path(out)
    with open(path, "rb") as fh:
        sections = _sections(fh, path.stat().st_size)
        by_id = {s.id: s for s in sections}
        fh.seek(0)
        body = bytearray(fh.read(sections[0].header))
        replaced: dict[int, bytes] = {}
        if RESOURCE_OFFSET in by_id and RESOURCE in by_id:
            fh.seek(by_id[RESOURCE_OFFSET].start)
            groups = _resource_groups(fh.read(by_id[RESOURCE_OFFSET].length))
            replaced[RESOURCE], sizes = _empty_blobs(fh, by_id[RESOURCE], groups)
            replaced[RESOURCE_OFFSET] = _write_groups(groups, sizes)
        for sec in sections:
            if sec.id in replaced:
                data = replaced[sec.id]
            else:
                fh.seek(sec.start)
                data = fh.read(sec.length)
            body += _section_header(sec.id, len(data), _alignment(fh, sec), len(body)) + data  # aligned data stays aligned
    out.write_bytes(bytes(body))
    return len(body)


def _empty_blobs(fh, sec: Section, groups) -> tuple[bytes, list[int]]:
    """The resource section with each blob's data removed, and the new size of every entry. A
    blob's padding is relative to the section's start, which is aligned for every blob in it."""
    external, dialect = groups
    out = bytearray()
    sizes = []
    offset = sec.start
    for _key, entry_size, kind in [e for _, g in external + dialect for e in g]:
        fh.seek(offset)
        if kind != 0:  # a bool or string resource: as it is
            entry = bytearray(fh.read(entry_size))
        else:
            align = _Reader(fh.read(min(entry_size, 32))).varint()
            entry = bytearray(varint(align) + varint(0))
            entry += bytes([_PAD]) * ((-(len(out) + len(entry))) % align if align > 1 else 0)
        out += entry
        sizes.append(len(entry))
        offset += entry_size
    return bytes(out), sizes


def _write_groups(groups, sizes: list[int]) -> bytes:
    external, dialect = groups
    out = bytearray(varint(len(external)))
    it = iter(sizes)
    for gid, g in external:
        out += varint(gid) + varint(len(g))
        for key, _size, kind in g:
            out += varint(key) + varint(next(it)) + bytes([kind])
    for gid, g in dialect:
        out += varint(gid) + varint(len(g))
        for key, _size, kind in g:
            out += varint(key) + varint(next(it)) + bytes([kind])
    return bytes(out)


class _DirectWriter:
    """Sequential writes through one page-aligned buffer with ``O_DIRECT``: the bytes go from the
    buffer to the disk, not through the page cache (measured here: 1.2-1.6 GB/s against 0.3-1.2 GB/s
    buffered, and no CPU spent copying into page cache). Where the file system refuses ``O_DIRECT``
    the same writes are buffered. The last block is written padded and the file cut to its size."""

    BLOCK = 8 << 20  # a multiple of every logical block size

    def __init__(self, path: Path) -> None:
        import mmap

        self.fd, self.direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.buf = mmap.mmap(-1, self.BLOCK)  # anonymous: page-aligned, as O_DIRECT needs
        self.view = memoryview(self.buf)
        self.used = 0
        self.size = 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while data:
            n = min(len(data), self.BLOCK - self.used)
            self.view[self.used:self.used + n] = data[:n]
            self.used += n
            self.size += n
            data = data[n:]
            if self.used == self.BLOCK:
                self._flush(self.BLOCK)

    def _flush(self, n: int) -> None:
        view = self.view[:n]
        while view:
            try:
                view = view[os.write(self.fd, view):]
            except OSError as exc:
                if not refused(self.fd, exc):
                    raise
                self.direct = False  # refused: buffered from here
        self.used = 0

    def abort(self) -> None:
        os.close(self.fd)
        self.view.release()
        self.buf.close()

    def close(self) -> None:
        try:
            if self.used:
                tail = -(-self.used // 4096) * 4096  # whole blocks, cut back below
                self.view[self.used:tail] = bytes(tail - self.used)
                self._flush(tail)
            os.ftruncate(self.fd, self.size)
        finally:
            self.abort()


class MissingPlaceholders(BytecodeError):
    """Placeholders the compiler folded, inlined or merged: ``keys`` names them."""

    def __init__(self, message: str, keys: list[bytes]) -> None:
        super().__init__(message)
        self.keys = keys


@contextmanager
def _spent(seconds: dict[str, float], key: str):
    """Adds the time the ``with`` block took to ``seconds[key]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - t


@dataclass(frozen=True)
class Fill:
    """The placeholders ``save`` fills while writing main.mlirb (``inflate``): each one's size, where its
    bytes come from, and two optional hints for a supplier that reads ahead."""

    sizes: dict[bytes, int]
    supply: Callable[[bytes], Any]  # -> an iterable of bytes-like chunks
    upcoming: Callable[[bytes], None] | None = None  # told the next placeholders to be filled
    planned: Callable[[list[bytes]], None] | None = None  # told once the order they are filled in


def _fill_plan(path: Path, data: bytes, offset: int, entries, sizes: dict[bytes, int]):
    """The resource section's new entries: [(prefix bytes incl. padding, data: bytes, or (the key of a
    placeholder to fill,), data size)], each entry's new size, the section's size, and the largest blob
    alignment (the section must start aligned to it). A placeholder not found is ``MissingPlaceholders``."""
    plan, new_sizes, at = [], [], 0
    left = dict(sizes)
    blob_align = 1
    for _key, entry_size, kind in entries:
        if kind != 0:  # not a blob: its bytes as they are (hashed whole, as stable_resource_names does)
            plan.append((b"", data[offset:offset + entry_size], entry_size))
        else:
            r = _Reader(data, offset)
            align, size = r.varint(), r.varint()
            blob_align = max(blob_align, align)
            start = r.pos if align <= 1 else (r.pos + align - 1) & ~(align - 1)
            body: bytes | tuple = data[start:start + size]
            if body in left:
                body, size = (body,), left.pop(body)
            head = varint(align) + varint(size)
            head += bytes([_PAD]) * ((-(at + len(head))) % align if align > 1 else 0)
            plan.append((head, body, size))
        new_sizes.append(len(plan[-1][0]) + plan[-1][2])
        at += new_sizes[-1]
        offset += entry_size
    if left:
        raise MissingPlaceholders(f"{path}: {len(left)} placeholder(s) to fill not found (merged or dropped by the compiler?)",
                                  sorted(left))
    return plan, new_sizes, at, blob_align


def _stream_blob(chunks, hashes, fh, maker, pool, waits: dict[str, float]) -> int:
    """A placeholder's chunks written and hashed (into each of ``hashes``); returns the bytes. The next
    chunk is made in a thread of its own (``maker``) while this one is hashed (``pool``) and written:
    conversion, hashing and the disk overlap, and a chunk is reused only once its hashes and write are done."""
    chunks = iter(chunks)
    got, hashing = 0, ()
    ahead = maker.submit(next, chunks, None)
    while True:
        with _spent(waits, "supply"):
            chunk = ahead.result()
        if chunk is None:
            break
        with _spent(waits, "hashes"):
            for f in hashing:
                f.result()
        ahead = maker.submit(next, chunks, None)
        hashing = tuple(pool.submit(h.update, chunk) for h in hashes)
        with _spent(waits, "write"):
            fh.write(chunk)
        got += len(chunk)
    with _spent(waits, "hashes"):
        for f in hashing:
            f.result()
    return got


def inflate(path: Path, out: Path, sizes: dict[bytes, int], supply, prefix: str = "w_", upcoming=None,
            planned=None) -> Written:
    """Write ``out``: the bytecode ``path`` (small) with each blob whose data is a key of ``sizes`` (a
    placeholder) given its ``sizes[key]`` bytes from ``supply(key)`` (an iterable of bytes-like
    chunks, each left intact until the one after the next is asked for; it is advanced in a thread
    of its own, one chunk ahead), and every resource
    renamed after its sha256 as ``stable_resource_names`` does. Returns how many were renamed, the sha256 of
    ``out`` and of each resource's data. The resource offsets come before the resources, and the names after them: the file is
    written in one pass, each supplied byte hashed twice (its blob, the file) and written once.

    ``upcoming(key)``, if given, is told which placeholders come next (the two after the one being
    filled, when it starts): a supplier that reads from disk can ask for those bytes early.
    ``planned(keys)``, if given, is told once, before any is filled, the order they are filled in.

    The bytes are those of the converter's own writer given the data (a test holds it): each
    blob's padding is relative to the resource section's start, which is aligned for every blob."""
    from concurrent.futures import ThreadPoolExecutor

    import io

    data = Path(path).read_bytes()
    src = io.BytesIO(data)
    sections = _sections(src, len(data))
    by_id = {s.id: s for s in sections}
    if RESOURCE not in by_id or RESOURCE_OFFSET not in by_id or STRING not in by_id:
        raise BytecodeError(f"{path}: no resources to fill")
    ids = [s.id for s in sections]
    if not ids.index(RESOURCE_OFFSET) < ids.index(RESOURCE) < ids.index(STRING):
        raise BytecodeError(f"{path}: sections in an order this writer does not follow ({ids})")
    strings = _read_strings(data[by_id[STRING].start:by_id[STRING].start + by_id[STRING].length])
    groups = _resource_groups(data[by_id[RESOURCE_OFFSET].start:by_id[RESOURCE_OFFSET].start + by_id[RESOURCE_OFFSET].length])
    entries = [e for _, g in groups[0] + groups[1] for e in g]
    plan, new_sizes, at, blob_align = _fill_plan(path, data, by_id[RESOURCE].start, entries, sizes)
    offsets_data = _write_groups(groups, new_sizes)
    order = [body[0] for _, body, _ in plan if isinstance(body, tuple)]  # the placeholders, as they are filled
    nth = {key: i for i, key in enumerate(order)}
    if planned is not None:
        planned(list(order))

    whole = hashlib.sha256()
    digests: list[str] = []
    written = 0
    # where the writer's time goes (the fill's log says it): waiting for the next converted chunk,
    # for the last chunk's two hashes, and copying into the O_DIRECT buffer and writing it
    waits = {"supply": 0.0, "hashes": 0.0, "write": 0.0}
    fh = _DirectWriter(out)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool, ThreadPoolExecutor(max_workers=1) as maker:
            def put(chunk) -> None:
                nonlocal written
                whole.update(chunk)
                fh.write(chunk)
                written += len(chunk)

            put(data[:sections[0].header])
            for sec in sections:
                align = _alignment(src, sec)
                if sec.id == RESOURCE and blob_align > 1:
                    # each blob's padding is relative to the section's start: the section itself must be
                    # aligned. The converter's writer leaves the flag off where the small file's section
                    # happened to start aligned; the offsets section before it grows here, so say it
                    align = max(align or 1, blob_align)
                if sec.id == RESOURCE:
                    put(_section_header(RESOURCE, at, align, written))
                    for head_bytes, body, size in plan:
                        put(head_bytes)
                        blob = hashlib.sha256()
                        if isinstance(body, tuple):
                            if upcoming is not None:
                                for key in order[nth[body[0]] + 1:nth[body[0]] + 3]:
                                    upcoming(key)
                            got = _stream_blob(supply(body[0]), (whole, blob), fh, maker, pool, waits)
                            if got != size:
                                raise BytecodeError(f"{out}: a placeholder got {got} bytes, {size} declared")
                            written += got
                        else:
                            blob.update(body)
                            put(body)
                        digests.append(blob.hexdigest())
                    continue
                if sec.id == RESOURCE_OFFSET:
                    body = offsets_data
                elif sec.id == STRING:
                    body = _write_strings(_stable_strings(strings, [k for k, _, _ in entries], digests, prefix))
                else:
                    body = data[sec.start:sec.start + sec.length]
                put(_section_header(sec.id, len(body), align, written))
                put(body)
    except BaseException:
        fh.abort()
        raise
    fh.close()
    return Written(len(entries), whole.hexdigest(), tuple(digests), {k: round(v, 3) for k, v in waits.items()})
