"""The backbone's gate: a finished backbone bundle against the release it was built from.

How it works: docs/modules.md."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import IntegrityError, UsageError
from ..report import GateConfig
from .rows import RowsReport, asset_facts_of, core_ai_schema, source_of  # noqa: F401 (source_of: gate.MODELS' entry)
from ..backbone.bundle import check_files, descriptor_checks
from ..backbone.manifest import functions_of
from ..backbone.executor import RUNTIME_MAX_PARAMETERS
from ..formats.aimodel import check_files as check_asset
from ..formats.mlirb import BytecodeError
from ..interrupts import run_async
from ..progress import plural

# Bars on the hidden rows, relative to the record's largest |value| (Qwen3.5's final-norm rows carry
# a few outlier dimensions, so a bar relative to each element would be meaningless near zero).
TOLERANCES: dict[str, dict[str, tuple[float, str]]] = {
    "fp32": {
        "rel_max_abs_d": (1e-4, "fp32 compute on fp16 weights that hold the bf16 values exactly (stored scaled by powers of "
                                "two, so none is an fp16 subnormal the runtime would flush): only fp32 accumulation order "
                                "differs. Measured 3.8e-7 at tiny width, 8e-6 to 2.1e-5 at the real-width slice (sums over "
                                "4,096 and 12,288 terms), where transformers' own fp32 forward is 3.7e-6 to 1.6e-5 from its "
                                "fp64 forward; flushed subnormals gave 2.1e-4 at tiny width, the red arms 0.1 and more"),
        "min_row_cosine": (0.999999, "every row points the same way as the reference's to fp32 accumulation noise"),
    },
    "fp16": {
        "rel_max_abs_d": (1e-2, "fp16 matmuls (11-bit mantissa, 4.9e-4 per rounding) through every layer, norms, softmax and "
                                "the recurrence in fp32: measured 2.3e-3 on the tiny release; a position one token late "
                                "moves it by 0.1"),
        "min_row_cosine": (0.9999, "row direction to fp16 rounding (measured 0.99997 on the tiny release; a position one "
                                   "token late gives 0.988): what the head reads through its normalised projections"),
    },
}
RED_ARMS = ("state_reset", "positions_late")
# a decoder with image inputs: the image record through a host that drops its rows, swaps rows and
# columns, or forgets the post-image shift (``backbone.host.IMAGE_RED_ARMS``)
IMAGE_RED_ARMS = ("image_zeroed", "rc_swapped", "shift_dropped")
# compressed weights: the reference reads the asset's codes and scales wrongly, and must fail the bar
# (the gate sees the layout it claims: blocks along the input axis, codes row-major)
QUANT_RED_ARMS = ("scales_shifted", "codes_transposed")
REPORTED = "quantization"  # the compressed asset against the uncompressed release: reported, not gated here
# the numeric check runs through the runtime on decoders up to this many parameters unless the recipe says
# otherwise (the Linux CPU runtime's fp16 arithmetic takes over 16 minutes a chunk at real width), past
# them through the torch engine: the sizes where the runtime runs a chunk in seconds
NUMERIC_MAX_PARAMETERS = RUNTIME_MAX_PARAMETERS


# the torch engine (``backbone.executor``): its rows against the runtime's, held to the bars of the
# asset's compute (fp32: accumulation order alone; fp16 compute run in fp32 on a CPU: the fp16 bound)
ENGINE = "torch engine"
# past numeric_max_parameters the numeric check runs through the torch engine, on this many seeded
# records of this many tokens (at 9B on a 2-core CPU about 2-3 minutes a record a side), beside one
# chunk through the runtime (the spot check) where its compute is fp32
ENGINE_RECORDS, ENGINE_TOKENS = 2, 512
# what one 64-token chunk costs the Linux CPU runtime per billion parameters (measured at 9B: 268 s in
# fp32, docs/performance.md; over 38 minutes in fp16, where a chunk had not returned): the spot check's estimate
RUNTIME_SECONDS_PER_CHUNK_PER_B = {"fp32": 268 / 7.94, "fp16": 38 * 60 / 7.94}


# compressed weights: the bars above hold the asset against the reference on the asset's own
# dequantized weights (the runtime's exactness); the quantization's own cost is measured apart
QUANTIZATION = {"rel_max_abs_d": (None, "the compressed asset's rows against the uncompressed release's: the "
                                        "quantization's cost, reported here; gated end to end by check-release "
                                        "--backbone against the published port's bar (max |dp| 0.02)")}


def tolerances(compute: str, weights: str = "fp16") -> dict[str, dict[str, Any]]:
    out = {k: {"bar": v[0], "reason": v[1]} for k, v in TOLERANCES[compute].items()}
    if weights != "fp16":
        out["quantization"] = {"bar": QUANTIZATION["rel_max_abs_d"][0], "reason": QUANTIZATION["rel_max_abs_d"][1]}
    return out


@dataclass(frozen=True)
class BackboneVerifyConfig(GateConfig):
    seed: int = 0
    long_record: int | None = None
    numeric_max_parameters: int | None = None  # None: NUMERIC_MAX_PARAMETERS for the bundle's compute
    red: bool = True
    weights: bool = True  # every 2-D+ weight in main.mlirb against the release, streamed (asset_readback)
    scratch: Path | None = None  # where the runtime's compiled copy goes (build: the staged bundle, on the output's disk)
    pins: Any = None  # the build's plan: pins already loaded
    checked: dict[str, str] | None = None  # the build's plan: file -> sha256 already checked in this process
    text: Any = None  # the build's plan: the release's text configuration
    located: dict[str, Any] | None = None  # the build's plan: every weight located in the shards
    expected_digests: Any = None  # the build's: asset_readback.ExpectedDigests started beside the export
    written: Any = None  # the build's: mlirb.Written, what its save hashed (main.mlirb then read with one hash)
    weights_report: Any = None  # the build's: asset_readback.WeightsReport, the comparison already run (weight map)
    device: str = "auto"  # where the torch engine runs (devices.pick_device)
    spot_check: bool | None = None  # past numeric_max_parameters: one chunk through the runtime (None: where fp32 compute)


@dataclass
class RecordResult:
    name: str
    tokens: int
    calls: int
    rel_max_abs_d: float
    min_row_cosine: float
    arm: str = "main"
    function: str = "main"  # the decoder's function the record ran in (the first whose slots hold it)


@dataclass
class BackboneReport(RowsReport):
    weights: str = "fp16"
    engines: list[str] = field(default_factory=list)  # what computed the rows besides the runtime
    by_engine: bool = False  # the main rows are the torch engine's (a decoder past the runtime's size)
    # the asset's functions that must each run a main record (the runtime's numeric check): none ships unproven
    functions: tuple[str, ...] = ()

    TOLERANCES: ClassVar = TOLERANCES
    REPORTED_ARMS: ClassVar = (REPORTED,)
    GATED_ARMS: ClassVar = (ENGINE,)

    def _main_label(self, r: RecordResult) -> str:
        return f"record {r.name} ({plural(r.tokens, 'token')}{', ' + r.function if len(self.functions) > 1 else ''})"

    def result_failures(self) -> list[str]:
        out = super().result_failures()
        ran = {r.function for r in self.main_results()}
        out.extend(f"function {f} ran no gate record: it would ship unproven" for f in self.functions if f not in ran)
        return out

    def _named(self, r: RecordResult) -> str:
        return f"{r.name} [{r.function}]" if len(self.functions) > 1 else r.name

    def title(self) -> str:
        return f"verify {self.bundle} (backbone, weights {self.weights}, compute {self.compute})"

    def columns(self) -> list[str]:
        return ["record", "tokens", "calls", "rel max |d|", "min row cosine"]

    def rows(self):
        out = []
        for r in self.results:
            if r.arm == REPORTED:
                out.append(([f"{r.name} (vs the uncompressed release)", str(r.tokens), str(r.calls),
                             f"{r.rel_max_abs_d:.2e}", f"{r.min_row_cosine:.7f}"], "report"))
                continue
            if r.arm == ENGINE:
                out.append(([f"{r.name} (torch engine vs the runtime)", str(r.tokens), str(r.calls),
                             f"{r.rel_max_abs_d:.2e}", f"{r.min_row_cosine:.7f}"], self.verdict(r)))
                continue
            out.append(([self._named(r) if r.arm == "main" else f"{self._named(r)} (red: {r.arm})", str(r.tokens), str(r.calls),
                         f"{r.rel_max_abs_d:.2e}", f"{r.min_row_cosine:.7f}"], self.verdict(r)))
        return out

    def lines(self) -> list[str]:
        red = self.red_results()
        out = ["red arms run: " + ", ".join(f"{r.arm} on {r.name} ({r.rel_max_abs_d:.2g})" for r in red)] if red else []
        out.extend(self.engines)
        q = self.quantization()
        if q:
            who = "the torch engine" if self.by_engine else "the runtime"
            out.append(f"(a) {who}: rows vs torch eager on the asset's own dequantized weights, the bars above; "
                       f"(b) the quantization: rows vs the uncompressed release, rel max |d| {q['rel_max_abs_d']:.3g}, "
                       f"min row cosine {q['min_row_cosine']:.6f} (reported; check-release --backbone gates it end to end)")
        return out

    def quantization(self) -> dict[str, float] | None:
        return _worst([r for r in self.results if r.arm == REPORTED])

    def engine(self) -> dict[str, float] | None:
        """The torch engine against the runtime, worst over the records."""
        return _worst([r for r in self.results if r.arm == ENGINE])

    def headline(self) -> str:
        main = self.main_results()
        if not main:
            return self.checks_headline()
        worst = max(r.rel_max_abs_d for r in main)
        red = self.red_results()
        q = self.quantization()
        e = self.engine()
        return (f"{plural(len(main), 'record')}, rel max |d| {worst:.2e} (bar {self.bars()['rel_max_abs_d']:g}); "
                + ("red arms " + ", ".join(f"{r.arm} {r.rel_max_abs_d:.2g}" for r in red) if red else "no red arms at this size")
                + (f"; quantization vs the release: rel max |d| {q['rel_max_abs_d']:.3g}, min cosine {q['min_row_cosine']:.5f}"
                   if q else "")
                + (f"; torch engine vs the runtime: rel max |d| {e['rel_max_abs_d']:.2e}" if e else ""))

    def summary(self) -> dict[str, Any]:
        main = self.main_results()
        return {"ok": self.ok, "compute": self.compute,
                "records": {r.name: {"tokens": r.tokens, "calls": r.calls, "function": r.function,
                                     "rel_max_abs_d": r.rel_max_abs_d, "min_row_cosine": r.min_row_cosine} for r in main},
                "red": {r.arm: r.rel_max_abs_d for r in self.red_results()},
                "red_records": {r.arm: r.name for r in self.red_results()},
                "weights": self.weights, "quantization": self.quantization(), "engine": self.engine(), "engines": self.engines,
                "bars": self.bars(),
                "checks": {n: ok for n, ok, _ in self.checks}, "failures": self.failures, "notes": self.notes}


def _worst(rs: list) -> dict[str, float] | None:
    if not rs:
        return None
    return {"rel_max_abs_d": max(r.rel_max_abs_d for r in rs), "min_row_cosine": min(r.min_row_cosine for r in rs)}


def record_lengths(chunk: int, context: int, long_record: int | None, short_contexts=()) -> dict[str, int]:
    """1, S - 1, S, S + 1, three chunks (two where the context holds no more), one near each shorter
    function's context (its last slots written and read: every function proven at its edge) and one
    near the context. A ``long_record`` above the context is refused, never clamped. ``red_records``
    says which of them each red arm runs on."""
    if long_record is not None and long_record > context:
        raise UsageError(f"long record of {long_record} tokens exceeds the backbone's context of {context}")
    out = {"one": 1, "chunk-1": chunk - 1, "chunk": chunk, "chunk+1": chunk + 1}
    if 3 * chunk - chunk // 2 < context:
        out["three-chunks"] = 3 * chunk - chunk // 2
    else:
        out["two-chunks"] = 2 * chunk - chunk // 2
    out.update({f"near-{c}": c - chunk + 1 for c in short_contexts})
    out["near-context"] = long_record or context - chunk + 1
    return {k: v for k, v in out.items() if 1 <= v <= context}


def red_records(lengths: dict[str, int], chunk: int, context: int) -> dict[str, str]:
    """The record each red arm runs on. ``state_reset`` needs a state carried across a chunk
    boundary: the multi-chunk record. ``positions_late`` shifts each call's whole position ramp by
    one, so its record's padded chunks must leave one position of the context free: the longest
    record that does (the same three-chunk record at any context over three chunks)."""
    from ..backbone.contract import chunks_for

    state = next((n for n in ("three-chunks", "two-chunks") if lengths.get(n, 0) > chunk), None)
    if state is None:
        raise UsageError(f"no record spans two chunks of {chunk} within the context: the state arm cannot run")
    room = [n for n, v in lengths.items() if chunks_for(v, chunk) * chunk < context]
    late = state if state in room else max(room, key=lambda n: (lengths[n], n))
    return {"state_reset": state, "positions_late": late}


def image_record(text, chunk: int, context: int, image_rows: int, source: Path, rng):
    """The gate's image record: a few text tokens, ``<|vision_start|>``-like text, an image of a
    non-square merged grid H x W (H < W) spanning a chunk boundary, text after it; the image's rows
    seeded, of the size of the release's embedding rows (the decoder's normal regime)."""
    from ..backbone.host import ImageSpan
    from ..engine.streamed_weights import as_f32, locate
    from ..backbone.contract import LM

    # two rows, as wide as a chunk: a row / column swap moves the h positions by up to W - 1 (at tiny
    # width one rotary frequency reads h: a square-ish grid hid the swap under the fp16 bar)
    h = 2 if image_rows >= 6 else 1
    w = max(h + 1, min(chunk, image_rows // h))
    n = h * w
    start = max(1, chunk // 2)
    length = min(start + n + 1 + chunk // 2, context)
    if start + n >= length:
        raise UsageError(f"the context of {context} cannot hold the gate's image record ({n} image tokens)")
    ids = rng.integers(0, text.vocab_size, size=length)
    t = locate(source, {f"{LM}embed_tokens.weight": (text.vocab_size, text.hidden_size)})[f"{LM}embed_tokens.weight"]
    with open(source / t.file, "rb") as fh:  # the first rows of the table: their spread sets the image rows'
        fh.seek(t.offset)
        rows = min(256, t.shape[0])
        sample = as_f32(np.frombuffer(fh.read(rows * t.shape[1] * (t.nbytes // (t.shape[0] * t.shape[1]))), np.uint8), t.dtype)
    scale = float(np.std(sample)) or 1.0
    span = ImageSpan(start=start, rows=(scale * rng.standard_normal((n, text.hidden_size))).astype(np.float32), grid=(h, w))
    return f"image-{h}x{w}", ids, span


def _compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    rel = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
    cos = (got * want).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1), 1e-30)
    return rel, float(cos.min())


def compression_of(m, text):
    """The manifest's scheme and the tensors it compressed (``quantize.compressed_names`` of its
    fp16 layers), checked against the count it states; ``(None, [])`` for fp16 weights."""
    from ..backbone.contract import weight_names
    from ..engine.quantize import Scheme
    from ..backbone.contract import compressed_names

    c = m.export.compression
    if m.export.weights == "fp16":
        return None, []
    if c is None or f"int{c.bits}" != m.export.weights:
        raise IntegrityError(f"{m.name}: weights {m.export.weights} but the manifest's compression section "
                             f"{'is missing' if c is None else 'says int' + str(c.bits)}")
    scheme = Scheme(c.bits, c.block)
    names = compressed_names(weight_names(text), scheme, c.fp16_layers)
    if len(names) != c.compressed_tensors:
        raise IntegrityError(f"{m.name}: the manifest says {c.compressed_tensors} tensors compressed; its scheme and "
                             f"fp16 layers give {len(names)}")
    return scheme, names


def _dequantized(mlirb: Path, found, scheme, name: str, red: str | None = None):
    """The asset's dequantized weight ``name`` read where its linear is called (``held_weights.OnUse``):
    one fp32 matrix in memory at a time, not a layer's (the same fp32 arithmetic); None where the
    asset does not compress it."""
    from ..backbone.held_weights import OnUse
    from ..engine.asset_readback import dequantized

    f = found.get(name)
    if f is None:
        return None

    def read():
        import torch

        return torch.from_numpy(dequantized(mlirb, f, scheme, red))

    def blocks():
        import numpy as np
        import torch

        from ..engine.weight_map import widened_blocks

        mapped = np.memmap(mlirb, dtype=np.uint8, mode="r")
        raw, scales = (mapped[b.start:b.start + b.size] for b in (f.codes, f.scales))
        if red == "scales_shifted":  # as ``dequantized`` shifts them: along each row, so rows stay rows
            scales = np.roll(scales.view(np.float16).reshape(scheme.scale_shape(tuple(f.shape))), 1, axis=1).view(np.uint8)
        for r0, r1, rows in widened_blocks("codes", raw, scales, tuple(f.shape), scheme, torch.float32):
            yield r0, r1, rows.mul_(2.0 ** -f.exponent) if f.exponent else rows

    # the codes read as the transposed matrix have no rows of their own: read whole
    return OnUse(read, None if red == "codes_transposed" else blocks)


def release_of(cfg, m, checks: list) -> tuple[Any, Path]:
    """The pins and the release folder a bundle's gate runs against: the manifest's source files must
    be the pins' (before any hashing or numeric work: exit 3, at once), then the release's files
    hashed against them unless the build's plan just did (``cfg.checked``)."""
    from ..sources.pinned_files import verify_files
    from ..sources.fetch import resolve_source
    from ..sources.pins import load_pins

    pins = cfg.pins or load_pins(cfg.pins_path)
    other = sorted(k for k in m.source.files if pins.files.get(k) != m.source.files[k])
    if other or m.source.hf_id != pins.hf_id:
        why = f"{other[0]} differs" if other else f"it names {m.source.hf_id}"
        raise IntegrityError(f"{cfg.bundle}: built from another release than {pins.label} ({why}); pass the release "
                             f"it was built from (--source, --pins)")
    source = resolve_source(cfg.source, pins)
    if cfg.checked is None or any(cfg.checked.get(n) != d for n, d in m.source.files.items()):
        verify_files(source, pins, cfg.pins_path, sorted(m.source.files))
    checks.append(("manifest source = release files", True, f"{plural(len(m.source.files), 'file')}, sha256 = pins"))
    return pins, source


