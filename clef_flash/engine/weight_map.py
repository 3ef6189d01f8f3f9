"""The weight map beside an asset: which blob of ``main.mlirb`` holds each weight (its data's sha256,
the exponent k it is stored scaled by as W * 2**k, and its form: fp16, the fp32 fold of a small one,
or int codes + fp16 scales), and the 1-D tensors the compiler folded into derived constants (a norm
weight becomes 1 + w), as the release holds them. With it a torch engine computes with the shipped
bytes and no release at hand (``backbone.executor``).

One safetensors file: the 1-D tensors (fp32, exact from bf16) and the map as its JSON metadata. The
build writes it from the gate's streamed comparison (``asset_readback.compare``), which finds each
release tensor's blob by its digest; the manifest carries the file's sha256."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from ..errors import IntegrityError
from ..manifest import Strict

MAP_FILE = "weight-map.safetensors"
FORMAT = "clef-weight-map/1"
SCHEMA_FILE = "weight-map.schema.json"
_KEY = "weight_map"  # the safetensors metadata key holding the map's JSON
BLOCK_BYTES = 16 << 20  # a matrix's widened rows at a time in ``widened_blocks``


class BlobRef(Strict):
    name: str  # the resource's key in main.mlirb
    start: int = Field(ge=0)  # where its data lies (alignment and size prefix excluded)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class MappedWeight(Strict):
    name: str
    shape: list[int]
    form: Literal["fp16", "fp32", "codes"]
    exponent: int  # the blob holds W * 2**exponent; what is computed from it is multiplied by 2**-exponent
    blobs: list[BlobRef]  # one; codes then scales for "codes"


class WeightMap(Strict):
    format: Literal["clef-weight-map/1"]
    main_mlirb_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bits: Literal[4, 8] | None = None  # the codes' width where any tensor is compressed
    block: int | None = None  # values a scale covers, along the input axis
    weights: list[MappedWeight]
    folded: list[str]  # the 1-D tensors in this file, by name


def json_schema() -> dict:
    from ..manifest import json_schema_of

    return json_schema_of(WeightMap, SCHEMA_FILE)


def map_bytes(report, folded: dict[str, np.ndarray]) -> bytes:
    """The file's bytes from the gate's comparison (every 2-D+ tensor located) and the 1-D tensors."""
    from safetensors.numpy import save

    if not report.ok or report.located is None:
        raise IntegrityError("the weight map needs every weight located in main.mlirb")
    weights = [MappedWeight(name=loc.name, shape=list(loc.shape), form=loc.form, exponent=loc.exponent,
                            blobs=[BlobRef(name=b.name, start=b.start, size=b.size, sha256=d) for b, d in loc.blobs])
               for loc in sorted(report.located.values(), key=lambda loc: loc.name)]
    scheme = report.scheme
    m = WeightMap(format=FORMAT, main_mlirb_sha256=report.file_sha256, weights=weights, folded=sorted(folded),
                  bits=scheme.bits if scheme is not None else None, block=scheme.block if scheme is not None else None)
    tensors = {n: np.ascontiguousarray(folded[n], dtype=np.float32) for n in sorted(folded)}
    return save(tensors, metadata={_KEY: json.dumps(m.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))})


@dataclass
class ShippedWeights:
    """An asset's weights as it stores them, read back through its map: ``array(name)`` is what the
    graph's buffer held at export (fp16 times 2**k, its fp32 fold, or a compressed tensor's
    ``fp16(code * scale)`` by the runtime's rule), a view of ``main.mlirb`` where no arithmetic is needed."""

    mlirb: Path
    map: WeightMap
    folded: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        self.by_name = {w.name: w for w in self.map.weights}
        self._file = np.memmap(self.mlirb, dtype=np.uint8, mode="c")  # copy-on-write: torch takes it without a copy

    @property
    def exponents(self) -> dict[str, int]:
        return {w.name: w.exponent for w in self.map.weights if w.exponent}

    def _raw(self, ref: BlobRef) -> np.ndarray:
        return self._file[ref.start:ref.start + ref.size]

    def array(self, name: str) -> np.ndarray:
        from .quantize import Scheme, codes_from_bytes, dequantize

        w = self.by_name[name]
        shape = tuple(w.shape)
        if w.form == "codes":
            scheme = Scheme(int(self.map.bits), int(self.map.block))
            codes = codes_from_bytes(self._raw(w.blobs[0]), shape, scheme)
            scales = self._raw(w.blobs[1]).view(np.float16).reshape(scheme.scale_shape(shape))
            return dequantize(codes, scales, scheme)
        return self._raw(w.blobs[0]).view(np.float16 if w.form == "fp16" else np.float32).reshape(shape)

    def tensor(self, name: str):
        """``array(name)`` as a torch tensor (sharing the mapping where it is a view); a compressed
        tensor dequantized by torch (``quantize.dequantize_torch``: the same bits, vectorised)."""
        import torch

        from .quantize import Scheme, codes_from_bytes, dequantize_torch

        w = self.by_name[name]
        if w.form != "codes":
            return torch.from_numpy(self.array(name))
        scheme = Scheme(int(self.map.bits), int(self.map.block))
        shape = tuple(w.shape)
        codes = torch.from_numpy(np.ascontiguousarray(codes_from_bytes(self._raw(w.blobs[0]), shape, scheme)))
        scales = torch.from_numpy(self._raw(w.blobs[1]).view(np.float16).reshape(scheme.scale_shape(shape)))
        return dequantize_torch(codes, scales, scheme)

    def widened_blocks(self, name: str, dtype, block_bytes: int = BLOCK_BYTES, raw: list[np.ndarray] | None = None,
                       buffers: BlockBuffers | None = None):
        """``tensor(name)`` (a matrix) widened to ``dtype`` a block of rows at a time (``widened_blocks``);
        ``raw``: its blobs' bytes already read (``read_blobs``), else the mapped file's."""
        w = self.by_name[name]
        raw = raw if raw is not None else [self._raw(b) for b in w.blobs]
        scheme = None
        if w.form == "codes":
            from .quantize import Scheme

            scheme = Scheme(int(self.map.bits), int(self.map.block))
        return widened_blocks(w.form, raw[0], raw[1] if len(raw) > 1 else None, tuple(w.shape), scheme, dtype,
                              block_bytes, buffers)

    def read_blobs(self, names: list[str], into: np.ndarray | None = None) -> tuple[dict[str, list[np.ndarray]], np.ndarray]:
        """The blobs of ``names`` read from ``main.mlirb`` into one buffer (``into`` reused where it is
        large enough): page-cache reads once, where a mapping's pages are faulted in again and
        again as the kernel reclaims them (measured: 365,000 faults a second, a third of the CPU in
        the kernel, the 9B's request 1.7x slower). Returns (name -> its blobs' bytes, the buffer)."""
        from .streamed_weights import read_exactly

        total = sum(b.size + 63 for n in names for b in self.by_name[n].blobs)
        buf = into if into is not None and into.size >= total else np.empty(total, np.uint8)
        out: dict[str, list[np.ndarray]] = {}
        at = 0
        with open(self.mlirb, "rb", buffering=0) as fh:
            for n in names:
                out[n] = []
                for b in self.by_name[n].blobs:
                    at = -(-at // 64) * 64  # each blob's values aligned, as torch views them
                    read_exactly(fh, b.start, memoryview(buf)[at:at + b.size], self.mlirb, f"blob {b.name}")
                    out[n].append(buf[at:at + b.size])
                    at += b.size
        return out, buf


class BlockBuffers:
    """The buffers ``widened_blocks`` works in, made once and reused for every matrix and chunk: a
    fresh 16 MB buffer is a new mapping where allocations that size are mapped (the engine's
    setting), and faulting its pages in at every use cost more than the dequantization."""

    def __init__(self, dtype, block_bytes: int = BLOCK_BYTES) -> None:
        import torch

        values = block_bytes // 4
        self.block_bytes = block_bytes
        self.out = torch.empty(values, dtype=dtype)
        self.work = torch.empty(values, dtype=torch.float32)
        self.half = torch.empty(values, dtype=torch.float16)


def widened_blocks(form: str, raw: np.ndarray, raw_scales: np.ndarray | None, shape: tuple[int, int], scheme, dtype,
                   block_bytes: int = BLOCK_BYTES, buffers: BlockBuffers | None = None):
    """A stored matrix (``raw``: its blob's bytes; ``form`` fp16, fp32, or codes with ``raw_scales``
    by ``scheme``) widened to ``dtype`` a block of rows at a time, ``(r0, r1, rows)``, into one reused
    buffer: each block good until the next is asked for, the whole matrix never in memory (its fp32
    copy is 201 MB at the 9B's widest). The values the whole tensor widened has: a compressed block
    is dequantized by the same rule, ``fp16(code * scale)``, row by row."""
    import torch

    from .quantize import dequantize_torch, unpack_int4

    rows, cols = shape
    if buffers is not None:
        block_bytes = buffers.block_bytes
    step = max(1, block_bytes // (cols * 4))
    n = min(rows, step) * cols
    buf = buffers.out if buffers is not None else torch.empty(n, dtype=dtype)
    if form == "codes":
        scales = raw_scales.view(np.float16).reshape(scheme.scale_shape(shape))
        work = buffers.work if buffers is not None else torch.empty(n, dtype=torch.float32)
        half = buffers.half if buffers is not None else None
    else:
        stored = raw.view(np.float16 if form == "fp16" else np.float32).reshape(rows, cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out = buf[: (r1 - r0) * cols].view(r1 - r0, cols)
        if form == "codes":
            # int4: two codes a byte, and a row's cols (a multiple of the even block) are whole bytes
            codes = raw[r0 * cols:r1 * cols].view(np.int8) if scheme.bits == 8 else \
                unpack_int4(raw[r0 * cols // 2:r1 * cols // 2], (r1 - r0) * cols)
            out.copy_(dequantize_torch(torch.from_numpy(codes).view(r1 - r0, cols), torch.from_numpy(scales[r0:r1]),
                                       scheme, work, half))
        else:
            out.copy_(torch.from_numpy(stored[r0:r1]))
        yield r0, r1, out


def read_map(path: Path, want: str | None) -> tuple[WeightMap, dict[str, np.ndarray]]:
    """The map and the 1-D tensors, the file's sha256 checked against ``want`` (the manifest's)."""
    from safetensors import safe_open

    from ..digest import sha256_file

    path = Path(path)
    if not path.is_file():
        raise IntegrityError(f"{path}: missing; the torch engine reads the asset's weights through it "
                             f"(a bundle built before it: build it again)")
    if want is not None and sha256_file(path) != want:
        raise IntegrityError(f"{path}: sha256 differs from the manifest's")
    try:
        with safe_open(str(path), framework="np") as f:
            meta = (f.metadata() or {}).get(_KEY)
            folded = {k: f.get_tensor(k) for k in f.keys()}
        m = WeightMap.model_validate_json(meta or "")
    except (ValueError, OSError) as exc:
        raise IntegrityError(f"{path}: not a weight map ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if sorted(folded) != m.folded:
        raise IntegrityError(f"{path}: its tensors are not the ones its map names")
    return m, folded


def open_weights(path: Path, want: str | None, mlirb: Path, mlirb_sha256: str, check_blobs: bool = True,
                 log=lambda msg: None) -> ShippedWeights:
    """The asset's weights through its map (``path``), every check before any arithmetic: the map's
    sha256 (the manifest's), the ``main.mlirb`` it was made for, each blob where the map says and,
    with ``check_blobs``, each blob's data against the map's sha256 and the whole file against
    ``mlirb_sha256`` in one read. ``IntegrityError`` (exit 3) naming the file and the tensor."""
    import time

    from ..formats.mlirb import BytecodeError, blobs, digests

    m, folded = read_map(path, want)
    if m.main_mlirb_sha256 != mlirb_sha256:
        raise IntegrityError(f"{path}: made for another main.mlirb (sha256 {m.main_mlirb_sha256[:12]}…, "
                             f"the manifest's {mlirb_sha256[:12]}…)")
    try:
        t0 = time.perf_counter()
        if check_blobs:
            whole, have = digests(mlirb)
            if whole != mlirb_sha256:
                raise IntegrityError(f"{mlirb}: sha256 differs from the manifest's")
            table = {b.name: (b, d) for b, d in have}
        else:
            table = {b.name: (b, None) for b in blobs(mlirb)}
    except BytecodeError as exc:
        raise IntegrityError(f"{mlirb}: not readable MLIR bytecode ({exc})") from None
    for w in m.weights:
        for ref in w.blobs:
            got = table.get(ref.name)
            if got is None or (got[0].start, got[0].size) != (ref.start, ref.size):
                raise IntegrityError(f"{mlirb}: {w.name}'s blob {ref.name} is not where {path.name} says")
            if got[1] is not None and got[1] != ref.sha256:
                raise IntegrityError(f"{mlirb}: {w.name}'s blob {ref.name} differs from {path.name}'s sha256")
    if check_blobs:
        log(f"weights: {len(m.weights)} tensors read back from main.mlirb and checked in {time.perf_counter() - t0:.1f} s")
    return ShippedWeights(mlirb=Path(mlirb), map=m, folded=folded)
