"""``plan-weights``: which decoder layers a compressed backbone keeps fp16, chosen for the release's
own weights (``backbone.plan.WeightPlan``, a file a recipe names with ``plan = "..."``).

How it works: docs/modules.md."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import IntegrityError, UsageError
from ..devices import device_name, pick_device
from ..progress import plural


@dataclass(frozen=True)
class PlanConfig:
    release: Path
    recipe: object  # recipe.BackboneRecipe with compressed weights
    recipe_path: Path
    pins_path: Path
    out: Path
    requests: Path | None = None
    budget_dp: float | None = None  # None: the recipe's plan_budget_dp
    records: int | None = None  # at most this many calibration records (default: every request)
    overwrite: bool = False
    checked: dict[str, str] | None = None  # file -> sha256 the caller (a build's plan) just checked against the pins
    device: str = "auto"  # auto | cpu | cuda | mps: where the plan's arithmetic runs (fp32, TF32 off)
    exhaustive: bool = False  # rank by one end-to-end pass per layer (the oracle) instead of the one-pass estimate
    estimate: str = "auto"  # auto: each record's per-layer changes the cheaper way (estimate.measured_alone); first-order: every record carried back


class RowTable:
    """``lm_head.weight`` rows read from the shard when the head indexes them (a mapping: page
    cache), fp32: what the author's head reads as ``output_embedding_weight[token_ids]``."""

    def __init__(self, folder: Path, t, device="cpu") -> None:
        from ..engine.streamed_weights import as_f32

        self._as_f32 = as_f32
        self.t = t
        self.device = device
        self.table = np.memmap(Path(folder) / t.file, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))

    def __getitem__(self, ids):
        import torch

        idx = np.asarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids, dtype=np.int64).reshape(-1)
        rows = self.table.reshape(self.t.shape[0], -1)[idx]
        return torch.from_numpy(self._as_f32(np.ascontiguousarray(rows).reshape(-1), self.t.dtype).reshape(len(idx), -1)).to(self.device)


def _budget(cfg: PlanConfig) -> float:
    """Every option refused before any work; the budget (the recipe's unless given)."""
    recipe = cfg.recipe
    if getattr(recipe, "model", None) != "backbone" or recipe.scheme is None:
        raise UsageError(f"{cfg.recipe_path}: plan-weights takes a compressed backbone recipe (weights = \"int8\" or "
                         f"\"int4\"), e.g. conversion/backbone_pf64_int8.toml")
    out = Path(cfg.out)
    if out.is_dir():
        raise UsageError(f"{out}: is a folder; --out names the plan file to write")
    if out.exists() and not cfg.overwrite:
        raise UsageError(f"{out}: exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: folder not found for --out")
    budget = cfg.budget_dp if cfg.budget_dp is not None else recipe.plan_budget_dp
    if not 0 < budget <= 1:
        raise UsageError(f"--budget-dp must be in (0, 1], got {budget}")
    if cfg.records is not None and cfg.records < 1:
        raise UsageError("--records must be >= 1")
    if cfg.estimate not in ("auto", "first-order"):
        raise UsageError(f"--estimate must be auto or first-order, got {cfg.estimate!r}")
    device_name(cfg.device)
    if not Path(cfg.release).is_dir():
        raise UsageError(f"{cfg.release}: release folder not found")
    return budget


