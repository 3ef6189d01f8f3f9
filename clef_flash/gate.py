"""Stage 5: the gate. Run a finished bundle with the Core AI runtime against the author's head.

1. the bundle against its manifest (bytes, sha256, ``main.hash``), the source against its pins,
   and the manifest's source hashes against the files loaded;
2. the author's ``JointSchemaHead`` (verified module, strict load, fp32, CPU) and the asset;
3. seeded random records per function (or recorded ``.npz`` records) through both;
4. a checklist per function; every failure is collected, then the gate fails (exit 4).

Bars are data with a one-line reason each (``TOLERANCES``) and are written into the transcript.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import contract
from .bundle import tree_hash
from .errors import IntegrityError, NumericError
from .host import Question, head_inputs, question_probs
from .manifest import AnyManifest, MainMlirb, MlpackageManifest, load_manifest, manifest_format
from .pins import sha256_file

TOLERANCES: dict[str, tuple[float, str]] = {
    "max_abs_dp": (1e-5, "per-question fp32 softmax; the publisher measured 1.8e-7 on its GPU, and fp16 storage "
                         "of bf16 weights is exact in fp16's normal range, so only fp32 rounding order differs"),
    "max_abs_dlogit": (1e-4, "logits before the softmax; fp32 accumulation order over 4096-wide rows and "
                             "T-long spans, same bar as the publisher's graph-vs-author gate"),
    "argmax": (0.0, "the answer itself: every question's argmax must agree (0 disagreements)"),
    "padding_logit": (0.0, "padding options are exactly 0, so a host can never pick one up"),
    "rerun": (0.0, "a second run of the first record reproduces it bit for bit"),
}
RED_ARMS = ("spans_late", "lexical_zero", "member_rotated")
LEXICAL_VOCAB = 1024


@dataclass(frozen=True)
class VerifyConfig:
    bundle: Path
    source: Path | None
    pins_path: Path
    records: int = 4
    seed: int = 0
    red: bool = False
    recorded: Path | None = None
    functions: tuple[str, ...] | None = None


@dataclass
class FunctionResult:
    function: str
    bucket: int
    records: int = 0
    max_abs_dlogit: float = 0.0
    max_abs_dp: float = 0.0
    questions: int = 0
    argmax_agree: int = 0
    padding_max_abs: float = 0.0
    rerun_identical: bool = True
    red: dict[str, float] = field(default_factory=dict)
    per_record: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def failures(self) -> list[str]:
        out = []
        if self.max_abs_dp > TOLERANCES["max_abs_dp"][0]:
            out.append(f"{self.function}: max |d p| {self.max_abs_dp:.3g} > {TOLERANCES['max_abs_dp'][0]:g}")
        if self.max_abs_dlogit > TOLERANCES["max_abs_dlogit"][0]:
            out.append(f"{self.function}: max |d logit| {self.max_abs_dlogit:.3g} > {TOLERANCES['max_abs_dlogit'][0]:g}")
        if self.argmax_agree != self.questions:
            out.append(f"{self.function}: argmax differs on {self.questions - self.argmax_agree}/{self.questions} questions")
        if self.padding_max_abs != 0.0:
            out.append(f"{self.function}: padding logits not exactly 0 (max |x| {self.padding_max_abs:.3g})")
        if not self.rerun_identical:
            out.append(f"{self.function}: re-run of the first record is not bit-identical")
        for arm, moved in self.red.items():
            if not moved > TOLERANCES["max_abs_dp"][0]:
                out.append(f"{self.function}: red arm {arm} moved p by only {moved:.3g} (the gate cannot see it)")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()


@dataclass
class Report:
    bundle: Path
    results: list[FunctionResult]
    checks: list[tuple[str, bool, str]]
    transcript: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # what was not run here, and why

    @property
    def failures(self) -> list[str]:
        out = [f"{name}: {detail}" for name, ok, detail in self.checks if not ok]
        for r in self.results:
            out.extend(r.failures())
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records_per_function": {r.function: r.records for r in self.results},
            "max_abs_dp": {r.function: r.max_abs_dp for r in self.results},
            "max_abs_dlogit": {r.function: r.max_abs_dlogit for r in self.results},
            "argmax": {r.function: f"{r.argmax_agree}/{r.questions}" for r in self.results},
            "bars": {k: v[0] for k, v in TOLERANCES.items()},
            "failures": self.failures,
            "checks": {name: ok for name, ok, _ in self.checks},
            "notes": self.notes,
        }

    def raise_for_failures(self) -> None:
        if self.failures:
            raise NumericError(f"{self.bundle}: verification failed: {self.failures[0]}"
                               + (f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""))


# ---------------------------------------------------------------- bundle checks


def check_bundle(bundle: Path) -> tuple[AnyManifest, Path, list[tuple[str, bool, str]]]:
    """The bundle against its manifest; raises ``IntegrityError`` naming the first broken file."""
    bundle = Path(bundle)
    meta = bundle / "metadata.json"
    try:
        manifest = load_manifest(meta.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{meta}: missing") from None
    except ValueError as exc:
        raise IntegrityError(f"{meta}: not a valid manifest ({str(exc).splitlines()[0]})") from None
    asset = bundle / manifest.assets["main"]
    if isinstance(manifest, MlpackageManifest):
        from .coreml import MODEL_FILE, WEIGHT_FILE

        checks = []
        for rel, want in ((MODEL_FILE, manifest.export.model), (WEIGHT_FILE, manifest.export.weight_bin)):
            digest = _check_file(asset / rel, want)
            checks.append((f"{Path(rel).name} sha256 = manifest", True, digest[:16]))
        return manifest, asset, checks
    mlirb = asset / "main.mlirb"
    hash_file = asset / "main.hash"
    digest = _check_file(mlirb, manifest.export.main_mlirb)
    checks = [("main.mlirb sha256 = manifest", True, digest[:16])]
    try:
        stored = hash_file.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{hash_file}: missing") from None
    if stored.hex() != digest:
        raise IntegrityError(f"{hash_file}: does not hold the sha256 of main.mlirb")
    checks.append(("main.hash = sha256(main.mlirb)", True, "ok"))
    return manifest, asset, checks


def _check_file(path: Path, want: MainMlirb) -> str:
    """A file against the bytes and sha256 its manifest gives; returns the digest."""
    if not path.is_file():
        raise IntegrityError(f"{path}: missing")
    size = path.stat().st_size
    if size != want.bytes:
        raise IntegrityError(f"{path}: {size} bytes, the manifest says {want.bytes}")
    digest = sha256_file(path)
    if digest != want.sha256:
        raise IntegrityError(f"{path}: sha256 {digest[:12]}… differs from the manifest's {want.sha256[:12]}…")
    return digest


def asset_digest(manifest: AnyManifest) -> str:
    """The digest that names the asset: main.mlirb's, or weight.bin's for a Core ML package."""
    if isinstance(manifest, MlpackageManifest):
        return manifest.export.weight_bin.sha256
    return manifest.export.main_mlirb.sha256


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Record:
    hidden: np.ndarray  # [L, H] f32
    ids: np.ndarray  # [L] int64
    questions: tuple[Question, ...]


def random_records(n: int, bucket: int, lower: int, hidden_size: int, vocab: int, seed: int,
                   q_pad: int = contract.Q_PAD, o_pad: int = contract.O_PAD) -> list[Record]:
    """Seeded records for one bucket covering the edges: T at the bucket's lower and upper edge,
    1 and ``q_pad`` questions, 2 and ``o_pad`` options, every type, spans touching 0 and T."""
    rng = np.random.default_rng([seed, bucket])
    records = []
    for i in range(n):
        if i == 0:
            length, nq, total = bucket, q_pad, o_pad
        elif i == 1:
            length, nq, total = lower + 1, 1, 2
        else:
            length = int(rng.integers(lower + 1, bucket + 1))
            nq = int(rng.integers(1, q_pad + 1))
            total = int(rng.integers(2 * nq, o_pad + 1)) if 2 * nq <= o_pad else 2 * nq
        # option counts: at least 2 each, summing to total
        counts = np.full(nq, 2)
        for _ in range(total - 2 * nq):
            counts[rng.integers(0, nq)] += 1
        span_max = max(1, min(12, length // 4))

        def span(length: int = length, span_max: int = span_max) -> tuple[int, int]:
            s = int(rng.integers(0, length))
            e = min(length, s + int(rng.integers(1, span_max + 1)))
            return (s, e)

        questions = []
        for q in range(nq):
            qs = (0, min(length, span_max)) if q == 0 else span()
            opts = [span() for _ in range(int(counts[q]))]
            if q == nq - 1:
                opts[-1] = (length - 1, length)  # a span at T's upper edge
            questions.append(Question(
                question_type=int(q % 3 if i < 2 else rng.integers(0, 3)),
                question_span=qs,
                option_spans=tuple(opts),
                option_ids=tuple(str(k) for k in range(len(opts))),
                question_id=f"q{q}",
            ))
        hidden = rng.standard_normal((length, hidden_size), dtype=np.float32)
        ids = rng.integers(0, vocab, size=length)
        records.append(Record(hidden=hidden, ids=ids, questions=tuple(questions)))
    return records


def load_recorded(path: Path) -> list[Record]:
    """Recorded records: an ``.npz`` with ``hidden_<i>``, ``ids_<i>`` and ``questions_<i>`` (JSON)."""
    data = np.load(path, allow_pickle=False)
    records = []
    i = 0
    while f"hidden_{i}" in data:
        qs = json.loads(str(data[f"questions_{i}"]))
        records.append(Record(
            hidden=np.asarray(data[f"hidden_{i}"], np.float32),
            ids=np.asarray(data[f"ids_{i}"], np.int64),
            questions=tuple(Question(
                question_type=int(q["type"]), question_span=tuple(q["question_span"]),
                option_spans=tuple(tuple(s) for s in q["option_spans"]),
                option_ids=tuple(q.get("option_ids") or [str(k) for k in range(len(q["option_spans"]))]),
                question_id=str(q.get("id", f"q{j}")),
            ) for j, q in enumerate(qs)),
        ))
        i += 1
    if not records:
        raise IntegrityError(f"{path}: no records (expected hidden_0, ids_0, questions_0)")
    return records


# ---------------------------------------------------------------- the gate


def author_logits(module, head, record: Record, table) -> list[np.ndarray]:
    import torch

    qs = tuple(
        module.EncodedQuestion(question_id=q.question_id, question_type=q.question_type,
                               question_span=tuple(q.question_span), option_spans=tuple(q.option_spans),
                               option_ids=tuple(q.option_ids))
        for q in record.questions
    )
    rec = module.EncodedRecord(input_ids=tuple(int(x) for x in record.ids), questions=qs, record_id="gate")
    length = len(record.ids)
    with torch.inference_mode():
        out = head(torch.from_numpy(record.hidden)[None], torch.from_numpy(record.ids)[None],
                   torch.ones(1, length, dtype=torch.long), [rec], table)[0]
    return [o.float().numpy() for o in out]


def red_arrays(arrays: dict[str, np.ndarray], arm: str) -> dict[str, np.ndarray]:
    """A perturbed copy of the host arrays the gate must be able to see."""
    a = {k: v.copy() for k, v in arrays.items()}
    if arm == "spans_late":  # question and option spans one token late
        a["q_avg"] = np.roll(a["q_avg"], 1, axis=1)
        a["o_avg"] = np.roll(a["o_avg"], 1, axis=1)
    elif arm == "lexical_zero":
        a["lexical"][:] = 0.0
    elif arm == "member_rotated":  # each option attributed to the next question
        a["member"] = np.roll(a["member"], 1, axis=0)
        real_q = int(arrays["q_valid"].sum())
        if real_q == 1:  # one question: rotate options within the question instead
            n = int(arrays["o_valid"].sum())
            a["o_avg"][:n] = np.roll(a["o_avg"][:n], 1, axis=0)
            a["lexical"][:n] = np.roll(a["lexical"][:n], 1, axis=0)
        else:
            a["member"] = np.zeros_like(a["member"])
            a["member"][:real_q] = np.roll(arrays["member"][:real_q], 1, axis=0)
    else:
        raise ValueError(arm)
    return a


def _max_dp(pa: list[np.ndarray], pb: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(pa, pb, strict=True))


@contextlib.asynccontextmanager
async def coreai_runner(asset: Path, names: list[str]):
    """``call(function, arrays) -> logits`` through the Core AI runtime. All calls of all functions
    go through one bounded queue: the CPU runtime runs a call on about one core."""
    import os

    from coreai.authoring.asset import AIModelAsset
    from coreai.runtime import NDArray

    slots = asyncio.Semaphore(max(1, min(4, os.cpu_count() or 1)))
    async with AIModelAsset.load(asset).executable() as model:
        fns = {}
        for name in names:
            fn = model.load_function(name)
            if fn is None:
                raise IntegrityError(f"{asset}: function {name} not found")
            fns[name] = fn

        async def call(name: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
            async with slots:
                out = await fns[name]({k: NDArray(np.ascontiguousarray(v)) for k, v in arrays.items()})
                return np.array(out["logits"].numpy(), dtype=np.float32, copy=True)

        yield call


@contextlib.asynccontextmanager
async def coreml_runner(asset: Path, names: list[str]):
    """``call(function, arrays) -> logits`` through Core ML (macOS; one call at a time)."""
    from . import coreml

    fns = {name: coreml.predictor(asset, name) for name in names}

    async def call(name: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.array(fns[name](arrays), dtype=np.float32, copy=True)

    yield call


async def _run_gate(cfg: VerifyConfig, manifest: AnyManifest, asset: Path, module, head, records_for, log, runner):
    """Every record of every function through ``runner`` and through the author's head."""
    import torch

    hidden_size = head.hidden_norm.normalized_shape[0]
    table_np = np.random.default_rng([cfg.seed, 7]).standard_normal((LEXICAL_VOCAB, hidden_size), dtype=np.float32)
    table = torch.from_numpy(table_np)
    funcs = [(name, b) for name, b in manifest.head.buckets if cfg.functions is None or name in cfg.functions]
    async with runner(asset, [name for name, _ in funcs]) as call:
        jobs: list[tuple[str, int, str, Any]] = []  # (function, record, arm, HostInputs)
        for idx, (name, bucket) in enumerate(funcs):
            lower = funcs[idx - 1][1] if idx > 0 else 0
            for r_i, rec in enumerate(records_for(bucket, lower, hidden_size)):
                hi = head_inputs(rec.hidden, rec.ids, rec.questions, table_np, bucket)
                jobs.append((name, r_i, "main", (rec, hi)))
                if r_i == 0:
                    jobs.append((name, r_i, "rerun", (rec, hi)))
                    if cfg.red:
                        jobs.extend((name, r_i, arm, (rec, hi)) for arm in RED_ARMS)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[
            call(name, hi.arrays if arm in ("main", "rerun") else red_arrays(hi.arrays, arm))
            for name, _, arm, (_, hi) in jobs
        ])
        log(f"{len(jobs)} asset calls in {time.perf_counter() - t0:.1f} s")

    results: list[FunctionResult] = []
    by_key = {(name, r_i, arm): out for (name, r_i, arm, _), out in zip(jobs, outs, strict=True)}
    for name, bucket in funcs:
        res = FunctionResult(function=name, bucket=bucket)
        t0 = time.perf_counter()
        for fname, r_i, arm, (rec, hi) in jobs:
            if fname != name or arm != "main":
                continue
            got = by_key[(name, r_i, "main")]
            ref = author_logits(module, head, rec, table)
            ref_flat = np.concatenate(ref)
            p_got = question_probs(got, hi.layout)
            p_ref = [torch.from_numpy(x).softmax(-1).numpy() for x in ref]
            dlogit = float(np.abs(got[: hi.options] - ref_flat).max())
            dp = _max_dp(p_got, p_ref)
            agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(p_got, p_ref, strict=True))
            pad = float(np.abs(got[hi.options :]).max()) if hi.options < len(got) else 0.0
            res.records += 1
            res.questions += len(p_ref)
            res.argmax_agree += agree
            res.max_abs_dlogit = max(res.max_abs_dlogit, dlogit)
            res.max_abs_dp = max(res.max_abs_dp, dp)
            res.padding_max_abs = max(res.padding_max_abs, pad)
            entry = {"record": r_i, "T": hi.length, "questions": len(p_ref), "options": hi.options,
                     "max_abs_dlogit": dlogit, "max_abs_dp": dp, "argmax_agree": agree, "padding_max_abs": pad}
            if r_i == 0:
                again = by_key[(name, r_i, "rerun")]
                res.rerun_identical = bool(np.array_equal(again.view(np.uint32), got.view(np.uint32)))
                entry["rerun_identical"] = res.rerun_identical
                if cfg.red:
                    res.red = {arm: _max_dp(question_probs(by_key[(name, r_i, arm)], hi.layout), p_ref) for arm in RED_ARMS}
                    entry["red"] = dict(res.red)
            res.per_record.append(entry)
        res.seconds = time.perf_counter() - t0
        log(f"{name}: {res.records} records, max |d p| {res.max_abs_dp:.2e}, max |d logit| {res.max_abs_dlogit:.2e}")
        results.append(res)
    return results


