"""`make bench-slice-int8`: the compressed backbone at real width (issue 29), on the pinned 4-layer
slice of the 9B (its shapes and vocabulary, random bf16 weights).

1. ``build conversion/backbone_pf64_int8w32.toml`` with its gate, the records cut to a longest of
   ``--long-record`` tokens (the Linux CPU runtime takes about 22 s a 64-token chunk at this width:
   the default 4,033-token record alone would be 23 minutes), watched as a process tree: wall, peak
   anonymous + shared memory, total RSS; gate (a) the asset against torch eager on its own
   dequantized weights read back from main.mlirb, gate (b) the quantization against the release,
   the red arms; main.mlirb against the scheme's bytes;
2. ``plan-weights`` of the slice with the int8 recipe on a few of the project's requests, watched
   the same way (it streams one layer at a time), with a projection to the 9B's 32 layers.

Writes ``benchmarks/results/slice-int8-latest.json``; exits 1 when either command failed, the gate
failed, or the plan does not prove its choice (``backbone.plan.plan_problems``: met, the proof trial
missed, minimal).
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


def _watched(cmd: list[str], log: Path) -> dict:
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as errs:
        w = watch(cmd, 0.05, out, errs)
    w["stdout"] = log.with_suffix(".out").read_text()
    w["stderr_tail"] = log.with_suffix(".err").read_text().splitlines()[-12:]
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slice", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-slice-int8")
    ap.add_argument("--long-record", type=int, default=200)
    ap.add_argument("--plan-records", type=int, default=4)
    a = ap.parse_args()
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    recipe = a.work / "backbone_pf64_int8w32.toml"
    text = (ROOT / "conversion" / "backbone_pf64_int8w32.toml").read_text()
    recipe.write_text(text.replace("[verify]\n", f"[verify]\nlong_record = {a.long_record}\n"))
    result: dict = {"slice": str(a.slice), "long_record": a.long_record}

    w = _watched([str(EXE), "build", str(recipe), "--source", str(a.slice), "--out", str(a.work / "out"), "--json"],
                 a.work / "build")
    row = {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
           "peak_rss_mib": round(w["peak_rss_mib"], 1), "per_process_peak_mib": w["per_process_peak_mib"],
           "stderr_tail": w["stderr_tail"]}
    if w["rc"] == 0:
        m = json.loads(w["stdout"])
        bundle = a.work / "out" / m["name"]
        v = json.loads((bundle / "build-record.json").read_text())["verify"]
        c = m["export"]["compression"]
        row.update({"ok": v["ok"], "records": v["records"], "red": v["red"], "quantization": v["quantization"],
                    "bars": v["bars"], "mlirb_bytes": m["export"]["main_mlirb"]["bytes"], "implied_bytes": c["implied_bytes"],
                    "mlirb_over_implied": c["mlirb_over_implied"], "weight_fp16_bytes": m["export"]["weight_fp16_bytes"]})
        shutil.rmtree(bundle)
    result["build_int8w32_gated"] = row
    print(f"  slice int8w32 build + gate: rc {w['rc']}, {w['wall']:.1f} s, peak {w['peak_anon_shmem_mib']:.0f} MiB "
          f"({w['per_process_peak_mib']}), RSS {w['peak_rss_mib']:.0f} MiB", file=sys.stderr)

    lines = (ROOT / "conversion" / "requests.jsonl").read_text().splitlines()[: a.plan_records]
    (a.work / "requests.jsonl").write_text("\n".join(lines) + "\n")
    w = _watched([str(EXE), "plan-weights", str(a.slice), "--recipe", str(ROOT / "conversion" / "backbone_pf64_int8.toml"),
                  "--out", str(a.work / "plan.json"), "--requests", str(a.work / "requests.jsonl"), "--json"], a.work / "plan")
    prow = {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
            "peak_rss_mib": round(w["peak_rss_mib"], 1), "stderr_tail": w["stderr_tail"]}
    if w["rc"] == 0:
        from clef_flash.backbone.plan import load_plan, plan_problems

        plan = json.loads(w["stdout"])
        # the plan's proof, checked: its chosen set's trial met the budget, the set less its most
        # sensitive layer missed it (a plan that keeps nothing fp16 needs no proof)
        prow["problems"] = plan_problems(load_plan(a.work / "plan.json"))
        prow.update({"chosen": plan["chosen"], "ranking": plan["ranking"], "trials": plan["trials"], "layers": plan["layers"],
                     "seconds": plan["seconds"], "calibration": plan["calibration"], "bytes": plan["bytes"],
                     "minimal": plan["minimal"]})
        # the 9B: one pass per layer alone plus about log2(33) + 2 trials, each 8x the slice's layers
        passes = len(plan["ranking"]) + len(plan["trials"]) + 1
        per_pass = plan["seconds"]["total"] / max(passes, 1)
        prow["projection_9b_s"] = round(per_pass * 8 * (32 + 6 + 2), 0)
    result["plan_weights_int8"] = prow
    print(f"  slice plan-weights int8: rc {w['rc']}, {w['wall']:.1f} s, peak {w['peak_anon_shmem_mib']:.0f} MiB, "
          f"RSS {w['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    failures = []
    if result["build_int8w32_gated"].get("ok") is False:
        failures.append("build_int8w32_gated: the gate failed")
    failures += [f"plan_weights_int8: {p}" for p in prow.get("problems", [])]
    finish(result, "slice-int8-latest.json", failures)

if __name__ == "__main__":
    main()
