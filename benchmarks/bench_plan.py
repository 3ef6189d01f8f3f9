"""`make bench-plan`: how long ``plan-weights`` takes (issue 47), the one-pass ranking against the
exhaustive one (the oracle).

1. a tiny release (``--tiny``: clef-finetune's ``make-tiny``), the project's requests, every one of
   them: the default plan (each record the cheaper way: carried back or measured end to end),
   ``--estimate first-order`` (every record carried back) and ``--exhaustive``, each watched as a
   process tree (wall, peak anonymous + shared memory); their chosen sets and Kendall's tau;
2. the real-width slice of the 9B (``--slice``, 4 layers), ``--plan-records`` of the project's
   requests at ``--tight-budget`` (one the all-int8 slice misses, so trials and the proof run), the
   default and ``--estimate first-order``; the 9B projected from each (``_projection``);
3. where it ran: the device (``--device``, default auto: a GPU where there is one).

Writes ``benchmarks/results/plan-latest.json``; exits 1 when a command failed, a plan does not prove
its choice (``backbone.plan.plan_problems``), or the two tiny plans chose different sets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_result import finish  # noqa: E402
from memwatch import watch  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"
LAYERS_9B = 32


def _plan(release: Path, work: Path, tag: str, *extra: str) -> dict:
    out = work / f"{tag}.json"
    cmd = [str(EXE), "plan-weights", str(release), "--recipe", str(ROOT / "conversion" / "backbone_pf64_int8.toml"),
           "--out", str(out), "--overwrite", "--json", *extra]
    with open(work / f"{tag}.out", "wb") as so, open(work / f"{tag}.err", "wb") as se:
        w = watch(cmd, 0.05, so, se)
    row = {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
           "stderr_tail": (work / f"{tag}.err").read_text().splitlines()[-14:]}
    if w["rc"] == 0:
        from clef_flash.backbone.plan import load_plan, plan_problems

        plan = load_plan(out)
        row.update({"chosen": plan.chosen, "ranking": plan.ranking, "ranked_by": plan.ranked_by, "device": plan.device,
                    "kendall_tau": plan.kendall_tau, "measured_alone": plan.measured_alone, "seconds": plan.seconds, "records": plan.calibration["records"],
                    "tokens": plan.calibration["tokens"], "budget_dp": plan.budget_dp, "met": plan.met, "minimal": plan.minimal,
                    "trials": [t.model_dump() for t in plan.trials], "layers": [e.model_dump() for e in plan.layers],
                    "problems": plan_problems(plan, minimal=False)})
    print(f"  {tag}: rc {w['rc']}, {w['wall']:.1f} s, peak {w['peak_anon_shmem_mib']:.0f} MiB"
          + (f", chose {row['chosen']} ({row['ranked_by']}, on {row['device']})" if w["rc"] == 0 else ""), file=sys.stderr)
    return row


def _projection(row: dict, slice_layers: int) -> float:
    """The 9B's plan from the slice's, each part by how it grows with the layers n -> L: the forward
    and each trial with L / n; the sweep's own errors (each compressed layer run compressed) with
    L / n, its carrying with the layers above the first, (L - 1) / (n - 1), the rest of it (the
    head's gradients, parking the head) not at all; the records measured end to end (the oracle's:
    every record), with each compressed layer and those after it, L(L + 1) / n(n + 1). At 32 layers
    the default carries back the records of at most 18 options that it measures at 4, so the
    default's 9B is at most the smaller of the two projections."""
    s = row["seconds"]
    n, big = slice_layers, LAYERS_9B
    grow = {"forward": big / n, "measured": big * (big + 1) / (n * (n + 1)), "trials": big / n,
            "reverse_own": big / n, "reverse_carry": (big - 1) / (n - 1)}
    fixed = s["total"] - sum(s[k] for k in ("forward", "measured", "trials", "reverse_own", "reverse_carry"))
    return round(fixed + sum(s[k] * g for k, g in grow.items()), 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True)
    ap.add_argument("--slice", type=Path)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-plan")
    ap.add_argument("--plan-records", type=int, default=4)
    ap.add_argument("--tight-budget", type=float, default=1e-3)
    ap.add_argument("--tiny-budget", type=float, default=2e-4)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    result: dict = {"tiny": str(a.tiny), "slice": str(a.slice) if a.slice else None}
    dev = ["--device", a.device]
    result["tiny_default"] = _plan(a.tiny, a.work, "tiny-default", "--budget-dp", str(a.tiny_budget), *dev)
    result["tiny_first_order"] = _plan(a.tiny, a.work, "tiny-first-order", "--budget-dp", str(a.tiny_budget),
                                       "--estimate", "first-order", *dev)
    result["tiny_exhaustive"] = _plan(a.tiny, a.work, "tiny-exhaustive", "--budget-dp", str(a.tiny_budget), "--exhaustive", *dev)
    if a.slice:
        lines = (ROOT / "conversion" / "requests.jsonl").read_text().splitlines()[: a.plan_records]
        (a.work / "requests.jsonl").write_text("\n".join(lines) + "\n")
        req = ["--requests", str(a.work / "requests.jsonl"), *dev]
        layers = len(json.loads((a.slice / "config.json").read_text())["text_config"]["layer_types"])
        tight = ["--budget-dp", str(a.tight_budget)]
        for tag, extra in (("slice_default_tight", tight), ("slice_first_order_tight", [*tight, "--estimate", "first-order"])):
            row = result[tag] = _plan(a.slice, a.work, tag.replace("_", "-"), *req, *extra)
            if row["rc"] == 0:
                row["projection_9b_s"] = _projection(row, layers)
                print(f"    9B projected: {row['projection_9b_s'] / 60:.0f} min", file=sys.stderr)
    failures = [f"{k}: {p}" for k, v in result.items() if isinstance(v, dict) for p in v.get("problems", [])]
    ex = result["tiny_exhaustive"]
    for tag in ("tiny_default", "tiny_first_order"):
        if result[tag].get("chosen") != ex.get("chosen"):
            failures.append(f"{tag}: chose {result[tag].get('chosen')}, the exhaustive plan {ex.get('chosen')}")
    finish(result, "plan-latest.json", failures)

if __name__ == "__main__":
    main()