def _records(cfg: BackboneVerifyConfig, m, text, source: Path):
    """The gate's token records (seeded), their images (``host.ImageSpan``), and which record each red arm runs on."""
    from ..backbone import host

    chunk, context = m.language.prefill_chunk, m.language.max_context
    lengths = record_lengths(chunk, context, cfg.long_record, [f.context for f in functions_of(m)[:-1]])
    rng = np.random.default_rng([cfg.seed, 19])
    records = {name: rng.integers(0, text.vocab_size, size=n) for name, n in lengths.items()}
    red_on = red_records(lengths, chunk, context) if cfg.red else {}
    images: dict[str, Any] = {}
    vision = m.interface.vision
    if vision is not None:  # a record with an image spanning a chunk boundary, and its red arms
        name, ids, span = image_record(text, chunk, context, vision.image_rows, source, rng)
        records[name], images[name] = ids, span
        if cfg.red:
            red_on.update({arm: name for arm in host.IMAGE_RED_ARMS})
    return records, images, red_on


def _references(cfg: BackboneVerifyConfig, asset: Path, source: Path, records, images, red_on, scheme, found):
    """The reference rows, one layer in memory at a time, gone before the runtime loads the asset.
    Compressed: (a) on the asset's own dequantized weights (read from main.mlirb), the bars; (b) the
    uncompressed release, reported; the red arms read the codes or scales wrongly (must fail (a)).
    Returns (arm -> (weights override, records), (arm, record) -> rows); ``red_on`` gains the quantization arms."""
    from ..backbone.contract import layer_of
    from ..backbone.reference import StreamedTextModel
    from ..progress import progress

    mlirb = asset / "main.mlirb"
    refs: dict[str, tuple] = {"main": (None, list(records))}
    if scheme is not None:
        refs = {"main": (lambda n: _dequantized(mlirb, found, scheme, n), list(records)),
                REPORTED: (None, list(records))}
        if cfg.red:
            state_record = red_on["state_reset"]
            # one tensor: the largest of the first compressed layer (a small one, in_proj_a, moves little)
            low = min(layer_of(n) for n in found)
            first = max((n for n in found if layer_of(n) == low), key=lambda n: (int(np.prod(found[n].shape)), n))
            refs["scales_shifted"] = (lambda n: _dequantized(mlirb, found, scheme, n, "scales_shifted"), [state_record])
            refs["codes_transposed"] = (lambda n, first=first: _dequantized(mlirb, found, scheme, n,
                                                                             "codes_transposed" if n == first else None),
                                        [state_record])
            red_on.update({arm: state_record for arm in QUANT_RED_ARMS})
    wants: dict[tuple[str, str], np.ndarray] = {}
    total = sum(len(names) for _, names in refs.values())
    with progress("gate: reference, transformers fp32", total, "records") as tick:
        for arm, (override, names) in refs.items():
            # linears' weights read where each is called (the release's 16 bits widened, or the
            # asset's dequantized matrix), not a whole layer in fp32: the gate's peak (docs/performance.md)
            ref = StreamedTextModel(source, weights=override, narrow=True)
            for name in names:
                wants[(arm, name)] = ref.rows(records[name], images.get(name))
                tick()
            del ref
    from ..engine.streamed_weights import trim_freed_memory

    trim_freed_memory()  # the reference's freed heap back to the kernel, not kept under the engine's run
    return refs, wants