@dataclass
class Calibration:
    """The calibration records (the requests encoded by the author's ``encode_record`` with the
    release's tokenizer) and the release's head (the author's ``JointSchemaHead``, fp32) on them."""

    encoded: list
    records: list[np.ndarray]
    head: object
    table: RowTable
    device: str

    def logits(self, r: int, rows):
        """Record ``r``'s per-question logits from its final rows (``[1, T, H]`` on the device)."""
        import torch

        from ..backbone.estimate import one_thread

        ids = torch.from_numpy(self.records[r])[None].to(self.device)
        with one_thread():
            return self.head(rows, ids, torch.ones_like(ids), [self.encoded[r]], self.table)[0]

    @contextmanager
    def parked(self, outputs):
        """The head's weights out of memory for the block, in a file of ``outputs``
        (``sensitivity.LayerOutputs``; 0.32 GB at the real head: the reverse sweep calls the head
        only for its first gradients, and its peak is the carry-back's), read back after: the same
        tensors, dtypes and values."""
        import torch

        from ..engine.streamed_weights import trim_freed_memory

        kept = self.head.state_dict()
        path = outputs.keep("head.pt", kept)
        self.head.load_state_dict({n: torch.empty_like(t, device="meta") for n, t in kept.items()}, assign=True)
        del kept
        trim_freed_memory()
        try:
            yield
        finally:
            self.head.load_state_dict(torch.load(path, map_location=self.device, weights_only=True), assign=True)
            path.unlink()

    def probs(self, rows: list[np.ndarray], which: list[int] | None = None) -> list[np.ndarray]:
        """Every option's probability, per record (the questions' in order, concatenated): ``rows``
        are every record's, or those of the records numbered ``which``."""
        import torch

        out = []
        with torch.inference_mode():
            for r, h in zip(range(len(rows)) if which is None else which, rows, strict=True):
                logits = self.logits(r, torch.from_numpy(np.ascontiguousarray(h))[None].to(self.device))
                out.append(np.concatenate([q.float().softmax(-1).cpu().numpy() for q in logits]))
        return out

    def question_probs(self, r: int, rows) -> list:
        """Record ``r``'s every option's probability, a 1-D tensor a question (in order), from its
        final rows, with grad: what the budget's max |dp| is taken over."""
        return [q.float().softmax(-1) for q in self.logits(r, rows)]


def _calibration(cfg: PlanConfig, source: Path, pins, requests, text, device: str) -> Calibration:
    import torch

    from ..backbone.held_weights import hold_narrow
    from ..engine.streamed_weights import locate
    from ..sources.author import load_head
    from ..sources.reference import TextProcessor, import_reference

    recipe = cfg.recipe
    import_reference()
    from transformers import AutoTokenizer

    module, _config, head = load_head(source, pins, torch.float32)  # the author's file: its pin checked first
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{source}: cannot load the tokenizer ({str(exc).splitlines()[0][:200]})") from None
    processor = TextProcessor(tokenizer=tokenizer)
    encoded = [module.encode_record(tokenizer, r.body, processor=processor) for r in requests]
    limit = cfg.records if cfg.records is not None else recipe.plan_records
    if limit is not None:
        encoded = encoded[:limit]
    records = [np.asarray(e.input_ids, dtype=np.int64) for e in encoded]
    lm = locate(source, {"lm_head.weight": (text.vocab_size, text.hidden_size)}).get("lm_head.weight")
    for p in head.parameters():
        p.requires_grad_(False)
    head = head.to(device)
    hold_narrow(head)  # its linears' weights in the release's 16 bits, widened on use: the same fp32 arithmetic
    return Calibration(encoded, records, head, RowTable(source, lm, device), device)


def _smallest_k(ranking: list[int], trial, trials: list) -> int:
    """The smallest k with ``ranking[:k]`` kept fp16 whose trial meets the budget: k = 0, then bisection."""
    if trial([]).passes:
        return 0
    lo, hi = 0, len(ranking)  # lo misses; hi (every layer fp16) is the reference itself
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(ranking[:mid]).passes:
            hi = mid
        else:
            lo = mid
    if hi == len(ranking) and not any(t.passes and len(t.fp16_layers) == hi for t in trials):
        trial(ranking[:hi])
    return hi


