"""Every weight in a saved backbone asset against the release's tensor, streamed: the gate's check
that needs no runtime, so it runs at any size (the 9B included) in a few MB of memory.

The release side: each tensor of two or more dimensions read from its shard in row blocks,
converted here with numpy (bf16 -> fp32 by a shift, times ``2**k`` for the fp32-compute recipes
with ``k`` by the build's rule ``weights.scale_exponent``, rounded to fp16; numpy, not the build's
torch path), and hashed as fp16 bytes; a small tensor also as those fp16 values widened to fp32 (the Core AI compiler folds the
fp32 cast of a small fp16 constant into an fp32 blob). The asset side: every blob of
``main.mlirb`` located from the bytecode's resource section and hashed where it lies. A tensor
whose bytes are in no blob is a failure naming it. The two sides run in two threads (hashlib and
numpy release the GIL on large buffers): the two cores read the release and the asset at once.

A compressed tensor (int8 / int4 recipes) is quantized here again by the gate's own numpy rule
(``quantize.quantize_np``, not the build's torch path) and its codes (packed for int4) and its
scales are each found by their sha256; the two blobs are kept, so the numeric gate dequantizes
what ``main.mlirb`` holds (``dequantized``), not what the build had in memory.

1-D tensors (norm scales, ``A_log``, ``dt_bias``) are not compared here: the converter folds them
into derived constants (``1 + w``, ``-exp(A_log)``); the numeric gate covers them.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import IntegrityError
from ..formats.mlirb import Blob, BytecodeError, blob_sha256, blobs
from .weights import FOLD_MAX_VALUES, TensorInfo, as_f32, raw_blocks, scale_exponent
from ..progress import plural

_BLOCK = 32 << 20  # bytes read at a time, on either side
# the fp32 form is hashed for tensors up to FOLD_MAX_VALUES values: the compiler folds the cast of
# fp16 constants up to about 131,072 values (measured); a larger folded one fails here, never passes


@dataclass(frozen=True)
class Expected:
    name: str
    shape: tuple[int, ...]
    exponent: int
    fp16: str | None  # sha256 of the fp16 bytes (times 2**exponent); None for a compressed tensor
    fp32: str | None  # sha256 of the same values widened to fp32 (small tensors only)
    codes: str | None = None  # a compressed tensor: sha256 of its codes as stored (int4 packed)
    scales: str | None = None  # ... and of its fp16 scales


@dataclass(frozen=True)
class Found:
    """Where a compressed tensor's codes and scales lie in ``main.mlirb``."""

    name: str
    shape: tuple[int, ...]
    exponent: int
    codes: Blob
    scales: Blob


@dataclass
class WeightsReport:
    tensors: int  # 2-D+ tensors compared
    matched: dict[str, str]  # name -> form found ("fp16" / "fp32")
    missing: list[str]  # names whose bytes are in no blob
    one_d: int  # 1-D tensors, not compared here (folded into derived constants)
    blobs: int
    other_blobs: int  # blobs no tensor matched (RoPE tables, masks, derived constants)
    other_bytes: int
    fp16_bytes: int  # bytes of the 2-D+ tensors as fp16
    seconds: float = 0.0
    found: dict[str, Found] | None = None  # compressed tensors: their two blobs
    scheme: object = None

    @property
    def ok(self) -> bool:
        return not self.missing

    def checks(self) -> list[tuple[str, bool, str]]:
        forms = {f: sum(1 for v in self.matched.values() if v == f) for f in ("fp16", "fp32", "codes")}
        q = f", {forms['codes']} as {self.scheme.weights} codes + scales" if self.scheme is not None else ""
        detail = (f"{len(self.matched)}/{plural(self.tensors, 'tensor')} ({self.fp16_bytes:,} fp16 bytes; {forms['fp16']} as fp16, "
                  f"{forms['fp32']} folded to fp32{q}); {self.blobs} blobs, {self.other_blobs} other constants "
                  f"({self.other_bytes:,} bytes); {self.one_d} 1-D tensors folded, left to the numeric check")
        if self.missing:
            detail = (f"{self.missing[0]} is in no blob of main.mlirb" + (f" (+{len(self.missing) - 1} more)"
                      if len(self.missing) > 1 else "") + "; " + detail)
        what = ("every weight = the release's tensor in fp16 (streamed)" if self.scheme is None else
                f"every weight = the release's tensor, fp16 or {self.scheme.weights} codes + scales by the gate's own rule (streamed)")
        return [(what, self.ok, detail)]


def _rows(folder: Path, t: TensorInfo):
    """The tensor's values as fp32 row blocks."""
    for _, _, raw in raw_blocks(folder, t, _BLOCK):
        yield as_f32(raw, t.dtype)