def _record_inputs(m, text, records, images, name: str, arm: str = "main"):
    """What the host sends for one record: the ids (an image's tokens as V + k) and the image inputs
    (None for a text-only decoder), a host red arm applied where ``arm`` is one."""
    from ..backbone import host

    vision = m.interface.vision
    ids = host.image_ids(records[name], images[name], text.vocab_size) if name in images else records[name]
    if vision is None:
        return ids, None
    dtype = np.float32 if m.export.compute == "fp32" else np.float16
    return ids, host.image_inputs(vision.image_rows, text.hidden_size, dtype, images.get(name),
                                  arm if arm in host.IMAGE_RED_ARMS else None)


def _asset_runs(cfg: BackboneVerifyConfig, m, asset: Path, text, records, images, red_on):
    """The asset run chunk by chunk on every record, and on each red arm's: [(record, arm, rows, seconds)]."""
    from ..backbone import host
    from ..backbone.runtime import runner
    from ..progress import counting, progress

    compute = m.export.compute
    chunk, context = m.language.prefill_chunk, m.language.max_context
    state_dtype = "fp32" if compute == "fp32" else "fp16"
    plan = [(name, arm) for name in records
            for arm in ["main"] + [a for a in RED_ARMS + host.IMAGE_RED_ARMS if red_on.get(a) == name]]

    async def run_all():
        out = []
        calls = sum(host.chunks_for(len(records[name]), chunk) for name, _ in plan)
        # one record at a time: the slice's measured memory (a second record in flight would add
        # its states and activations) is worth more than the 10 % it would save at tiny width
        async with runner(asset, functions_of(m), text.state_shapes(context), state_dtype, chunk, cfg.scratch) as (call, new_states):
            with progress("gate: main, chunk by chunk", calls, "calls") as tick:
                counted = counting(call, tick)
                for name, arm in plan:
                    t0 = time.perf_counter()
                    ids, extra = _record_inputs(m, text, records, images, name, arm)
                    got = await host.run_record(counted, new_states, ids, chunk, text.pad_token_id,
                                                arm if arm in RED_ARMS else None, extra)
                    out.append((name, arm, got, time.perf_counter() - t0))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_async(run_all)


