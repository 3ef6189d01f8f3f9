"""Every weight in a saved backbone asset against the release's tensor, streamed: the gate's check
that needs no runtime, so it runs at any size (the 9B included) in a few MB of memory.

How it works: docs/modules.md."""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import IntegrityError
from ..formats.mlirb import Blob, BytecodeError, Written, digests
from .shard_reads import tensor_rows
from .streamed_weights import FOLD_MAX_VALUES, TensorInfo, as_f32, raw_blocks, scale_exponent
from ..progress import plural

_BLOCK = 32 << 20  # bytes read at a time, on either side
_RELEASE_PIECE = 8 << 20  # the release's bytes read at a time, four in flight a thread (``shard_reads``)
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


@dataclass(frozen=True)
class Located:
    """Where one release tensor lies in ``main.mlirb``: its blob (fp16 or its fp32 fold) or, compressed,
    its codes and scales blobs, each with its data's sha256 and the tensor's exponent (stored as W * 2**k)."""

    name: str
    shape: tuple[int, ...]
    form: str  # "fp16", "fp32" or "codes"
    exponent: int
    blobs: tuple[tuple[Blob, str], ...]  # (blob, sha256): one, or codes then scales


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
    file_sha256: str = ""  # of main.mlirb, from the same read (the gate checks it against the manifest)
    located: dict[str, "Located"] | None = None  # every tensor found: its blob(s), their digests (``weight_map``)

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


_TILE = 1 << 18  # values converted at a time (1 MB in fp32): tiles stay in the CPU's cache


class _Tiles:
    """A tensor's values as fp32 row tiles of about ``_TILE`` values, converted by numpy
    (``weights.as_f32``) into a buffer reused from tile to tile: fresh 64 MB arrays per block cost
    the gate more in page faults than its arithmetic."""

    def __init__(self, folder: Path, t: TensorInfo, stop=None, direct: bool = False) -> None:
        self.folder, self.t, self.stop, self.direct = folder, t, stop, direct
        self.cols = int(np.prod(t.shape[1:]))
        self.rows = max(1, _TILE // self.cols)
        self.f32 = np.empty(self.rows * self.cols, np.float32)
        self.tmp = np.empty(self.rows * self.cols, np.float32)

    def __call__(self, scale: np.float32 | None = None):
        t, f32 = self.t, self.f32
        src = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}[t.dtype]
        rows = tensor_rows(self.folder, t, _RELEASE_PIECE) if self.direct else raw_blocks(self.folder, t, _BLOCK)
        for _, _, raw in rows:
            if self.stop is not None and self.stop.is_set():
                raise _Stopped
            values = raw.view(src)
            for i in range(0, values.size, self.rows * self.cols):
                part = values[i:i + self.rows * self.cols]
                n = part.size
                as_f32(part, t.dtype, f32[:n])
                if scale is not None:
                    np.multiply(f32[:n], scale, out=f32[:n])  # exact: a power of two
                yield f32[:n].reshape(-1, self.cols)

    def top(self) -> float:
        """The largest magnitude of the tensor."""
        top = 0.0
        for w in self():
            if w.size:
                top = max(top, float(np.max(np.abs(w, out=self.tmp[:w.size].reshape(w.shape)))))
        return top


class _Stopped(Exception):
    """A release side stopped before its end (``ExpectedDigests.stop``)."""


