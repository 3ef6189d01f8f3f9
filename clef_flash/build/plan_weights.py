"""``plan-weights``: which decoder layers a compressed backbone keeps fp16, chosen for the release's
own weights (``backbone.plan.WeightPlan``, a file a recipe names with ``plan = "..."``).

How it works: docs/modules.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import IntegrityError, UsageError
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


class RowTable:
    """``lm_head.weight`` rows read from the shard when the head indexes them (a mapping: page
    cache), fp32: what the author's head reads as ``output_embedding_weight[token_ids]``."""

    def __init__(self, folder: Path, t) -> None:
        from ..engine.streamed_weights import as_f32

        self._as_f32 = as_f32
        self.t = t
        self.table = np.memmap(Path(folder) / t.file, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))

    def __getitem__(self, ids):
        import torch

        idx = np.asarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids, dtype=np.int64).reshape(-1)
        rows = self.table.reshape(self.t.shape[0], -1)[idx]
        return torch.from_numpy(self._as_f32(np.ascontiguousarray(rows).reshape(-1), self.t.dtype).reshape(len(idx), -1))


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
    if not Path(cfg.release).is_dir():
        raise UsageError(f"{cfg.release}: release folder not found")
    return budget


def _calibration(cfg: PlanConfig, source: Path, pins, requests, text):
    """The calibration records (the requests encoded by the author's ``encode_record`` with the
    release's tokenizer), and ``probs(rows)``: every option's probability through the release's head."""
    import torch

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
    table = RowTable(source, lm)

    def probs(rows: list[np.ndarray]) -> list[np.ndarray]:
        out_p = []
        with torch.inference_mode():
            for e, ids, h in zip(encoded, records, rows, strict=True):
                logits = head(torch.from_numpy(np.ascontiguousarray(h))[None], torch.from_numpy(ids)[None],
                              torch.ones(1, len(ids), dtype=torch.long), [e], table)[0]
                out_p.append(np.concatenate([q.float().softmax(-1).numpy() for q in logits]))
        return out_p

    return records, probs


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


def _layer_bytes(infos, scheme, compressed: list[str], layers: int) -> dict[int, tuple[int, int]]:
    """Each decoder layer's weight bytes: (compressed as the scheme would, all fp16)."""
    from ..backbone.contract import layer_of
    from ..engine.streamed_weights import asset_bytes

    out = {}
    for i in range(layers):
        mine = {n: t for n, t in infos.items() if layer_of(n) == i}
        out[i] = (asset_bytes(mine, scheme, [n for n in compressed if layer_of(n) == i]), asset_bytes(mine))
    return out