def _engine_runs(cfg: BackboneVerifyConfig, m, asset: Path, text, records, images, log,
                 said: list[str]) -> dict[str, tuple[np.ndarray, float]]:
    """The torch engine (``backbone.executor``) on every record: name -> (rows, seconds). Its weights are
    the ones the comparison above just found blob by blob, so their digests are not taken again."""
    from ..backbone.executor import open_torch_decoder
    from ..backbone.contract import chunks_for
    from ..progress import progress

    engine = open_torch_decoder(cfg.bundle, asset, m, cfg.device, check_blobs=False, log=log)
    said.append(f"torch engine: {engine.info.describe()}")
    out = {}
    layers = len(text.layer_types)
    with progress(f"gate: torch engine on {engine.info.device}", layers * len(records), "layers") as tick:
        for name in records:
            t0 = time.perf_counter()
            ids, extra = _record_inputs(m, text, records, images, name)
            out[name] = (engine.rows(ids, extra, progress=lambda _i: tick()), time.perf_counter() - t0)
            log(f"{name} ({plural(len(records[name]), 'token')}, {plural(chunks_for(len(records[name]), m.language.prefill_chunk), 'chunk')}): "
                f"torch engine {out[name][1]:.1f} s")
    return out


def _result(m, name: str, tokens: int, arm: str, got: np.ndarray, want: np.ndarray) -> RecordResult:
    from ..backbone.contract import chunks_for, fitting
    from ..backbone.host import record_slots

    chunk = m.language.prefill_chunk
    rel, cos = _compare(got, want)
    return RecordResult(name=name, tokens=tokens, calls=chunks_for(tokens, chunk), rel_max_abs_d=rel, min_row_cosine=cos, arm=arm,
                        function=fitting(functions_of(m), record_slots(tokens, chunk, arm), chunk).name)