def _first_order_k(ranking: list[int], estimated, trial) -> int:
    """The smallest k whose ``ranking[:k]`` kept fp16 the first-order estimate puts within the
    budget, then measured: escalate (one more layer of the ranking, measured again) while the trial
    misses; where the first trial meets, walk down while the next smaller set meets too. The result
    is a k whose set meets the budget measured and whose k - 1 set misses it measured (or k = 0)."""
    n = len(ranking)
    k = next((k for k in range(n + 1) if estimated(ranking[:k])), n)
    if trial(ranking[:k]).passes:
        while k > 0 and trial(ranking[:k - 1]).passes:
            k -= 1
        return k
    while k < n:  # escalation: the estimate was too kind
        k += 1
        if trial(ranking[:k]).passes:
            return k
    return n


def kendall_tau(a: list[int], b: list[int]) -> float:
    """Kendall's tau between two rankings of the same layers (1: the same order; -1: reversed):
    pairs in the same order less pairs reversed, over all pairs (no ties: each is a permutation)."""
    pos = {x: i for i, x in enumerate(b)}
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    return sum(1 if pos[a[i]] < pos[a[j]] else -1 for i, j in pairs) / len(pairs)


def _layer_bytes(infos, scheme, compressed: list[str], layers: int) -> dict[int, tuple[int, int]]:
    """Each decoder layer's weight bytes: (compressed as the scheme would, all fp16)."""
    from ..backbone.contract import layer_of
    from ..engine.streamed_weights import asset_bytes

    out = {}
    for i in range(layers):
        mine = {n: t for n, t in infos.items() if layer_of(n) == i}
        out[i] = (asset_bytes(mine, scheme, [n for n in compressed if layer_of(n) == i]), asset_bytes(mine))
    return out


@dataclass(frozen=True)
class _Inputs:
    """What the plan reads before any arithmetic: the checked release, its layers, the calibration."""

    requests_path: Path
    pins: object
    files: dict[str, str]
    text: object
    wanted: dict
    infos: dict
    scheme: object
    scaled: bool
    compressed: list[str]
    device: Device
    cal: Calibration


def _inputs(cfg: PlanConfig, log) -> _Inputs:
    from ..backbone.contract import compressed_names, weight_names
    from ..backbone.source import release_config
    from ..engine.streamed_weights import locate
    from ..sources.pinned_files import read_files, verify_files
    from ..sources.pins import load_pins
    from ..sources.requests import default_requests, load_requests

    source = Path(cfg.release)
    requests_path = Path(cfg.requests) if cfg.requests else default_requests()
    requests = load_requests(requests_path)
    pins = load_pins(cfg.pins_path)
    names = read_files(source)
    if cfg.checked is not None and all(n in cfg.checked for n in names):
        files = {n: cfg.checked[n] for n in names}  # a build's plan hashed them against the pins already
    else:
        files = verify_files(source, pins, cfg.pins_path, names, log)
    text = release_config(source)
    wanted = weight_names(text)
    infos = locate(source, wanted)
    scheme = cfg.recipe.scheme
    device = pick_device(cfg.device, 4 * sum(int(np.prod(t.shape)) for t in infos.values()))
    return _Inputs(requests_path, pins, files, text, wanted, infos, scheme, cfg.recipe.compute == "fp32",
                   compressed_names(wanted, scheme, ()), device,
                   _calibration(cfg, source, pins, requests, text, device.torch_device))