def verify_bundle(cfg: VerifyConfig, log=lambda msg: None) -> Report:
    import torch

    from .author import load_head
    from .export import tool_versions
    from .pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, load_pins
    from .source import require_verified, resolve_source

    t_start = time.perf_counter()
    manifest, asset, checks = check_bundle(cfg.bundle)
    pins = load_pins(cfg.pins_path)
    source = resolve_source(cfg.source, pins)
    require_verified(source, pins)
    checks.append(("source files = pins", True, f"{len(pins.files)} files"))
    src = manifest.head.source
    same = (src.hf_id == pins.hf_id and src.revision == pins.revision
            and src.joint_schema_model_sha256 == pins.files[CODE_FILE]
            and src.joint_head_safetensors_sha256 == pins.files[WEIGHTS_FILE]
            and src.joint_head_config_sha256 == pins.files[CONFIG_FILE])
    checks.append(("manifest source = files loaded", same,
                   "ok" if same else f"manifest names {src.hf_id}@{src.revision[:12]}, weights {src.joint_head_safetensors_sha256[:12]}…"
                                     f"; loaded {pins.hf_id}@{pins.revision[:12]}, weights {pins.files[WEIGHTS_FILE][:12]}…"))

    module, config, head = load_head(source, pins, torch.float32)
    recorded = load_recorded(cfg.recorded) if cfg.recorded else None
    notes: list[str] = []
    runner = coreai_runner
    if isinstance(manifest, MlpackageManifest):
        from . import coreml

        log("reading the package back: functions, inputs, outputs, weights")
        params = {k: v.numpy() for k, v in head.state_dict().items()}
        checks.extend(coreml.check_package(coreml.read_package(asset), manifest.head.buckets, config.hidden_size,
                                           manifest.head.weights, params))
        runner = coreml_runner
        if not coreml.can_predict():
            notes.append(f"outputs not compared: {coreml.PREDICTIONS_NOTE}")

    def records_for(bucket: int, lower: int, hidden_size: int) -> list[Record]:
        if recorded is not None:
            return [r for r in recorded if lower < len(r.ids) <= bucket]
        return random_records(cfg.records, bucket, lower, hidden_size, LEXICAL_VOCAB, cfg.seed)

    results: list[FunctionResult] = []
    if not notes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = asyncio.run(_run_gate(cfg, manifest, asset, module, head, records_for, log, runner))
    transcript = {
        "bundle": str(cfg.bundle),
        "bundle_tree_sha256": tree_hash(cfg.bundle),
        "format": manifest_format(manifest),
        "asset_sha256": asset_digest(manifest),
        "source": {"hf_id": pins.hf_id, "revision": pins.revision, "synthetic": pins.synthetic},
        "bars": {k: {"bar": v[0], "reason": v[1]} for k, v in TOLERANCES.items()},
        "seed": cfg.seed,
        "records_per_function": cfg.records if recorded is None else "recorded",
        "red": cfg.red,
        "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "functions": [r.__dict__ for r in results],
        "notes": notes,
        "versions": tool_versions(),
        "seconds": time.perf_counter() - t_start,
    }
    report = Report(bundle=Path(cfg.bundle), results=results, checks=checks, transcript=transcript, notes=notes)
    transcript["ok"] = report.ok
    transcript["failures"] = report.failures
    return report