def _log_result(log, r: RecordResult, secs: float | None = None) -> None:
    label = {"main": "", REPORTED: " vs the uncompressed release", ENGINE: " torch engine vs the runtime"}.get(r.arm, " red " + r.arm)
    where = "" if r.function == "main" else f", {r.function}"
    log(f"{r.name} ({plural(r.tokens, 'token')}{where}){label}: rel max |d| {r.rel_max_abs_d:.2e}, "
        f"min row cosine {r.min_row_cosine:.7f}" + (f" ({secs:.1f} s)" if secs is not None else ""))


def _numeric(cfg: BackboneVerifyConfig, m, asset: Path, text, source: Path, scheme, found, log,
             said: list[str]) -> list[RecordResult]:
    """The asset's rows against the reference's, record by record (and the red arms against the main run);
    then the torch engine's rows against the asset's (where the bundle has its weight map)."""
    chunk = m.language.prefill_chunk
    records, images, red_on = _records(cfg, m, text, source)
    refs, wants = _references(cfg, asset, source, records, images, red_on, scheme, found)
    results: list[RecordResult] = []
    runtime_rows: dict[str, np.ndarray] = {}
    for name, arm, got, secs in _asset_runs(cfg, m, asset, text, records, images, red_on):
        # the asset's main rows against every reference of this record; a host red arm against the main one
        against = [arm] if arm != "main" else [a for a, (_, names) in refs.items() if name in names]
        if arm == "main":
            runtime_rows[name] = got
        for ref_arm in against:
            r = _result(m, name, len(records[name]), ref_arm, got, wants[("main" if arm != "main" else ref_arm, name)])
            results.append(r)
            _log_result(log, r, secs if ref_arm == "main" or arm != "main" else None)
    if m.export.weight_map is not None:
        for name, (rows, secs) in _engine_runs(cfg, m, asset, text, records, images, log, said).items():
            r = _result(m, name, len(records[name]), ENGINE, rows, runtime_rows[name])
            results.append(r)
            _log_result(log, r)
    return results