class _Trials:
    """End-to-end measurements of sets of layers compressed, against the uncompressed pass: each
    set measured once (the walk down and the proof can meet one)."""

    def __init__(self, ref, cal: Calibration, outputs, deq, base, budget: float, with_codes: list[int], log) -> None:
        self.ref, self.cal, self.outputs, self.deq, self.base = ref, cal, outputs, deq, base
        self.budget, self.with_codes, self.log = budget, with_codes, log
        self.estimates: dict = {}  # the layers' estimates, once made (each trial's estimate beside its measurement)
        self.done: list = []  # the Trials recorded in the plan

    def changes(self, squeezed: set[int], which: list[int], tick=lambda: None) -> list[np.ndarray]:
        """Records ``which``' signed change of every option with ``squeezed`` compressed, end to end."""
        from ..backbone.sensitivity import rows_with

        rows = rows_with(self.ref, self.cal.records, self.deq, squeezed, tick, self.outputs, which=which)
        return [p - self.base[r] for r, p in zip(which, self.cal.probs(rows, which), strict=True)]

    def dp_with(self, squeezed: set[int], tick=lambda: None) -> tuple[float, float]:
        """max and mean |dp| over every option of every record with ``squeezed`` compressed."""
        if not squeezed:
            return 0.0, 0.0
        dp = np.abs(np.concatenate(self.changes(squeezed, list(range(len(self.base))), tick)))
        return (float(dp.max()), float(dp.mean())) if dp.size else (0.0, 0.0)

    def alone(self, layers: list[int], which: list[int], tick=lambda: None) -> dict[int, dict[int, np.ndarray]]:
        """Records ``which``' changes with each of ``layers`` alone compressed: record -> layer -> changes."""
        out: dict[int, dict[int, np.ndarray]] = {r: {} for r in which}
        for i in layers:
            for r, c in zip(which, self.changes({i}, which, tick), strict=True):
                out[r][i] = c
        return out

    def __call__(self, kept: list[int], record: bool = True):
        from ..backbone.estimate import set_estimate
        from ..backbone.plan import Trial

        done = next((t for t in self.done if t.fp16_layers == sorted(kept)), None)
        if done is not None:
            return done
        squeezed = set(self.with_codes) - set(kept)
        top, mean = self.dp_with(squeezed)
        t = Trial(fp16_layers=sorted(kept), max_abs_dp=top, mean_abs_dp=mean, passes=top <= self.budget,
                  estimated_max_abs_dp=set_estimate(self.estimates, squeezed))
        if record:
            self.done.append(t)
        self.log(f"trial: fp16 layers {sorted(kept) or 'none'}: max |dp| {top:.4g} (estimated {t.estimated_max_abs_dp:.3g}), "
                 f"mean {mean:.3g} -> {'meets' if t.passes else 'misses'} {self.budget:g}")
        return t


@dataclass(frozen=True)
class _Search:
    """The ranking and what the trials found along it."""

    estimates: dict
    measured_alone: list[int]  # the records measured end to end, not carried back
    fast: list[int]  # the one-pass estimate's ranking
    ranking: list[int]  # the ranking searched (the estimate's, or the oracle's with --exhaustive)
    alone: dict[int, float]
    trials: list
    chosen: list[int]
    met: bool
    proof: object
    seconds: dict[str, float]


