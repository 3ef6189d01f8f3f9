"""The gate: run a finished bundle against the author's head.

How it works: docs/modules.md."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError
from ..report import GateConfig, Report as BaseReport, Row
from ..head.host import head_inputs, question_probs
from ..manifest import pads
from ..head.records import LEXICAL_VOCAB, Record, author_logits, load_recorded, random_records
from ..interrupts import gather_all, run_async
from ..progress import plural

TOLERANCES: dict[str, tuple[float, str]] = {
    "max_abs_dp": (1e-5, "per-question fp32 softmax; the publisher measured 1.8e-7 on its GPU, and fp16 storage "
                         "of bf16 weights is exact in fp16's normal range, so only fp32 rounding order differs"),
    "max_abs_dlogit": (1e-4, "logits before the softmax; fp32 accumulation order over 4096-wide rows and "
                             "T-long spans, same bar as the publisher's graph-vs-author gate"),
    "argmax": (0.0, "the answer itself: every question's argmax must agree (0 disagreements), except a near-tie: "
                    "the reference's top two options closer than the max |d p| bar, where the order is within "
                    "the bar's own noise (reported with its margin, not a failure)"),
    "padding_logit": (0.0, "padding options are exactly 0, so a host can never pick one up"),
    "rerun": (0.0, "a second run of the first record reproduces it bit for bit"),
}
RED_ARMS = ("spans_late", "lexical_zero", "member_rotated")


@dataclass(frozen=True)
class VerifyConfig(GateConfig):
    records: int = 4
    seed: int = 0
    red: bool = False
    recorded: Path | None = None
    functions: tuple[str, ...] | None = None
    pins: Any = None  # the build's plan: pins already loaded
    checked: dict[str, str] | None = None  # the build's plan: file -> sha256 already checked in this process


@dataclass
class FunctionResult:
    function: str
    bucket: int
    records: int = 0
    max_abs_dlogit: float = 0.0
    max_abs_dp: float = 0.0
    questions: int = 0
    argmax_agree: int = 0
    near_ties: list[dict[str, Any]] = field(default_factory=list)  # argmax differs within the bar's noise
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
        disagree = self.questions - self.argmax_agree - len(self.near_ties)
        if disagree:
            out.append(f"{self.function}: argmax differs on {disagree}/{plural(self.questions, 'question')} (beyond near-ties)")
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
class Report(BaseReport):
    results: list[FunctionResult] = field(default_factory=list)

    def result_failures(self) -> list[str]:
        return [f for r in self.results for f in r.failures()]

    def columns(self) -> list[str]:
        return ["function", "shape", "records", "max |d logit|", "max |d p|", "argmax", "padding 0", "re-run"]

    def rows(self) -> list[Row]:
        out = []
        for r in self.results:
            verdict = "FAIL" if not r.ok else ("near-tie" if r.near_ties else "pass")
            ties = f" ({len(r.near_ties)} near-tie{'s' if len(r.near_ties) != 1 else ''})" if r.near_ties else ""
            out.append(([r.function, f"T={r.bucket}", str(r.records), f"{r.max_abs_dlogit:.2e}", f"{r.max_abs_dp:.2e}",
                         f"{r.argmax_agree}/{r.questions}{ties}",
                         "yes" if r.padding_max_abs == 0 else f"{r.padding_max_abs:.1e}",
                         "identical" if r.rerun_identical else "differs"], verdict))
        return out

    def lines(self) -> list[str]:
        out = []
        for r in self.results:
            for t in r.near_ties:
                out.append(f"near-tie {r.function} record {t['record']} question {t['question']}: reference top-two "
                           f"margin {t['margin']:.2e} < bar {TOLERANCES['max_abs_dp'][0]:g}")
            if r.red:
                out.append(f"red arms {r.function}: " + ", ".join(f"{k} moved p by {v:.3g}" for k, v in r.red.items()))
        return out

    def bars(self) -> dict[str, float]:
        return {k: v[0] for k, v in TOLERANCES.items()}

    def headline(self) -> str:
        if not any(r.records for r in self.results):
            return f"{sum(ok for _, ok, _ in self.checks)}/{plural(len(self.checks), 'check')} of the saved asset passed"
        ties = sum(len(r.near_ties) for r in self.results)
        return (f"max |d p| {max(r.max_abs_dp for r in self.results):.2e}, max |d logit| "
                f"{max(r.max_abs_dlogit for r in self.results):.2e}" + (f", {ties} near-tie{'s' if ties != 1 else ''}" if ties else ""))

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records_per_function": {r.function: r.records for r in self.results},
            "max_abs_dp": {r.function: r.max_abs_dp for r in self.results},
            "max_abs_dlogit": {r.function: r.max_abs_dlogit for r in self.results},
            "argmax": {r.function: f"{r.argmax_agree}/{r.questions}" for r in self.results},
            "near_ties": {r.function: r.near_ties for r in self.results if r.near_ties},
            "bars": self.bars(),
            "failures": self.failures,
            "checks": {name: ok for name, ok, _ in self.checks},
            "notes": self.notes,
        }


# ---------------------------------------------------------------- the gate


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


def argmax_verdicts(p_got: list[np.ndarray], p_ref: list[np.ndarray], bar: float) -> tuple[int, list[dict[str, Any]]]:
    """Questions whose argmax agrees, and the near-ties: a disagreement where the reference's top
    two options are closer than ``bar`` (the gate's own |d p| bar), so their order is within the
    noise the bar allows. A disagreement with a wider margin is neither: it fails the gate."""
    agree, ties = 0, []
    for q_i, (got, ref) in enumerate(zip(p_got, p_ref, strict=True)):
        if int(np.argmax(got)) == int(np.argmax(ref)):
            agree += 1
            continue
        top = np.sort(ref)[::-1]
        margin = float(top[0] - top[1]) if len(top) > 1 else float("inf")
        if margin < bar:
            ties.append({"question": q_i, "margin": margin, "reference_argmax": int(np.argmax(ref)),
                         "asset_argmax": int(np.argmax(got))})
    return agree, ties


def _max_dp(pa: list[np.ndarray], pb: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(pa, pb, strict=True))


@dataclass
class _Planned:
    """The gate's calls, planned, and the author's logits for each record, taken before the runtime runs."""

    funcs: list[tuple[str, int]]
    jobs: list[tuple[str, int, str, Any]]  # (function, record, arm, (record, HostInputs))
    refs: dict[tuple[str, int], Any]
    ref_seconds: dict[str, float]


def _plan_gate(cfg: VerifyConfig, manifest: Any, module, head, records_for) -> _Planned:
    """Every record of every function, and the author's head's logits on each: before the runtime
    loads the functions, so the two never peak together (at the 9B's width: 1.87 GB together, the
    head build's peak; docs/performance.md)."""
    import torch

    hidden_size = head.hidden_norm.normalized_shape[0]
    table_np = np.random.default_rng([cfg.seed, 7]).standard_normal((LEXICAL_VOCAB, hidden_size), dtype=np.float32)
    table = torch.from_numpy(table_np)
    funcs = [(name, b) for name, b in manifest.head.buckets if cfg.functions is None or name in cfg.functions]
    q_pad, o_pad = pads(manifest.head)  # the bundle's own pads, not the published ones
    jobs: list[tuple[str, int, str, Any]] = []
    for idx, (name, bucket) in enumerate(funcs):
        lower = funcs[idx - 1][1] if idx > 0 else 0
        for r_i, rec in enumerate(records_for(bucket, lower, hidden_size, q_pad, o_pad)):
            hi = head_inputs(rec.hidden, rec.ids, rec.questions, table_np, bucket, q_pad=q_pad, o_pad=o_pad,
                             buckets=tuple(b for _, b in manifest.head.buckets))
            jobs.append((name, r_i, "main", (rec, hi)))
            if r_i == 0:
                jobs.append((name, r_i, "rerun", (rec, hi)))
                if cfg.red:
                    jobs.extend((name, r_i, arm, (rec, hi)) for arm in RED_ARMS)
    refs, ref_seconds = {}, {}
    for name, r_i, arm, (rec, _) in jobs:
        if arm == "main":
            t0 = time.perf_counter()
            refs[(name, r_i)] = author_logits(module, head, rec, table)
            ref_seconds[name] = ref_seconds.get(name, 0.0) + time.perf_counter() - t0
    return _Planned(funcs, jobs, refs, ref_seconds)


async def _run_gate(cfg: VerifyConfig, asset: Path, planned: _Planned, log, runner):
    """Every planned call through ``runner``, each record's rows against the author's logits."""
    import torch

    from ..progress import counting, progress

    funcs, jobs, refs, ref_seconds = planned.funcs, planned.jobs, planned.refs, planned.ref_seconds
    async with runner(asset, [name for name, _ in funcs]) as call:
        with progress(f"gate: {', '.join(n for n, _ in funcs)}", len(jobs), "asset calls") as tick:
            counted = counting(call, tick)
            outs = await gather_all(*[
                counted(name, hi.arrays if arm in ("main", "rerun") else red_arrays(hi.arrays, arm))
                for name, _, arm, (_, hi) in jobs
            ])  # the progress line says how many calls and how long: no second line for it

    results: list[FunctionResult] = []
    by_key = {(name, r_i, arm): out for (name, r_i, arm, _), out in zip(jobs, outs, strict=True)}
    for name, bucket in funcs:
        res = FunctionResult(function=name, bucket=bucket)
        t0 = time.perf_counter()
        for fname, r_i, arm, (rec, hi) in jobs:
            if fname != name or arm != "main":
                continue
            got = by_key[(name, r_i, "main")]
            ref = refs[(name, r_i)]
            ref_flat = np.concatenate(ref)
            p_got = question_probs(got, hi.layout)
            p_ref = [torch.from_numpy(x).softmax(-1).numpy() for x in ref]
            dlogit = float(np.abs(got[: hi.options] - ref_flat).max())
            dp = _max_dp(p_got, p_ref)
            agree, ties = argmax_verdicts(p_got, p_ref, TOLERANCES["max_abs_dp"][0])
            res.near_ties.extend({"record": r_i, **tie} for tie in ties)
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
        res.seconds = time.perf_counter() - t0 + ref_seconds.get(name, 0.0)
        log(f"{name}: {plural(res.records, 'record')}, max |d p| {res.max_abs_dp:.2e}, max |d logit| {res.max_abs_dlogit:.2e}")
        results.append(res)
    return results


def verify_bundle(cfg: VerifyConfig, log=lambda msg: None) -> Report:
    """The bundle against its manifest, the source against its pins, the backend's read-back
    checks, then every function against the author's head (where this machine can run it)."""
    import torch

    from .artifact import check_bundle
    from ..sources.author import load_head
    from ..digest import tree_hash
    from ..sources.pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, load_pins
    from ..provenance import tool_versions
    from ..sources.fetch import HEAD_FILES, require_verified, resolve_source

    t_start = time.perf_counter()
    manifest, fmt, asset, checks = check_bundle(cfg.bundle)
    pins = cfg.pins or load_pins(cfg.pins_path)
    src = manifest.head.source
    same = (src.hf_id == pins.hf_id and src.revision == pins.revision
            and src.joint_schema_model_sha256 == pins.files[CODE_FILE]
            and src.joint_head_safetensors_sha256 == pins.files[WEIGHTS_FILE]
            and src.joint_head_config_sha256 == pins.files[CONFIG_FILE])
    if not same:  # before any file is hashed or loaded: the pair can never agree (exit 3, at once)
        raise IntegrityError(f"{cfg.bundle}: built from {src.hf_id}@{(src.revision or 'local')[:12]} (weights "
                             f"{src.joint_head_safetensors_sha256[:12]}…), not from {pins.label} (weights "
                             f"{pins.files[WEIGHTS_FILE][:12]}…); pass the release it was built from (--source, --pins)")
    source = resolve_source(cfg.source, pins)
    if cfg.checked is None or any(cfg.checked.get(n) != pins.files.get(n) for n in HEAD_FILES):
        require_verified(source, pins)  # the build's plan checked them in this process: not hashed twice
    checks.append(("source files = pins", True, f"{plural(len(pins.files), 'file')}"))
    checks.append(("manifest source = files loaded", True, "ok"))

    why_not = fmt.cannot_run()
    # the author's head computes in fp32 where the asset's outputs are compared; where only its
    # stored weights can be, it is loaded as they are stored (bf16 -> fp16 rounds once either way)
    dtype = torch.float16 if why_not and manifest.head.weights == "fp16w32" else torch.float32
    module, config, head = load_head(source, pins, dtype)
    recorded = load_recorded(cfg.recorded) if cfg.recorded else None
    params = {k: v.numpy() for k, v in head.state_dict().items()}
    extra = fmt.read_back(asset, manifest, config.hidden_size, params)
    if extra:
        log("read the asset back: functions, inputs, outputs, weights")
    checks.extend(extra)
    del params
    if dtype == torch.float32:
        from ..backbone.held_weights import hold_narrow

        # its linears in the release's 16 bits, widened at each call: the same fp32 arithmetic, and
        # 0.24 GB less beside the runtime's functions at the 9B's head (docs/performance.md)
        hold_narrow(head)
    notes = [f"outputs not compared: {why_not}"] if why_not else []

    def records_for(bucket: int, lower: int, hidden_size: int, q_pad: int, o_pad: int) -> list[Record]:
        if recorded is not None:
            return [r for r in recorded if lower < len(r.ids) <= bucket]
        return random_records(cfg.records, bucket, lower, hidden_size, LEXICAL_VOCAB, cfg.seed, q_pad, o_pad)

    results: list[FunctionResult] = []
    if not why_not:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planned = _plan_gate(cfg, manifest, module, head, records_for)
        del head  # past its logits: its memory not under the runtime's functions
        from ..engine.streamed_weights import trim_freed_memory

        trim_freed_memory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = run_async(lambda: _run_gate(cfg, asset, planned, log, fmt.runner))
    transcript = {
        "bundle": str(cfg.bundle),
        "bundle_tree_sha256": tree_hash(cfg.bundle),
        "format": fmt.FORMAT,
        "asset_sha256": fmt.asset_digest(manifest),
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
    report = Report(bundle=Path(cfg.bundle), checks=checks, transcript=transcript, notes=notes, results=results)
    transcript["ok"] = report.ok
    transcript["failures"] = report.failures
    return report


# ---------------------------------------------------------------- the gate stage's entry (gate.MODELS)

KIND = "decision-head"
MODEL = "head"
OPTIONS = ("--records", "--recorded", "--red", "--seed")
FIXED_RECORDS = ""


def manifest_of(bundle: Path):
    from .artifact import check_bundle

    return check_bundle(bundle)[0]


def source_of(manifest) -> tuple[str, str | None]:
    return manifest.head.source.hf_id, manifest.head.source.revision


def run(opts, manifest, pins_path: Path, log=lambda msg: None) -> Report:
    return verify_bundle(VerifyConfig(bundle=opts.bundle, source=opts.source, pins_path=pins_path,
                                      records=opts.records or 4, seed=opts.seed, red=opts.red,
                                      recorded=opts.recorded), log=log)


def inspect(bundle: Path) -> dict[str, Any]:
    from .artifact import inspect_bundle

    return inspect_bundle(bundle)


def asset_facts(bundle: Path) -> tuple[str, str, str]:
    """The bundle's asset checked against its manifest: (name, format, asset sha256)."""
    from .artifact import check_bundle

    manifest, fmt, _asset, _checks = check_bundle(bundle)
    return manifest.name, fmt.FORMAT, fmt.asset_digest(manifest)


def schema(fmt: str | None = None) -> dict[str, Any]:
    """The JSON Schema of a head bundle's ``metadata.json`` in format ``fmt`` (default: Core AI)."""
    from ..head.backends import DEFAULT_FORMAT, json_schema

    return json_schema(fmt or DEFAULT_FORMAT)