def _engine_numeric(cfg: BackboneVerifyConfig, m, asset: Path, text, source: Path, scheme, found, log,
                    notes: list[str], said: list[str]) -> list[RecordResult]:
    """A decoder too large for the runtime's numeric check: ``ENGINE_RECORDS`` seeded records through
    the torch engine against the reference (compressed: on the asset's own dequantized weights, the
    bars; and the uncompressed release, reported), and one chunk of the first through the runtime
    against the engine (the spot check) where it is affordable (``spot_check``)."""
    from dataclasses import replace

    from ..backbone.contract import weight_names

    chunk, context = m.language.prefill_chunk, m.language.max_context
    tokens = min(ENGINE_TOKENS, context)
    rng = np.random.default_rng([cfg.seed, 61])
    records = {f"record-{k + 1}": rng.integers(0, text.vocab_size, size=tokens) for k in range(ENGINE_RECORDS)}
    _refs, wants = _references(replace(cfg, red=False), asset, source, records, {}, {}, scheme, found)
    results: list[RecordResult] = []
    engine_rows = _engine_runs(cfg, m, asset, text, records, {}, log, said)
    for (arm, name), want in wants.items():
        r = _result(m, name, tokens, arm, engine_rows[name][0], want)
        results.append(r)
        _log_result(log, r)
    params = sum(int(np.prod(shape)) for shape in weight_names(text).values())
    compute = m.export.compute
    cost = RUNTIME_SECONDS_PER_CHUNK_PER_B[compute] * params / 1e9
    spot = cfg.spot_check if cfg.spot_check is not None else compute == "fp32"
    said.append(f"numeric check through the torch engine: {params:,} parameters exceed numeric_max_parameters for the "
                f"runtime; the red arms run at the sizes the runtime checks")
    if not spot:
        notes.append(f"runtime spot check not run: one {chunk}-token chunk in {compute} compute on the Linux CPU runtime "
                     f"would take about {cost / 60:.0f} minutes here (verify --spot-check runs it)")
        return results
    first = next(iter(records))
    spot_records = {f"{first}, chunk 1": records[first][:chunk]}
    log(f"runtime spot check: one chunk through the Core AI runtime (about {cost / 60:.1f} minutes at this size)")
    for name, _arm, got, secs in _asset_runs(cfg, m, asset, text, spot_records, {}, {}):
        r = _result(m, name, len(spot_records[name]), ENGINE, engine_rows[first][0][:chunk], got)
        results.append(r)
        _log_result(log, r, secs)
    return results