def expected(folder: Path, t: TensorInfo, scaled: bool, scheme=None) -> Expected:
    k = 0
    if scaled:
        top = 0.0
        for block in _rows(folder, t):
            if block.size:
                top = max(top, float(np.max(np.abs(block))))
        k = scale_exponent(top)
    if scheme is not None:  # compressed: the codes and scales by the gate's own (numpy) rule
        from .quantize import code_bytes_of, quantize_np

        hc, hs = hashlib.sha256(), hashlib.sha256()
        scale = np.float32(2.0 ** k)
        for block in _rows(folder, t):
            w = block.reshape(-1, t.shape[1])
            codes, scales = quantize_np(w * scale if k else w, scheme)
            hc.update(code_bytes_of(codes, scheme))
            hs.update(scales)
        return Expected(t.name, t.shape, k, None, None, hc.hexdigest(), hs.hexdigest())
    h16 = hashlib.sha256()
    h32 = hashlib.sha256() if int(np.prod(t.shape)) <= FOLD_MAX_VALUES else None
    scale = np.float32(2.0 ** k)
    for block in _rows(folder, t):
        half = (block * scale).astype(np.float16) if k else block.astype(np.float16)
        h16.update(half)
        if h32 is not None:
            h32.update(half.astype(np.float32))
    return Expected(t.name, t.shape, k, h16.hexdigest(), h32.hexdigest() if h32 else None)


def blob_digests(mlirb: Path) -> list[tuple[Blob, str]]:
    try:
        found = blobs(mlirb)
        with open(mlirb, "rb", buffering=0) as fh:
            return [(b, blob_sha256(fh, b)) for b in found]
    except BytecodeError as exc:
        raise IntegrityError(f"{mlirb}: not readable MLIR bytecode ({exc})") from None


def compare(mlirb: Path, folder: Path, infos: dict[str, TensorInfo], scaled: bool,
            log=lambda msg: None, scheme=None, compressed=()) -> WeightsReport:
    """The release's 2-D+ tensors against the blobs of ``mlirb`` (both hashed, in two threads); the
    ``compressed`` ones as ``scheme``'s codes and scales."""
    t0 = time.perf_counter()
    compressed = set(compressed)
    big = sorted((t for t in infos.values() if len(t.shape) >= 2), key=lambda t: (t.file, t.offset))
    with ThreadPoolExecutor(max_workers=2) as pool:
        asset_side = pool.submit(blob_digests, Path(mlirb))
        wants = [expected(Path(folder), t, scaled, scheme if t.name in compressed else None) for t in big]
        have = asset_side.result()
    by_digest: dict[str, Blob] = {}
    for b, d in have:
        by_digest.setdefault(d, b)
    matched, missing, used, found = {}, [], set(), {}
    for e in wants:
        if e.codes is not None:
            if e.codes in by_digest and e.scales in by_digest:
                matched[e.name] = "codes"
                found[e.name] = Found(e.name, e.shape, e.exponent, by_digest[e.codes], by_digest[e.scales])
                used.update((by_digest[e.codes].name, by_digest[e.scales].name))
            else:
                missing.append(e.name)
        elif e.fp16 in by_digest:
            matched[e.name] = "fp16"
            used.add(by_digest[e.fp16].name)
        elif e.fp32 is not None and e.fp32 in by_digest:
            matched[e.name] = "fp32"
            used.add(by_digest[e.fp32].name)
        else:
            missing.append(e.name)
    other = [b for b, _ in have if b.name not in used]
    report = WeightsReport(tensors=len(big), matched=matched, missing=missing,
                           one_d=sum(1 for t in infos.values() if len(t.shape) < 2), blobs=len(have),
                           other_blobs=len(other), other_bytes=sum(b.size for b in other),
                           fp16_bytes=sum(int(np.prod(t.shape)) * 2 for t in big), seconds=time.perf_counter() - t0,
                           found=found, scheme=scheme)
    log(f"weights: {len(matched)}/{plural(len(big), 'tensor')} found in main.mlirb in {report.seconds:.1f} s")
    return report


def read_blob(mlirb: Path, blob: Blob) -> np.ndarray:
    with open(mlirb, "rb") as fh:
        fh.seek(blob.start)
        data = fh.read(blob.size)
    if len(data) != blob.size:
        raise IntegrityError(f"{mlirb}: ends inside blob {blob.name}")
    return np.frombuffer(data, dtype=np.uint8)


def dequantized(mlirb: Path, f: Found, scheme, red: str | None = None) -> np.ndarray:
    """The weight a compressed tensor's two blobs in ``mlirb`` say, as the asset computes with it:
    ``fp16(code * scale) * 2**-k`` in fp32. ``red`` (the gate's red arms, which must fail):
    ``scales_shifted`` every scale moved one block along the input axis; ``codes_transposed`` the
    codes read as the transposed matrix."""
    from .quantize import codes_from_bytes, dequantize

    codes = codes_from_bytes(read_blob(mlirb, f.codes), f.shape, scheme)
    scales = read_blob(mlirb, f.scales).view(np.float16).reshape(scheme.scale_shape(f.shape))
    if red == "scales_shifted":
        scales = np.roll(scales, 1, axis=1)
    elif red == "codes_transposed":
        codes = np.ascontiguousarray(codes.T).reshape(f.shape)
    w = dequantize(codes, scales, scheme).astype(np.float32)
    return w * np.float32(2.0 ** -f.exponent) if f.exponent else w
