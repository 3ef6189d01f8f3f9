"""The backbone's weights, never all in memory: each tensor of the release's safetensors is
located from the shard headers, and every tensor of two or more dimensions is converted to fp16
in row blocks into one scratch file that is memory-mapped (its pages are page cache the kernel
can drop, not anonymous memory). 1-D tensors (norm scales, ``A_log``, ``dt_bias``: about 0.5 MB
for the 9B) are read as fp32 values: the converter folds them into derived constants.

How it works: docs/modules.md."""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import IntegrityError
from ..sources.safetensors import read_header, shard_files
from ..progress import plural

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
_BLOCK_BYTES = 32 << 20  # rows converted at a time: the anonymous memory this stage needs
# Tensors of at most this many values may be folded by the Core AI compiler (the cast of an fp16
# constant, stored as fp32: measured up to about 131,072 values, in_proj_a / in_proj_b / conv1d at
# the 9B); larger ones stay the fp16 blob they came in, so only those are streamed into the asset
FOLD_MAX_VALUES = 1 << 20
# buffers a streamed tensor's blocks take in turn: a block is left intact until the one after the
# next is asked for (``mlirb.inflate`` makes the next one while the current one is hashed and written)
_RING = 2
TILE_VALUES = 1 << 18  # values the quantizer widens and works on at a time (1 MB in fp32): in the CPU's cache
_ALIGN = 64  # each tensor starts at a 64-byte offset in the scratch file
_FP16_OVERFLOW = 65520.0  # the smallest magnitude that rounds to inf in fp16 (65504 + half a step)
SCALE_BOUND = 64  # |k| at most: 2**-64 and 2**64 are normal fp32 numbers
SCALE_TARGET = 14  # scaled tensors' max |x| <= 2**14: fp16's top binade (2**15) stays unused, so no rounding overflows


def torch_view(raw: np.ndarray, dtype: str):
    """A safetensors block's raw bytes (``dtype``: BF16, F16, F32) as the torch tensor they are, no copy
    (numpy has no bfloat16: its bits travel as int16)."""
    import torch

    np_dtype, torch_dtype = {"BF16": (np.int16, torch.bfloat16), "F16": (np.float16, torch.float16),
                             "F32": (np.float32, torch.float32)}[dtype]
    return torch.from_numpy(raw.view(np_dtype)).view(torch_dtype)