def verify_backbone(cfg: BackboneVerifyConfig, log=lambda msg: None) -> BackboneReport:
    from ..backbone.contract import weight_names
    from ..backbone.source import release_config
    from ..engine.asset_readback import compare
    from ..engine.streamed_weights import locate
    from ..provenance import tool_versions

    t_start = time.perf_counter()
    # main.mlirb's sha256 is taken below: by the weight comparison's read where that runs on a model
    # too large for the numeric check (one read of 16 GB, not two), else by a read of its own first
    m, asset, checks = check_files(cfg.bundle, hashed=False)
    pins, source = release_of(cfg, m, checks)
    text = cfg.text or release_config(source)
    compute = m.export.compute
    infos = cfg.located or locate(source, weight_names(text))
    params = sum(int(np.prod(t.shape)) for t in infos.values())
    limit = cfg.numeric_max_parameters if cfg.numeric_max_parameters is not None else NUMERIC_MAX_PARAMETERS[compute]
    numeric = params <= limit
    scheme, compressed = compression_of(m, text)
    comparing = bool(cfg.weights or scheme is not None)  # compressed: the numeric gate reads the blobs this finds
    one_read = comparing and not numeric
    if not one_read:
        checks[:0] = check_asset(m, asset)
    try:
        # the runtime's own descriptor where it loads the asset anyway; else the bytecode's (no compiled copy)
        checks.extend(descriptor_checks(asset, m, compiled=numeric))
        if comparing:
            weights = cfg.weights_report or compare(asset / "main.mlirb", source, infos, scaled=compute == "fp32", log=log,
                                                    scheme=scheme, compressed=compressed, release=cfg.expected_digests,
                                                    written=cfg.written)
    except (IntegrityError, BytecodeError):
        if one_read:  # a main.mlirb that is not the manifest's is named as that, before what it broke
            check_asset(m, asset)
        raise
    if one_read:
        checks[:0] = check_asset(m, asset, digest=weights.file_sha256)
    notes: list[str] = []
    found, unreadable = None, False
    if comparing:
        checks.extend(weights.checks())
        found = weights.found
        unreadable = scheme is not None and not weights.ok
        if unreadable and numeric:
            numeric = False
            notes.append("numeric check not run: a compressed tensor's codes or scales are not in main.mlirb (above)")
    else:
        notes.append("the streamed weight comparison was not run")
    results: list[RecordResult] = []
    said: list[str] = []  # which engine computed the rows, and how (the transcript's "engines", the report's lines)
    by_engine = not numeric and not unreadable and m.export.weight_map is not None and comparing and weights.ok
    if by_engine:  # too large for the runtime's numeric check: through the torch engine, the runtime spot-checked
        results = _engine_numeric(cfg, m, asset, text, source, scheme, found, log, notes, said)
    elif not numeric and not unreadable:
        notes.append(f"numeric check not run: {params:,} parameters exceed numeric_max_parameters "
                     f"({limit:,}); fp{'16' if compute == 'fp16' else '32'} compute on the Linux CPU "
                     f"runtime is too slow at this size, and "
                     + ("the bundle has no weight map for the torch engine (build it again)" if m.export.weight_map is None
                        else "the weights were not all found for the torch engine"))
    elif numeric:
        results = _numeric(cfg, m, asset, text, source, scheme, found, log, said)
    transcript = {"bundle": str(cfg.bundle), "compute": compute, "weights": m.export.weights,
                  "source": {"hf_id": pins.hf_id, "revision": pins.revision},
                  "bars": tolerances(compute, m.export.weights), "seed": cfg.seed, "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
                  "records": [r.__dict__ for r in results],
                  "arms_run": [{"record": r.name, "arm": r.arm} for r in results],  # every arm, the red ones named
                  "notes": notes, "engines": said, "versions": tool_versions(),
                  "seconds": time.perf_counter() - t_start}
    owed = (RED_ARMS + (QUANT_RED_ARMS if scheme is not None else ())
            + (IMAGE_RED_ARMS if m.interface.vision is not None else ())) if cfg.red and not by_engine else ()
    report = BackboneReport(bundle=Path(cfg.bundle), compute=compute, results=results, checks=checks, transcript=transcript,
                            notes=notes, red_arms=owed, weights=m.export.weights, engines=said,
                            by_engine=by_engine, functions=tuple(f.name for f in functions_of(m)) if numeric else ())
    transcript["ok"], transcript["failures"] = report.ok, report.failures
    return report