def expected(folder: Path, t: TensorInfo, scaled: bool, scheme=None, stop=None, direct: bool = False) -> Expected:
    tiles = _Tiles(Path(folder), t, stop, direct)
    k = scale_exponent(tiles.top()) if scaled else 0
    scale = np.float32(2.0 ** k) if k else None
    if scheme is not None:  # compressed: the codes and scales by the gate's own (numpy) rule
        from .quantize import Buffers, code_bytes_of, quantize_np

        hc, hs = hashlib.sha256(), hashlib.sha256()
        work = Buffers(tiles.rows * tiles.cols, scheme)
        for w in tiles(scale):
            codes, scales = quantize_np(w, scheme, work)
            hc.update(code_bytes_of(codes, scheme))
            hs.update(scales)
        return Expected(t.name, t.shape, k, None, None, hc.hexdigest(), hs.hexdigest())
    h16 = hashlib.sha256()
    h32 = hashlib.sha256() if int(np.prod(t.shape)) <= FOLD_MAX_VALUES else None
    half = np.empty(tiles.rows * tiles.cols, np.float16)
    for w in tiles(scale):
        part = half[: w.size]
        np.copyto(part, w.reshape(-1), casting="unsafe")  # rounds to nearest even, as astype
        h16.update(part)
        if h32 is not None:
            h32.update(part.astype(np.float32))
    return Expected(t.name, t.shape, k, h16.hexdigest(), h32.hexdigest() if h32 else None)


class ExpectedDigests:
    """The release's side of ``compare``: every 2-D+ tensor's expected digests, by threads that take
    the tensors in turn. The build starts one beside the export (``start(background=True)``: a
    thread at a lower priority, on the core the trace leaves idle, yielding to the export's save),
    and the gate joins it with more threads (``result``); it reads only the release, so it needs
    nothing of the asset. ``stop()`` ends it early (a failed or interrupted build)."""

    def __init__(self, folder: Path, infos: dict[str, TensorInfo], scaled: bool, scheme=None, compressed=(),
                 direct: bool = False) -> None:
        import threading

        self.folder, self.scaled, self.scheme, self.direct = Path(folder), scaled, scheme, direct
        self.compressed = set(compressed)
        self.big = sorted((t for t in infos.values() if len(t.shape) >= 2), key=lambda t: (t.file, t.offset))
        self._results: list[Expected | None] = [None] * len(self.big)
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list = []

    def start(self, threads: int = 1, background: bool = False) -> "ExpectedDigests":
        import threading

        for _ in range(threads):
            th = threading.Thread(target=self._work, args=(background,), name="clef-release-side", daemon=True)
            th.start()
            self._threads.append(th)
        return self

    def _work(self, background: bool) -> None:
        if background:
            _lower_priority()
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next, self._next + 1
            if i >= len(self.big):
                return
            t = self.big[i]
            try:
                self._results[i] = expected(self.folder, t, self.scaled,
                                            self.scheme if t.name in self.compressed else None, self._stop, self.direct)
            except _Stopped:
                return
            except BaseException as exc:  # noqa: BLE001 (re-raised by result())
                self._error = self._error or exc
                self._stop.set()
                return

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join()

    def result(self, threads: int = 2) -> list[Expected]:
        """Every tensor's digests, with threads added up to ``threads`` working (the ones started
        beside the export count, and keep their lower priority)."""
        live = sum(1 for th in self._threads if th.is_alive())
        self.start(max(0, threads - live))
        for th in self._threads:
            th.join()
        if self._error is not None:
            raise self._error
        if self._stop.is_set() or any(r is None for r in self._results):
            raise IntegrityError(f"{self.folder}: the release's side of the weight comparison was stopped")
        return list(self._results)  # type: ignore[arg-type]


def _lower_priority() -> None:
    """This thread at nice 10 (Linux: a thread's own priority), so the export's save, beside it, keeps
    the cores it needs; a no-op where that is not so."""
    import os
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass


def blob_digests(mlirb: Path, written: Written | None = None) -> tuple[str, list[tuple[Blob, str]]]:
    """The sha256 of ``mlirb`` and of every blob in it, in one read (``mlirb.digests``).

    ``written``: what the build's save hashed of the bytes it wrote (``mlirb.Written``). Then each
    byte is hashed once here, for the file: its sha256 equal to the save's proves the file on disk
    is the stream the save hashed, so the save's digests are the blobs'. A file that is not (a byte
    changed after the save, a short write) fails here, named."""
    try:
        whole, found = digests(mlirb, each_blob=written is None)
    except BytecodeError as exc:
        raise IntegrityError(f"{mlirb}: not readable MLIR bytecode ({exc})") from None
    if written is None:
        return whole, found  # type: ignore[return-value]
    if whole != written.sha256 or len(found) != len(written.blobs):
        raise IntegrityError(f"{mlirb}: not the bytes the build's save wrote (sha256 {whole[:16]}, "
                             f"the save's {written.sha256[:16]})")
    return whole, [(b, d) for (b, _), d in zip(found, written.blobs)]


