"""The backbone's gate: a finished backbone bundle against the release it was built from.

1. the bundle's files against its manifest (``main.mlirb`` size and sha256, ``main.hash``, every
   tokenizer file), the release's files against the pins and the manifest's source;
2. the descriptor: one function ``main``, the inputs, states and output of the manifest's
   interface, names, shapes and dtypes, as the Core AI runtime reports it where the numeric check
   loads the asset, else as the bytecode declares it (no compiled copy: any size);
3. every 2-D+ weight in ``main.mlirb`` equal to the release's tensor in fp16, streamed
   (``asset_weights``: any size, a few MB of memory);
4. numeric (where the decoder is small enough for the Linux CPU runtime, ``numeric_max_parameters``):
   seeded token records of lengths 1, S - 1, S, S + 1, three chunks and one near the maximum
   context, through the saved asset and the host loop (``host.run_record``), against transformers'
   own text model of the release in fp32, one full forward per record;
5. red arms on a three-chunk record, which must fail the bar: the state not carried between chunks,
   every position one token late.

Every failure is collected; then the gate fails (exit 4). Bars are data with their reasons.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError, NumericError
from .contract import FUNCTION

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
# the numeric check runs on decoders up to this many parameters unless the recipe says otherwise: the
# Linux CPU runtime's fp16 arithmetic takes over 16 minutes a chunk at real width (the recipes' values)
NUMERIC_MAX_PARAMETERS = {"fp32": 2_000_000_000, "fp16": 50_000_000}


def tolerances(compute: str) -> dict[str, dict[str, Any]]:
    return {k: {"bar": v[0], "reason": v[1]} for k, v in TOLERANCES[compute].items()}


@dataclass(frozen=True)
class BackboneVerifyConfig:
    bundle: Path
    source: Path | None
    pins_path: Path
    seed: int = 0
    long_record: int | None = None
    numeric_max_parameters: int | None = None  # None: NUMERIC_MAX_PARAMETERS for the bundle's compute
    red: bool = True
    weights: bool = True  # every 2-D+ weight in main.mlirb against the release, streamed (asset_weights)
    scratch: Path | None = None  # where the runtime's compiled copy goes (build: the staged bundle, on the output's disk)


@dataclass
class RecordResult:
    name: str
    tokens: int
    calls: int
    rel_max_abs_d: float
    min_row_cosine: float
    arm: str = "main"


@dataclass
class BackboneReport:
    bundle: Path
    compute: str
    results: list[RecordResult]
    checks: list[tuple[str, bool, str]]
    transcript: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        out = [f"{n}: {d}" for n, ok, d in self.checks if not ok]
        bars = TOLERANCES[self.compute]
        for r in self.results:
            inside = r.rel_max_abs_d <= bars["rel_max_abs_d"][0] and r.min_row_cosine >= bars["min_row_cosine"][0]
            if r.arm == "main" and not inside:
                out.append(f"record {r.name} ({r.tokens} tokens): rel max |d| {r.rel_max_abs_d:.3g} (bar "
                           f"{bars['rel_max_abs_d'][0]:g}), min row cosine {r.min_row_cosine:.6f} (bar {bars['min_row_cosine'][0]:g})")
            if r.arm != "main" and inside:
                out.append(f"red arm {r.arm} on record {r.name}: rel max |d| {r.rel_max_abs_d:.3g} passes the bar "
                           f"(the gate cannot see it)")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> dict[str, Any]:
        main = [r for r in self.results if r.arm == "main"]
        return {"ok": self.ok, "compute": self.compute,
                "records": {r.name: {"tokens": r.tokens, "calls": r.calls, "rel_max_abs_d": r.rel_max_abs_d,
                                     "min_row_cosine": r.min_row_cosine} for r in main},
                "red": {r.arm: r.rel_max_abs_d for r in self.results if r.arm != "main"},
                "bars": {k: v[0] for k, v in TOLERANCES[self.compute].items()},
                "checks": {n: ok for n, ok, _ in self.checks}, "failures": self.failures, "notes": self.notes}

    def raise_for_failures(self) -> None:
        if self.failures:
            raise NumericError(f"{self.bundle}: verification failed: {self.failures[0]}"
                               + (f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""))


def record_lengths(chunk: int, context: int, long_record: int | None) -> dict[str, int]:
    """1, S - 1, S, S + 1, three chunks, and one near the context (all within the context)."""
    longest = min(long_record or context - chunk + 1, context)
    out = {"one": 1, "chunk-1": chunk - 1, "chunk": chunk, "chunk+1": chunk + 1, "three-chunks": 3 * chunk - chunk // 2,
           "near-context": longest}
    return {k: v for k, v in out.items() if 1 <= v <= context}


def check_files(bundle: Path):
    """The manifest, its asset and tokenizer files; ``IntegrityError`` naming the first broken file."""
    from ..layout import MANIFEST_FILE
    from ..manifest import check_file
    from .manifest import BackboneManifest

    path = Path(bundle) / MANIFEST_FILE
    try:
        m = BackboneManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except ValueError as exc:
        raise IntegrityError(f"{path}: not a backbone manifest ({str(exc).splitlines()[0]})") from None
    asset = Path(bundle) / m.assets["main"]
    digest = check_file(asset / "main.mlirb", m.export.main_mlirb)
    if not (asset / "main.hash").is_file() or (asset / "main.hash").read_bytes().hex() != digest:
        raise IntegrityError(f"{asset / 'main.hash'}: does not hold the sha256 of main.mlirb")
    from ..digest import sha256_file
    from .release import TOKENIZER_DIR

    for name, want in m.tokenizer.items():
        f = Path(bundle) / TOKENIZER_DIR / name
        if not f.is_file() or sha256_file(f) != want:
            raise IntegrityError(f"{f}: missing or its sha256 differs from the manifest's")
    checks = [("main.mlirb sha256 = manifest", True, digest[:16]), ("main.hash = sha256(main.mlirb)", True, "ok"),
              ("tokenizer files = manifest", True, f"{len(m.tokenizer)} files")]
    return m, asset, checks


_DTYPES = {"Float32": "fp32", "Float16": "fp16", "Int32": "int32"}


def bytecode_descriptor(asset: Path) -> dict[str, Any]:
    """Functions, inputs, states and outputs as the asset's bytecode declares them, read without
    compiling it: the runtime's load writes a compiled fp32 copy of the weights first (about 32 GB
    for a 9B), and coreai's ``AIModelAsset.summary`` reads the whole file into memory (16 GB), so it
    reads a skeleton of ``main.mlirb`` (``mlirb.skeleton``: every blob's data left out, a few KB)."""
    import shutil
    import tempfile

    from coreai.authoring.asset import AIModelAsset

    from ..mlirb import skeleton

    with tempfile.TemporaryDirectory(prefix="clef-descriptor-") as tmp:
        copy = Path(tmp) / Path(asset).name
        copy.mkdir()
        shutil.copy2(Path(asset) / "metadata.json", copy / "metadata.json")
        skeleton(Path(asset) / "main.mlirb", copy / "main.mlirb")
        s = AIModelAsset.load(copy).summary(include_statistics=False)
        functions = list(s.function_names)
        raw = {kind: list(read(FUNCTION)) for kind, read in (("inputs", s.function_inputs), ("states", s.function_states),
                                                             ("outputs", s.function_outputs))} if FUNCTION in functions else {}

    def spec(text: str) -> dict[str, Any]:  # "NDArray (Float32, 1 × 64 × 4096)", "NDArray (Int32, 1 × ?)"
        got = re.fullmatch(r"NDArray \((\w+), (.*)\)", text.strip())
        if not got:
            return {"shape": [], "dtype": text}
        dims = [-1 if d.strip() == "?" else int(d) for d in got.group(2).split("×")]
        return {"shape": dims, "dtype": _DTYPES.get(got.group(1), got.group(1))}

    return {"functions": functions, **{kind: {n: spec(t) for n, t in pairs} for kind, pairs in raw.items()}}


def descriptor_checks(asset: Path, m, compiled: bool = True) -> list[tuple[str, bool, str]]:
    """The manifest's interface against the runtime's descriptor (``compiled``) or the bytecode's."""
    from .runtime import describe

    d = describe(asset) if compiled else bytecode_descriptor(asset)
    where = "runtime" if compiled else "bytecode"
    out = [(f"functions = [main] ({where})", d["functions"] == [m.interface.function], str(d["functions"]))]
    if "inputs" not in d:
        return out

    def same(kind: str, got: dict[str, Any], want: dict[str, Any]) -> None:
        for name, spec in want.items():
            g = got.get(name)
            shape = [-1 if isinstance(x, str) else x for x in spec.shape]
            ok = g is not None and g["shape"] == shape and spec.dtype in g["dtype"].replace("float", "fp").replace("int32", "int32")
            out.append((f"{kind} {name} {shape} {spec.dtype}", ok, "ok" if ok else f"the {where} says {g}"))
        extra = sorted(set(got) - set(want))
        out.append((f"no other {kind}", not extra, "ok" if not extra else ", ".join(extra)))

    same("input", d["inputs"], m.interface.inputs)
    same("state", d["states"], m.interface.states)
    same("output", d["outputs"], m.interface.outputs)
    return out


def _compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    rel = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
    cos = (got * want).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1), 1e-30)
    return rel, float(cos.min())