# ---------------------------------------------------------------- the gate stage's entry (gate.MODELS)

KIND = "decision-backbone"
MODEL = "backbone"
OPTIONS = ("--red", "--seed", "--device", "--spot-check")  # --red: the backbone's red arms always run
FIXED_RECORDS = "runs fixed record lengths (1, S - 1, S, S + 1, three chunks, near the context)"


def manifest_of(bundle: Path):
    return check_files(bundle)[0]


def run(opts, manifest, pins_path: Path, log=lambda msg: None) -> BackboneReport:
    from ..devices import device_name

    device_name(opts.device or "auto")  # a device the machine lacks: exit 2 before any work
    return verify_backbone(BackboneVerifyConfig(bundle=opts.bundle, source=opts.source, pins_path=pins_path,
                                                seed=opts.seed, device=opts.device or "auto",
                                                spot_check=opts.spot_check), log=log)


def inspect(bundle: Path) -> dict[str, Any]:
    """The manifest and the descriptor the bytecode declares (no compiled copy: any size)."""
    from ..backbone.bundle import bytecode_descriptor
    from ..formats import aimodel

    m, asset, _ = check_files(bundle)
    d = bytecode_descriptor(asset)

    def io(fn: str) -> dict[str, list]:
        sig = d["signatures"].get(fn, {})
        return {kind: [{"name": n, "shape": s["shape"], "dtype": s["dtype"]} for n, s in sig.get(kind, {}).items()]
                for kind in ("inputs", "states", "outputs")}

    return {"name": m.name, "kind": m.kind, "format": aimodel.FORMAT, "weights": m.export.weights, "compute": m.export.compute,
            "asset_bytes": m.export.aimodel_bytes, "main_mlirb": m.export.main_mlirb.model_dump(),
            "source": {"hf_id": m.source.hf_id, "revision": m.source.revision},
            "language": {"prefill_chunk": m.language.prefill_chunk, "max_context": m.language.max_context,
                         "hidden_size": m.language.hidden_size, "vocab_size": m.language.vocab_size,
                         "layers": len(m.language.layer_types)},
            "functions": [{"name": f, **io(f)} for f in d["functions"]]}


def asset_facts(bundle: Path) -> tuple[str, str, str]:
    return asset_facts_of(check_files(bundle))


def schema(fmt: str | None = None) -> dict[str, Any]:
    from ..backbone.manifest import json_schema

    return core_ai_schema(fmt, "a backbone bundle", json_schema)