def _will_need(path: Path, offset: int, length: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def trim_freed_memory(collect: bool = True) -> None:
    """glibc keeps freed heap memory for reuse; hand it back to the kernel between stages, so the
    peak of one stage does not sit under the peak of the next (``malloc_trim``; a no-op elsewhere).
    ``collect``: Python's cycles collected first (not where it runs a layer at a time)."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def freed_memory_given_back(threshold: int = 1 << 20) -> None:
    """From now on in this process, glibc serves each allocation of ``threshold`` bytes or more
    from a mapping of its own, unmapped when it is freed. By default that threshold follows the
    largest block freed so far (up to 32 MiB), so a layer's activations of a few MiB each come
    from the heap, where what is freed stays until a trim: the plan's carry-back of one option
    through a 9B-wide layer peaked 164-319 MB higher so (docs/performance.md). A no-op elsewhere
    (macOS gives large blocks back by itself)."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, threshold)  # M_MMAP_THRESHOLD (malloc.h); fixes it, no longer moving
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # the shard, relative to the release folder
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the shard

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEMSIZE[self.dtype]


def locate(folder: Path, wanted: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    """Where each wanted tensor lies, its dtype and shape checked against ``wanted``."""
    folder = Path(folder)
    found: dict[str, TensorInfo] = {}
    for shard in shard_files(folder):
        h = read_header(folder / shard)
        for name, info in h["header"].items():
            if name not in wanted:
                continue
            if info.get("dtype") not in _ITEMSIZE:
                raise IntegrityError(f"{folder / shard}: {name} has dtype {info.get('dtype')}; expected BF16, F16 or F32")
            t = TensorInfo(name, shard, info["dtype"], tuple(info["shape"]), h["base"] + int(info["data_offsets"][0]))
            if t.shape != tuple(wanted[name]):
                raise IntegrityError(f"{folder / shard}: {name} has shape {list(t.shape)}, config.json implies {list(wanted[name])}")
            if int(info["data_offsets"][1]) - int(info["data_offsets"][0]) != t.nbytes:
                raise IntegrityError(f"{folder / shard}: {name} data span does not match its shape")
            found[name] = t
    missing = [n for n in wanted if n not in found]
    if missing:
        raise IntegrityError(f"{folder}: the checkpoint lacks {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    return found


def as_f32(raw: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """The release's values (``raw``: their bytes, or a view of them in their own dtype) in fp32,
    exactly (bf16 by a shift). ``out``: an fp32 array of as many values, written in place (the
    gate's tiles: no temporary per call)."""
    if out is None:
        if dtype == "BF16":
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        return raw.view("<f2" if dtype == "F16" else "<f4").astype(np.float32)
    if dtype == "BF16":
        wide = out.view(np.uint32)
        np.copyto(wide, raw.view("<u2"))
        np.left_shift(wide, 16, out=wide)
    else:
        np.copyto(out, raw.view("<f2" if dtype == "F16" else "<f4"))
    return out


def _pwrite(fd: int, data, off: int) -> None:
    data = memoryview(data)
    while data:
        written = os.pwrite(fd, data, off)
        data, off = data[written:], off + written


def _slot(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` takes in the scratch file (each starts 64-byte aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def scratch_bytes(infos: dict[str, TensorInfo], scheme=None, compressed=()) -> int:
    """Bytes of the scratch file for these tensors (2-D and larger ones): fp16, or a compressed
    tensor's int8 codes slot and fp16 scales."""
    total = 0
    for t in infos.values():
        if len(t.shape) < 2:
            continue
        n = int(np.prod(t.shape))
        if scheme is not None and t.name in compressed:
            total += _slot(n) + _slot(scheme.scale_bytes(t.shape))
        else:
            total += _slot(n * 2)
    return total


def asset_bytes(infos: dict[str, TensorInfo], scheme=None, compressed=()) -> int:
    """The weight bytes the scheme implies ``main.mlirb`` holds: codes + scales of the compressed
    tensors, fp16 for every other tensor of two or more dimensions."""
    total = 0
    for t in infos.values():
        if len(t.shape) < 2:
            continue
        if scheme is not None and t.name in compressed:
            total += scheme.code_bytes(t.shape) + scheme.scale_bytes(t.shape)
        else:
            total += int(np.prod(t.shape)) * 2
    return total


def scale_exponent(top: float) -> int:
    """The k a tensor of largest magnitude ``top`` is stored scaled by: the largest with
    ``top * 2**k <= 2**SCALE_TARGET`` (0 for an all-zero or non-finite tensor), bounded so that
    2**-k stays a normal fp32 number (a subnormal constant would be flushed too)."""
    if top == 0.0 or not np.isfinite(top):
        return 0
    return max(-SCALE_BOUND, min(SCALE_BOUND, SCALE_TARGET - int(np.ceil(np.log2(top)))))


def read_exactly(fh, at: int, view: memoryview, path: Path, what: str) -> None:
    """``view`` filled from ``fh`` at offset ``at`` with ``readinto`` calls; a file that ends first
    is an ``IntegrityError`` naming it and ``what`` was being read."""
    fh.seek(at)
    got = 0
    while got < len(view):
        k = fh.readinto(view[got:])
        if not k:
            raise IntegrityError(f"{path}: ends inside {what}")
        got += k


def raw_blocks(folder: Path, t: TensorInfo, block_bytes: int = _BLOCK_BYTES):
    """The tensor's bytes as row blocks ``(r0, r1, raw uint8)``, read from its shard with large
    ``readinto`` calls into one reused buffer (page-faulting a mapping of the shard cost a third
    of the weights stage)."""
    item = _ITEMSIZE[t.dtype]
    rows = t.shape[0]
    row_elems = int(np.prod(t.shape[1:]))
    step = max(1, block_bytes // (row_elems * item))
    buf = np.empty(min(rows, step) * row_elems * item, dtype=np.uint8)
    with open(Path(folder) / t.file, "rb", buffering=0) as fh:
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            n = (r1 - r0) * row_elems * item
            read_exactly(fh, t.offset + r0 * row_elems * item, memoryview(buf)[:n], Path(folder) / t.file, t.name)
            yield r0, r1, buf[:n]


def read_f32(folder: Path, t: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """The whole tensor in fp32 (exact from bf16 / fp16), read in row blocks: for a reference that
    holds one block of layers at a time (the vision gate's tower). ``out``: an fp32 array of the
    tensor's size, written in place (no 16-bit copy of the whole beside it)."""
    out = np.empty(int(np.prod(t.shape)), np.float32) if out is None else out.reshape(-1)
    at = 0
    for _, _, raw in raw_blocks(folder, t):
        n = raw.size // _ITEMSIZE[t.dtype]
        as_f32(raw, t.dtype, out[at:at + n])
        at += n
    return out.reshape(t.shape)


def fp32_blocks(folder: Path, t: TensorInfo, block_bytes: int = _BLOCK_BYTES):
    """The tensor as flat fp32 row blocks ``(r0, r1, values)`` of about ``block_bytes`` of the
    shard each, converted by torch into one reused buffer (a fresh block each time spent more on
    page faults than on converting): a block is good until the next is asked for."""
    import torch

    buf = None
    for r0, r1, raw in raw_blocks(folder, t, block_bytes):
        src = torch_view(raw, t.dtype)
        if src.dtype == torch.float32:
            yield r0, r1, src
            continue
        if buf is None:
            buf = torch.empty(src.numel(), dtype=torch.float32)
        out = buf[: src.numel()]
        out.copy_(src)
        yield r0, r1, out


class TensorBlocks:
    """A release's tensors as the bytes the asset stores, in row blocks: fp16 (times 2**k), or a
    compressed tensor's codes and scales. What ``Fp16Weights.stream`` and the process that makes
    them ahead of the save (``ahead``) both run, so the two make the same bytes."""

    def __init__(self, folder: Path, scheme=None) -> None:
        self.folder = Path(folder)
        self.scheme = scheme

    def _fp16_blocks(self, t: TensorInfo, k: int, block_bytes: int = _BLOCK_BYTES, ring: int = 1):
        """Row blocks of the shard -> fp16 (times 2**k): ``(r0, bytes)``, ``ring`` reused buffers in
        turn; a value beyond fp16's range is an error naming the tensor, never a silent inf."""
        import torch

        halves: list = []
        for i, (r0, _r1, block) in enumerate(fp32_blocks(self.folder, t, block_bytes)):
            if k:
                block.mul_(2.0 ** k)  # exact: a power of two
            if block.numel():
                lo, hi = torch.aminmax(block)
                top = max(float(hi), -float(lo))  # NaN when the source holds one: passed through, as inf is
                if _FP16_OVERFLOW <= top < float("inf"):
                    raise IntegrityError(f"{self.folder / t.file}: {t.name} has values beyond fp16's range (|x| > 65504)")
            if len(halves) < ring:
                halves.append(torch.empty(block.numel(), dtype=torch.float16))
            part = halves[i % ring][: block.numel()]
            part.copy_(block)  # rounds to nearest even, as numpy's astype
            yield r0, memoryview(part.numpy()).cast("B")

    def _code_blocks(self, t: TensorInfo, k: int, packed: bool, block_bytes: int = _BLOCK_BYTES, scales_only: bool = False,
                     scales_made=None, row_blocks=None):
        """Row blocks of the release -> ``(r0, codes, scales)`` torch tensors (codes int8, int4
        packed when ``packed``; None with ``scales_only``); a scale beyond fp16's range is an error
        naming the tensor. ``scales_made``: the tensor's scales ``[out, in/block]``: where the
        ``scales_only`` pass writes them, and what the codes' pass after it divides by, skipping the
        rule's first step (the converter writes a tensor's scales before its codes; 28.8 -> 18.4 ms
        for 16 M values). ``row_blocks``: the tensor's ``(r0, r1, raw)`` row blocks read elsewhere
        (``shard_reads.ShardReader``) instead of here.

        Each block is quantized in row tiles of about ``TILE_VALUES`` values, widened to fp32 one
        tile at a time: the rule's passes then run in the CPU's cache instead of over a 64 MB fp32
        block each (measured: 28 -> 17 ms for 16 M values on one core), the same values."""
        import torch

        from .quantize import codes_torch, pack_int4_torch, quantize_torch, scales_torch

        cols = t.shape[1]
        nb = cols // self.scheme.block
        step = max(1, TILE_VALUES // cols)
        tile = torch.empty(step * cols, dtype=torch.float32)  # the widened tile
        work = torch.empty(step * cols, dtype=torch.float32)  # the rule's temporary
        ring = []  # the codes and scales of a block, in turn (a block stays intact while the next is made)
        for i, (r0, r1, raw) in enumerate(raw_blocks(self.folder, t, block_bytes) if row_blocks is None else row_blocks):
            rows = r1 - r0
            src = torch_view(raw, t.dtype).view(rows, cols)
            if len(ring) < _RING:
                ring.append((torch.empty(rows * cols, dtype=torch.int8), torch.empty(rows * nb, dtype=torch.float16)))
            codes_buf, scales_buf = ring[i % _RING]
            codes = codes_buf[: rows * cols].view(rows, cols)
            scales = scales_buf[: rows * nb].view(rows, nb) if scales_made is None else scales_made[r0:r1]
            for a in range(0, rows, step):
                b = min(rows, a + step)
                w = tile[: (b - a) * cols].view(b - a, cols)
                w.copy_(src[a:b])  # exact: bf16 / fp16 widened
                if k:
                    w.mul_(2.0 ** k)  # exact: a power of two
                if scales_only:
                    scales[a:b].copy_(scales_torch(w, self.scheme, work))
                elif scales_made is not None:
                    codes_torch(w, scales[a:b], self.scheme, work, codes[a:b].view(-1))
                else:
                    scales[a:b].copy_(quantize_torch(w, self.scheme, work, codes[a:b].view(-1))[1])
            if (scales_only or scales_made is None) and not bool(torch.isfinite(scales).all()):
                raise IntegrityError(f"{self.folder / t.file}: {t.name} has values a {self.scheme.weights} scale cannot "
                                     f"hold in fp16 (|x| > {65504 * self.scheme.qmax:g}, or not finite)")
            if scales_only:
                codes = None
            elif packed and self.scheme.bits == 4:
                codes = pack_int4_torch(codes)
            yield r0, codes, scales

class Fp16Weights(TensorBlocks):
    """The release's tensors as the graph reads them: 2-D+ as fp16 views of the mapped scratch file,
    1-D as fp32 arrays. ``tensors()`` gives torch tensors sharing that memory."""

    def __init__(self, folder: Path, infos: dict[str, TensorInfo], scratch_dir: Path, log=lambda msg: None,
                 scaled: bool = False, streamed: bool = False, scheme=None, compressed=()) -> None:
        """``streamed``: tensors of more than ``FOLD_MAX_VALUES`` values are not converted here. Their
        views lie over holes of the sparse scratch file (zeros if read; neither the trace nor the
        converter reads them, ``export.constants_from_buffers``), and ``stream(name)`` converts them
        when ``main.mlirb`` is written (``mlirb.inflate``): the release is read once and the fp16
        bytes are written once, into the asset. Smaller ones the compiler may fold: converted now.
        (A compressed tensor's codes and scales may be made earlier, ``ahead.start``, into their
        slots, and read back from there.)

        ``scheme`` (``quantize.Scheme``) and ``compressed`` (tensor names): those tensors are laid out
        as int8 codes (int4 values unpacked: the traced shape; the packed bytes are the first half of
        the same slot) and fp16 scales, ``codes[name]`` / ``scales[name]``, computed from the release
        (times ``2**k``) by ``quantize.quantize_torch``; streamed ones when ``main.mlirb`` is written
        (``stream(name, "codes" | "scales")``: each part computed from the release when it is
        asked; their scratch slots stay holes)."""
        super().__init__(folder, scheme)
        self.scaled = scaled
        self._hints = None  # the prefetch thread, started by the first ``prefetch``
        self._scales_made = None  # (name, scales): the last tensor's scales, for its codes' pass
        self._prefetched: set[str] = set()
        self.exponents: dict[str, int] = {}  # name -> k: the stored tensor is W * 2**k
        self.streamed: dict[str, TensorInfo] = {}  # name -> tensor, for ``stream``
        self._log = log
        self.compressed = set(compressed) if scheme is not None else set()
        self.codes: dict[str, np.ndarray] = {}  # name -> int8 [out, in] view (int4: values unpacked)
        self.scales: dict[str, np.ndarray] = {}  # name -> fp16 [out, in / block] view
        self._slots: dict[tuple[str, str], tuple[int, int]] = {}  # (name, part) -> (offset, stored bytes)
        size = max(scratch_bytes(infos, scheme, self.compressed), _ALIGN)
        self._dir = Path(scratch_dir)
        fd, path = tempfile.mkstemp(prefix=".clef-weights-", suffix=".f16", dir=scratch_dir)
        try:
            os.unlink(path)  # only the mapping holds it: nothing is left on any exit
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
            self.arrays: dict[str, np.ndarray] = {}
            self.fp16_bytes = 0
            at = 0
            for name in sorted(infos, key=lambda n: (infos[n].file, infos[n].offset)):  # shard order: sequential reads
                t = infos[name]
                if len(t.shape) < 2:
                    self.arrays[name] = self._read_small(t)
                    continue
                n = int(np.prod(t.shape))
                k = self._exponent(t) if scaled else 0
                self.exponents[name] = k
                if name in self.compressed:  # the compiler folds no blockwise op: streamed at any size
                    at = self._lay_out_codes(t, fd, at, k, streamed)
                    continue
                if streamed and n > FOLD_MAX_VALUES:
                    self.streamed[name] = t
                else:
                    self._convert(t, fd, at, k)  # written with pwrite: no page fault per page of the mapping
                self.arrays[name] = np.frombuffer(self._map, dtype=np.float16, count=n, offset=at).reshape(t.shape)
                self.fp16_bytes += n * 2
                at += _slot(n * 2)
        except BaseException:
            os.close(fd)
            raise
        if not self.compressed.intersection(self.streamed):
            os.close(fd)
            fd = -1
        self._fd = fd  # kept while compressed tensors are streamed: ``ahead.start``'s process writes their slots through it
        self._ahead = None  # that process (``ahead.start``), if started
        log(f"{plural(len(infos), 'tensor')}, {self.fp16_bytes:,} fp16 bytes laid out"
            + (f", {len(self.compressed)} as {scheme.weights} codes per block of {scheme.block}" if self.compressed else "")
            + (f" ({len(self.streamed)} streamed into the asset when it is written)" if streamed else ""))

    def _lay_out_codes(self, t: TensorInfo, fd: int, at: int, k: int, streamed: bool) -> int:
        """Slots for a compressed tensor's codes (int8, the traced shape) and scales (fp16); filled
        now, or when ``main.mlirb`` is written (``streamed``)."""
        sch = self.scheme
        n = int(np.prod(t.shape))
        scale_shape = sch.scale_shape(t.shape)
        codes_at, scales_at = at, at + _slot(n)
        at = scales_at + _slot(sch.scale_bytes(t.shape))
        self._slots[(t.name, "codes")] = (codes_at, sch.code_bytes(t.shape))
        self._slots[(t.name, "scales")] = (scales_at, sch.scale_bytes(t.shape))
        self.codes[t.name] = np.frombuffer(self._map, dtype=np.int8, count=n, offset=codes_at).reshape(t.shape)
        self.scales[t.name] = np.frombuffer(self._map, dtype=np.float16, count=int(np.prod(scale_shape)),
                                            offset=scales_at).reshape(scale_shape)
        self.fp16_bytes += n * 2
        if streamed:
            self.streamed[t.name] = t
        else:  # small: the codes unpacked (the converter packs int4 itself), both written now
            row_bytes, srow = t.shape[1], scale_shape[1] * 2
            for r0, codes, scales in self._code_blocks(t, self.exponents[t.name], packed=False):
                _pwrite(fd, memoryview(codes.numpy()).cast("B"), codes_at + r0 * row_bytes)
                _pwrite(fd, memoryview(scales.numpy()).cast("B"), scales_at + r0 * srow)
        return at

    def packed_codes(self, name: str) -> np.ndarray:
        """A streamed int4 tensor's packed bytes: a view over the first half of its codes slot (a
        hole until ``stream`` fills it)."""
        off, size = self._slots[(name, "codes")]
        return np.frombuffer(self._map, dtype=np.uint8, count=size, offset=off)

    def stream(self, name: str, part: str = "fp16", block_bytes: int = _BLOCK_BYTES):
        """A streamed tensor's fp16 bytes (times 2**k), or a compressed one's ``codes`` / ``scales``
        bytes, in row blocks: each block stays intact while the next one is made (``mlirb.inflate``
        hashes it meanwhile).

        Each part is computed from the release when it is asked. The converter writes a tensor's
        scales before its codes: the scales' pass is the rule's first step alone, its scales kept
        (1/16 of the codes' bytes), and the codes' pass that follows reads the tensor again from
        the page cache and divides by them. Keeping the codes made with the scales for later
        instead parked 7.9 GB in the scratch file at 9B int8 (page faults, a second copy, 6.3 GB
        of file-backed memory). In another order, each pass computes what it needs.

        Made ahead (``ahead.start``): the part's bytes read back from its slot, as far as the
        process made them, and made here from there if it stopped."""
        if self._ahead is not None and self._ahead.covers(name):
            yield from self._ahead.read(name, part, block_bytes, lambda: self._make(name, part, block_bytes))
            return
        yield from self._make(name, part, block_bytes)

    def _make(self, name: str, part: str, block_bytes: int):
        """``stream``'s bytes, made here from the release."""
        if part == "fp16":
            for _r0, data in self._fp16_blocks(self.streamed[name], self.exponents[name], block_bytes, ring=_RING):
                yield data
            return
        if part not in ("codes", "scales"):
            raise ValueError(f"{name}: no part {part!r}")
        import torch

        t = self.streamed[name]
        made = self._scales_made
        self._scales_made = None
        if part == "scales":  # kept whole (1/16 of the codes' bytes) for the codes' pass that follows
            made = torch.empty(self.scheme.scale_shape(t.shape), dtype=torch.float16)
            for _r0, _codes, scales in self._code_blocks(t, self.exponents[name], packed=True, block_bytes=block_bytes,
                                                        scales_only=True, scales_made=made):
                yield memoryview(scales.numpy()).cast("B")
            self._scales_made = (name, made)
            return
        given = made[1] if made is not None and made[0] == name else None
        for _r0, codes, _scales in self._code_blocks(t, self.exponents[name], packed=True, block_bytes=block_bytes,
                                                    scales_made=given):
            yield memoryview(codes.numpy()).cast("B")

    def ahead_order(self, names: list[str]) -> None:
        """The order the save asks for the streamed tensors in, once known: the rest made in it."""
        if self._ahead is not None:
            self._ahead.order(names)

    def prefetch(self, name: str) -> None:
        """Ask the kernel, from a thread of its own, to read a streamed tensor's bytes into the page
        cache now (``POSIX_FADV_WILLNEED``): ``mlirb.inflate`` names the tensors it fills next, so
        the disk reads them while this one is converted, hashed and written. A hint only: where it
        is not offered, or fails, the tensor is read when it is asked."""
        t = self.streamed.get(name)
        if t is None or name in self._prefetched or not hasattr(os, "posix_fadvise") \
                or (self._ahead is not None and self._ahead.covers(name)):  # read back from the scratch file instead
            return
        self._prefetched.add(name)
        if self._hints is None:
            from concurrent.futures import ThreadPoolExecutor

            self._hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-prefetch")
        self._hints.submit(_will_need, self.folder / t.file, t.offset, t.nbytes)

    def _read_small(self, t: TensorInfo) -> np.ndarray:
        with open(self.folder / t.file, "rb") as fh:
            fh.seek(t.offset)
            raw = np.frombuffer(fh.read(t.nbytes), dtype=np.uint8)
        return as_f32(raw, t.dtype).reshape(t.shape).copy()

    def _exponent(self, t: TensorInfo) -> int:
        """The largest k with max |W| * 2**k <= 2**SCALE_TARGET (0 for an all-zero tensor). For bf16
        the largest magnitude is the largest of the bit patterns with the sign cleared (the order of
        finite bf16 magnitudes is the order of their bits): as int16 the largest positive pattern, as
        uint16 the largest negative one, two integer maxima and no temporary."""
        import torch

        top = 0.0
        if t.dtype == "BF16":
            bits = 0
            for _, _, raw in raw_blocks(self.folder, t):
                if raw.size:
                    pos = int(raw.view("<i2").max())  # the largest positive pattern (negative: none)
                    neg = int(raw.view("<u2").max())  # 0x8000 | the largest negative magnitude, if any
                    bits = max(bits, pos, neg & 0x7FFF if neg >= 0x8000 else 0)
            top = float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
        else:
            for _, _, block in fp32_blocks(self.folder, t):
                if block.numel():
                    lo, hi = torch.aminmax(block)
                    top = max(top, float(hi), -float(lo))
        return scale_exponent(top)

    def _convert(self, t: TensorInfo, fd: int, at: int, k: int = 0) -> None:
        """The tensor converted (``_fp16_blocks``) and written at ``at`` in the scratch file."""
        row_bytes = int(np.prod(t.shape[1:])) * 2
        for r0, data in self._fp16_blocks(t, k):
            _pwrite(fd, data, at + r0 * row_bytes)

    def tensors(self):
        import torch

        out = {}
        for name, arr in self.arrays.items():
            out[name] = torch.from_numpy(arr)  # shares the mapping (writable: no copy, no warning)
        return out

    def quantized(self):
        """name -> (codes, scales) torch tensors sharing the mapping."""
        import torch

        return {n: (torch.from_numpy(self.codes[n]), torch.from_numpy(self.scales[n])) for n in sorted(self.codes)}

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._hints is not None:
            self._hints.shutdown(wait=True, cancel_futures=True)
            self._hints = None
        self.arrays.clear()
        self.codes.clear()
        self.scales.clear()
        try:
            self._map.close()
        except BufferError:  # views still alive elsewhere: the mapping goes with the process
            pass


def load_weights(folder: Path, wanted: dict[str, tuple[int, ...]], scratch_dir: Path, log=lambda msg: None,
                 scaled: bool = False, streamed: bool = False, scheme=None, compressed=()) -> Fp16Weights:
    return Fp16Weights(folder, locate(folder, wanted), scratch_dir, log, scaled, streamed, scheme, compressed)