def _search(cfg: PlanConfig, inp: _Inputs, budget: float, log) -> _Search:
    from ..backbone.contract import layer_of
    from ..backbone.estimate import LayerCalls, forward_pass, measured_alone, reverse_sweep, set_estimate
    from ..backbone.reference import StreamedTextModel
    from ..backbone.sensitivity import Dequantizer, LayerOutputs
    from ..progress import progress

    text, cal, records, layers = inp.text, inp.cal, inp.cal.records, len(inp.text.layer_types)
    ref = StreamedTextModel(Path(cfg.release), device=inp.device.torch_device, hold=inp.device.hold, narrow=True)
    with LayerOutputs() as outputs:
        t0 = time.perf_counter()
        calls = LayerCalls(ref, list(text.layer_types))
        with progress("plan: the uncompressed pass", len(records), "records") as tick:
            base = cal.probs(forward_pass(ref, records, outputs, calls, tick))
        t_forward, t0 = time.perf_counter() - t0, time.perf_counter()
        with_codes = sorted({layer_of(n) for n in inp.compressed})
        deq = Dequantizer(Path(cfg.release), inp.infos, inp.scheme, inp.compressed, inp.scaled)
        trial = _Trials(ref, cal, outputs, deq, base, budget, with_codes, log)
        alone_records = [] if cfg.estimate == "first-order" else measured_alone([len(b) for b in base], layers, with_codes)
        if alone_records:
            log(f"plan: {plural(len(alone_records), 'record')} of {len(records)} measured end to end, layer by layer "
                f"(cheaper there than carrying {'its' if len(alone_records) == 1 else 'their'} options back through {layers - 1} layers)")
        # the oracle (--exhaustive) measures every record so; the sweep takes the ones it needs from it
        to_measure = list(range(len(records))) if cfg.exhaustive else alone_records
        measured: dict[int, dict[int, np.ndarray]] = {}
        if to_measure:
            with progress("plan: each layer alone compressed, end to end", len(with_codes) * len(to_measure), "records") as tick:
                measured = trial.alone(with_codes, to_measure, tick)
        t_measured, t0 = time.perf_counter() - t0, time.perf_counter()
        with progress("plan: each layer's own error and first-order effect, last to first", layers, "layers") as back:
            sweep = reverse_sweep(ref, records, cal.question_probs, inp.infos, inp.scheme, inp.compressed, inp.scaled,
                                      outputs, calls, list(text.layer_types), back, {r: measured[r] for r in alone_records},
                                      parked=lambda: cal.parked(outputs))
        t_reverse, t0 = time.perf_counter() - t0, time.perf_counter()
        estimates = trial.estimates = sweep.estimates
        fast = sorted(with_codes, key=lambda i: (-estimates[i].estimated_dp, -estimates[i].rel_max_abs_d, i))
        alone: dict[int, float] = {}
        if cfg.exhaustive:  # the oracle: each layer alone compressed, its worst change over every record
            alone = {i: float(np.abs(np.concatenate([measured[r][i] for r in to_measure])).max(initial=0.0)) for i in with_codes}
            ranking = sorted(with_codes, key=lambda i: (-alone[i], -estimates[i].rel_max_abs_d, i))
        else:
            ranking = fast
        for i in ranking:
            e = estimates[i]
            log(f"layer {i} ({text.layer_types[i]}): " + (f"alone max |dp| {alone[i]:.3g}; " if i in alone else "")
                + f"estimated max |dp| {e.estimated_dp:.3g}" + (f" (Fisher {e.fisher:.3g})" if e.fisher is not None else "")
                + "; its own output rel max |d| "
                f"{e.rel_max_abs_d:.3g}, rel rms {e.rel_rms_d:.3g}")
        t0 = time.perf_counter()
        if cfg.exhaustive:
            k = _smallest_k(ranking, trial, trial.done)
        else:
            k = _first_order_k(ranking, lambda kept: set_estimate(estimates, set(with_codes) - set(kept)) <= budget, trial)
        chosen = sorted(ranking[:k])
        met = any(t.passes and t.fp16_layers == chosen for t in trial.done)
        proof = None
        if k >= 1:  # the proof: without its most sensitive layer the chosen set must miss the budget
            proof = next((t for t in trial.done if t.fp16_layers == sorted(ranking[1:k])), None) or trial(ranking[1:k], record=False)
        t_trials = time.perf_counter() - t0
    return _Search(estimates, alone_records, fast, ranking, alone, trial.done, chosen, met, proof,
                   {"forward": round(t_forward, 3), "measured": round(t_measured, 3), "reverse": round(t_reverse, 3),
                    "reverse_head": round(sweep.head_s, 3), "reverse_own": round(sweep.own_s, 3),
                    "reverse_carry": round(sweep.carry_s, 3), "trials": round(t_trials, 3)})