def plan_weights(cfg: PlanConfig, log=lambda m: None):
    from ..backbone.contract import compressed_names, layer_of, weight_names
    from ..backbone.plan import PLAN_VERSION, LayerSensitivity, PlanScheme, Trial, WeightPlan
    from ..backbone.sensitivity import Dequantizer, LayerOutputs, layer_errors, rows_with
    from ..backbone.source import release_config
    from ..bundle import atomic_write_json
    from ..digest import sha256_file
    from ..engine.streamed_weights import asset_bytes, locate
    from ..progress import progress
    from ..sources.pinned_files import read_files, verify_files
    from ..sources.pins import load_pins
    from ..sources.requests import default_requests, load_requests

    t_start = time.perf_counter()
    recipe, out, budget = cfg.recipe, Path(cfg.out), _budget(cfg)
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
    scheme, scaled = recipe.scheme, recipe.compute == "fp32"
    compressed = compressed_names(wanted, scheme, ())
    layers = len(text.layer_types)
    records, probs = _calibration(cfg, source, pins, requests, text)

    log(f"plan-weights: {scheme.weights} per block of {scheme.block}, {plural(len(compressed), 'tensor')} in "
        f"{layers} layers; {plural(len(records), 'calibration record')} ({sum(len(r) for r in records):,} tokens) "
        f"from {requests_path.name}; budget max |dp| {budget:g}")
    # every layer's uncompressed output, so a trial starts at its first compressed layer
    with LayerOutputs() as outputs:
        t0 = time.perf_counter()
        with progress("plan: each layer's own error", len(records), "records") as tick:
            errors, base_rows = layer_errors(source, records, infos, scheme, compressed, scaled, tick, outputs)
        base = probs(base_rows)
        with_codes = sorted({layer_of(n) for n in compressed})
        deq = Dequantizer(source, infos, scheme, compressed, scaled)
        trials: list[Trial] = []

        def dp_with(squeezed: set[int], tick=lambda: None) -> tuple[float, float]:
            if not squeezed:
                return 0.0, 0.0
            rows = rows_with(source, records, deq, squeezed, tick, outputs)
            dp = np.concatenate([np.abs(a - b) for a, b in zip(probs(rows), base, strict=True)])
            return (float(dp.max()), float(dp.mean())) if dp.size else (0.0, 0.0)

        alone = {}
        with progress("plan: each layer alone compressed, end to end", len(with_codes) * len(records), "records") as tick:
            for i in with_codes:
                alone[i] = dp_with({i}, tick)[0]
        t_layers = time.perf_counter() - t0
        ranking = sorted(with_codes, key=lambda i: (-alone[i], -errors[i]["rel_max_abs_d"], i))
        for i in ranking:
            log(f"layer {i} ({text.layer_types[i]}): alone max |dp| {alone[i]:.3g}; its own output rel max |d| "
                f"{errors[i]['rel_max_abs_d']:.3g}, rel rms {errors[i]['rel_rms_d']:.3g}")
        t0 = time.perf_counter()

        def trial(kept: list[int], record: bool = True) -> Trial:
            top, mean = dp_with(set(with_codes) - set(kept))
            t = Trial(fp16_layers=sorted(kept), max_abs_dp=top, mean_abs_dp=mean, passes=top <= budget)
            if record:
                trials.append(t)
            log(f"trial: fp16 layers {sorted(kept) or 'none'}: max |dp| {top:.4g}, mean {mean:.3g} -> "
                f"{'meets' if t.passes else 'misses'} {budget:g}")
            return t

        k = _smallest_k(ranking, trial, trials)
        chosen = sorted(ranking[:k])
        met = any(t.passes and t.fp16_layers == chosen for t in trials)
        proof = None
        if k >= 1:  # the proof: without its most sensitive layer the chosen set must miss the budget
            proof = next((t for t in trials if t.fp16_layers == sorted(ranking[1:k])), None) or trial(ranking[1:k], record=False)
        t_trials = time.perf_counter() - t0
    by_layer_bytes = _layer_bytes(infos, scheme, compressed, layers)
    plan = WeightPlan(
        plan_version=PLAN_VERSION,
        release={"hf_id": pins.hf_id, "revision": pins.revision,
                 "files": {n: d for n, d in files.items() if n.endswith(".safetensors") or n.endswith(".json")}},
        scheme=PlanScheme(weights=scheme.weights, bits=scheme.bits, block=scheme.block, compute=recipe.compute),
        calibration={"requests": requests_path.name, "sha256": sha256_file(requests_path), "records": len(records),
                     "tokens": int(sum(len(r) for r in records)), "head": "the release's JointSchemaHead, fp32",
                     "rows": "transformers' Qwen3.5 text model, fp32 eager, one layer in memory at a time"},
        budget_dp=budget, ranking=ranking,
        layers=[LayerSensitivity(layer=i, kind=text.layer_types[i], rel_max_abs_d=errors[i]["rel_max_abs_d"],
                                 rel_rms_d=errors[i]["rel_rms_d"], alone_max_abs_dp=alone[i], compressed_bytes=by_layer_bytes[i][0],
                                 fp16_bytes=by_layer_bytes[i][1]) for i in with_codes],
        trials=trials, chosen=chosen, met=met, proof=proof, minimal=proof is None or not proof.passes,
        bytes={"all_compressed": asset_bytes(infos, scheme, compressed),
               "chosen": asset_bytes(infos, scheme, compressed_names(wanted, scheme, chosen)),
               "fp16": asset_bytes(infos)},
        seconds={"layers": round(t_layers, 3), "trials": round(t_trials, 3), "total": round(time.perf_counter() - t_start, 3)},
    )
    atomic_write_json(out, plan.model_dump(mode="json"))
    return plan


PLAN_JOB = "weight-plan"


def plan_job(job: dict, log) -> dict:
    """The worker's job for a build with ``fp16_layers = "auto"`` (``build.backbone.choose_layers``):
    the planner in its own process, so its memory (the reference's layers, the calibration rows) goes
    back to the OS before the export starts."""
    from ..recipe import BackboneRecipe

    cfg = PlanConfig(release=Path(job["release"]), recipe=BackboneRecipe.model_validate(job["recipe"]),
                     recipe_path=Path(job["recipe_path"]), pins_path=Path(job["pins_path"]), out=Path(job["out"]),
                     checked=job["checked"])
    plan = plan_weights(cfg, log)
    return {"chosen": plan.chosen, "met": plan.met, "minimal": plan.minimal, "seconds": plan.seconds}