def compare(mlirb: Path, folder: Path, infos: dict[str, TensorInfo], scaled: bool,
            log=lambda msg: None, scheme=None, compressed=(), release: ExpectedDigests | None = None,
            written: Written | None = None) -> WeightsReport:
    """The release's 2-D+ tensors against the blobs of ``mlirb`` (both hashed at once); the
    ``compressed`` ones as ``scheme``'s codes and scales. ``release``: its side already started
    (the build's, beside the export), for this release, recipe and scheme. ``written``: the
    build's save's digests (``blob_digests``: the file then hashed once, not twice)."""
    t0 = time.perf_counter()
    if release is not None and (release.folder, release.scaled, release.scheme, release.compressed) != (
            Path(folder), scaled, scheme, set(compressed)):  # started for another release or recipe: not used
        release.stop()
        release = None
    release = release or ExpectedDigests(folder, infos, scaled, scheme, compressed)
    big = release.big

    def timed(*args):
        t = time.perf_counter()
        out = blob_digests(*args)
        return out, time.perf_counter() - t

    with ThreadPoolExecutor(max_workers=1) as pool:
        asset_side = pool.submit(timed, Path(mlirb), written)
        try:
            wants = release.result(threads=2)  # numpy and hashlib release the GIL: both cores
        except BaseException:
            release.stop()
            raise
        t_release = time.perf_counter() - t0
        (file_sha256, have), t_asset = asset_side.result()
    by_digest: dict[str, Blob] = {}
    for b, d in have:
        by_digest.setdefault(d, b)
    matched, missing, used, found, located = {}, [], set(), {}, {}
    for e in wants:
        if e.codes is not None:
            digests_of = (e.codes, e.scales) if e.codes in by_digest and e.scales in by_digest else None
            form = "codes"
        else:
            form = "fp16" if e.fp16 in by_digest else "fp32" if e.fp32 is not None and e.fp32 in by_digest else None
            digests_of = None if form is None else ((e.fp16,) if form == "fp16" else (e.fp32,))
        if digests_of is None:
            missing.append(e.name)
            continue
        matched[e.name] = form
        located[e.name] = Located(e.name, e.shape, form, e.exponent, tuple((by_digest[d], d) for d in digests_of))
        used.update(by_digest[d].name for d in digests_of)
        if form == "codes":
            found[e.name] = Found(e.name, e.shape, e.exponent, by_digest[e.codes], by_digest[e.scales])
    other = [b for b, _ in have if b.name not in used]
    report = WeightsReport(tensors=len(big), matched=matched, missing=missing,
                           one_d=sum(1 for t in infos.values() if len(t.shape) < 2), blobs=len(have),
                           other_blobs=len(other), other_bytes=sum(b.size for b in other),
                           fp16_bytes=sum(int(np.prod(t.shape)) * 2 for t in big), seconds=time.perf_counter() - t0,
                           found=found, scheme=scheme, file_sha256=file_sha256, located=located)
    # where the time went: main.mlirb's read (disk-bound once hashed once) or the release's side
    log(f"weights: {len(matched)}/{plural(len(big), 'tensor')} found in main.mlirb in {report.seconds:.1f} s "
        f"(main.mlirb read in {t_asset:.1f} s" + (", its blobs by the save's digests, the file hashed once" if written is not None else "")
        + f"; the release's side ready after {t_release:.1f} s)")
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
    w = dequantize(codes, scales, scheme).astype(np.float32)  # its fp32 products gone before this copy
    if f.exponent:  # in place: a 9B matrix's fp32 copy is 200 MB, the gate's peak (docs/performance.md)
        np.multiply(w, np.float32(2.0 ** -f.exponent), out=w)
    return w