def plan_weights(cfg: PlanConfig, log=lambda m: None):
    from ..backbone.contract import compressed_names
    from ..backbone.plan import PLAN_VERSION, LayerSensitivity, PlanScheme, WeightPlan
    from ..bundle import atomic_write_json
    from ..digest import sha256_file
    from ..engine.streamed_weights import asset_bytes, freed_memory_given_back

    t_start = time.perf_counter()
    freed_memory_given_back()
    recipe, budget = cfg.recipe, _budget(cfg)
    inp = _inputs(cfg, log)
    text, scheme, device, records = inp.text, inp.scheme, inp.device, inp.cal.records
    layers = len(text.layer_types)
    method = "exhaustive" if cfg.exhaustive else "first-order"
    log(f"plan-weights: {scheme.weights} per block of {scheme.block}, {plural(len(inp.compressed), 'tensor')} in "
        f"{layers} layers; {plural(len(records), 'calibration record')} ({sum(len(r) for r in records):,} tokens) "
        f"from {inp.requests_path.name}; budget max |dp| {budget:g}; ranked by {method}; on {device.label}"
        f"{' (weights held)' if device.hold else ''}")
    found = _search(cfg, inp, budget, log)
    est, by_layer_bytes = found.estimates, _layer_bytes(inp.infos, scheme, inp.compressed, layers)
    plan = WeightPlan(
        plan_version=PLAN_VERSION,
        release={"hf_id": inp.pins.hf_id, "revision": inp.pins.revision,
                 "files": {n: d for n, d in inp.files.items() if n.endswith(".safetensors") or n.endswith(".json")}},
        scheme=PlanScheme(weights=scheme.weights, bits=scheme.bits, block=scheme.block, compute=recipe.compute),
        calibration={"requests": inp.requests_path.name, "sha256": sha256_file(inp.requests_path), "records": len(records),
                     "tokens": int(sum(len(r) for r in records)), "head": "the release's JointSchemaHead, fp32",
                     "rows": "transformers' Qwen3.5 text model, fp32 eager, "
                             + ("the weights held on the device" if device.hold else "one layer in memory at a time")},
        ranked_by=method, device=device.label, measured_alone=found.measured_alone,
        kendall_tau=kendall_tau(found.fast, found.ranking) if cfg.exhaustive else None,
        budget_dp=budget, ranking=found.ranking,
        layers=[LayerSensitivity(layer=i, kind=text.layer_types[i], rel_max_abs_d=est[i].rel_max_abs_d,
                                 rel_rms_d=est[i].rel_rms_d, estimated_dp=est[i].estimated_dp,
                                 fisher=est[i].fisher, alone_max_abs_dp=found.alone.get(i),
                                 compressed_bytes=by_layer_bytes[i][0], fp16_bytes=by_layer_bytes[i][1]) for i in sorted(est)],
        trials=found.trials, chosen=found.chosen, met=found.met, proof=found.proof,
        minimal=found.proof is None or not found.proof.passes,
        bytes={"all_compressed": asset_bytes(inp.infos, scheme, inp.compressed),
               "chosen": asset_bytes(inp.infos, scheme, compressed_names(inp.wanted, scheme, found.chosen)),
               "fp16": asset_bytes(inp.infos)},
        seconds={**found.seconds, "total": round(time.perf_counter() - t_start, 3)},
    )
    atomic_write_json(Path(cfg.out), plan.model_dump(mode="json"))
    return plan


PLAN_JOB = "weight-plan"


def plan_job(job: dict, log) -> dict:
    """The worker's job for a build with ``fp16_layers = "auto"`` (``build.backbone.choose_layers``):
    the planner in its own process, so its memory (the reference's layers, the calibration rows) goes
    back to the OS before the export starts."""
    from ..recipe import BackboneRecipe

    recipe = BackboneRecipe.model_validate(job["recipe"])
    cfg = PlanConfig(release=Path(job["release"]), recipe=recipe, recipe_path=Path(job["recipe_path"]),
                     pins_path=Path(job["pins_path"]), out=Path(job["out"]), checked=job["checked"], device=recipe.plan_device)
    plan = plan_weights(cfg, log)
    return {"chosen": plan.chosen, "met": plan.met, "minimal": plan.minimal, "seconds": plan.seconds}