def verify_backbone(cfg: BackboneVerifyConfig, log=lambda msg: None) -> BackboneReport:
    from ..pins import load_pins
    from ..provenance import tool_versions
    from ..source import resolve_source
    from . import host
    from ..progress import counting, progress
    from .asset_weights import compare
    from .reference import StreamedTextModel
    from .contract import weight_names
    from .release import release_config, verify_files
    from .runtime import runner
    from .weights import locate

    t_start = time.perf_counter()
    m, asset, checks = check_files(cfg.bundle)
    pins = load_pins(cfg.pins_path)
    source = resolve_source(cfg.source, pins)
    verify_files(source, pins, cfg.pins_path, sorted(m.source.files))
    same = m.source.files == {k: pins.files[k] for k in m.source.files} and m.source.hf_id == pins.hf_id
    checks.append(("manifest source = release files", same, "ok" if same else f"the manifest names {m.source.hf_id}, "
                   f"the pins {pins.hf_id}, or other file digests"))
    text = release_config(source)
    compute = m.export.compute
    chunk, context = m.language.prefill_chunk, m.language.max_context
    infos = locate(source, weight_names(text))
    params = sum(int(np.prod(t.shape)) for t in infos.values())
    limit = cfg.numeric_max_parameters if cfg.numeric_max_parameters is not None else NUMERIC_MAX_PARAMETERS[compute]
    numeric = params <= limit
    # the runtime's own descriptor where it loads the asset anyway; else the bytecode's (no compiled copy)
    checks.extend(descriptor_checks(asset, m, compiled=numeric))
    notes: list[str] = []
    if cfg.weights:
        weights = compare(asset / "main.mlirb", source, infos, scaled=compute == "fp32", log=log)
        checks.extend(weights.checks())
    else:
        notes.append("the streamed weight comparison was not run")
    results: list[RecordResult] = []
    if not numeric:
        notes.append(f"numeric check not run: {params:,} parameters exceed numeric_max_parameters "
                     f"({limit:,}); fp{'16' if compute == 'fp16' else '32'} compute on the Linux CPU "
                     f"runtime is too slow at this size")
    else:
        lengths = record_lengths(chunk, context, cfg.long_record)
        rng = np.random.default_rng([cfg.seed, 19])
        records = {name: rng.integers(0, text.vocab_size, size=n) for name, n in lengths.items()}
        # the reference first, one layer in memory at a time, and gone before the runtime loads the asset
        with progress("gate: reference, transformers fp32", len(records), "records") as tick:
            ref = StreamedTextModel(source)
            wants = {}
            for name, ids in records.items():
                wants[name] = ref.rows(ids)
                tick()
        del ref
        gc.collect()
        state_dtype = "fp32" if compute == "fp32" else "fp16"

        plan = [(name, arm) for name in records
                for arm in ["main"] + (list(RED_ARMS) if cfg.red and name == "three-chunks" else [])]

        async def run_all():
            out = []
            calls = sum(host.chunks_for(len(records[name]), chunk) for name, _ in plan)
            async with runner(asset, text.state_shapes(context), state_dtype, cfg.scratch) as (call, new_states):
                with progress("gate: main, chunk by chunk", calls, "calls") as tick:
                    counted = counting(call, tick)
                    for name, arm in plan:
                        t0 = time.perf_counter()
                        got = await host.run_record(counted, new_states, records[name], chunk, context,
                                                    text.pad_token_id, None if arm == "main" else arm)
                        out.append((name, arm, got, time.perf_counter() - t0))
            return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = asyncio.run(run_all())
        for name, arm, got, secs in runs:
            rel, cos = _compare(got, wants[name])
            results.append(RecordResult(name=name, tokens=len(records[name]), calls=host.chunks_for(len(records[name]), chunk),
                                        rel_max_abs_d=rel, min_row_cosine=cos, arm=arm))
            log(f"{name} ({len(records[name])} tokens){'' if arm == 'main' else ' red ' + arm}: rel max |d| {rel:.2e}, "
                f"min row cosine {cos:.7f} ({secs:.1f} s)")
    transcript = {"bundle": str(cfg.bundle), "compute": compute, "source": {"hf_id": pins.hf_id, "revision": pins.revision},
                  "bars": tolerances(compute), "seed": cfg.seed, "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
                  "records": [r.__dict__ for r in results], "notes": notes, "versions": tool_versions(),
                  "seconds": time.perf_counter() - t_start}
    report = BackboneReport(bundle=Path(cfg.bundle), compute=compute, results=results, checks=checks, transcript=transcript,
                            notes=notes)
    transcript["ok"], transcript["failures"] = report.ok, report.failures
    return report
