"""`make bench` (backbone rows): the backbone build at the tiny configuration and at a real-width
slice (the 9B's layer shapes and vocabulary, 4 layers: 3 linear + 1 full; ``synth-release --size 9b
--layers 4``), both recipes, each build a whole process tree watched by ``memwatch``.

Per row: wall, peak anonymous + shared memory summed over the build's processes (what the build
holds), peak total RSS beside it (plus the pages of memory-mapped files: page cache), the peak of
each process, the stages, and ``main.mlirb`` against the fp16 bytes of the weights it holds. The
issue's targets at the slice are printed pass / fail against the straightforward route's figures
(transformers' model loaded, a wrapper, torch.export, decompose, convert, save: 40.5 s, 11.2 GiB
RSS, 7.5 GiB anonymous, measured on this machine class and recorded in docs/performance.md; not
re-run here). Writes ``benchmarks/results/backbone-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from memwatch import watch  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"
RECIPES = {"fp16w32": ROOT / "conversion" / "backbone_pf64_fp16w32.toml", "fp16": ROOT / "conversion" / "backbone_pf64_fp16.toml"}
STRAIGHTFORWARD = {"wall": 40.5, "rss_gib": 11.2, "anon_gib": 7.5}
TARGETS = {"wall_over_straightforward": 0.5, "peak_anon_shmem_bytes": 1e9, "mlirb_over_fp16": 1.002}


def build_row(name: str, release: Path, recipe: str, work: Path) -> dict:
    out_json = work / f"{name}-{recipe}.json"
    cmd = [str(EXE), "build", str(RECIPES[recipe]), "--source", str(release), "--out", str(work / name), "--overwrite",
           "--no-verify", "--json"]
    with open(out_json, "wb") as fh:
        w = watch(cmd, 0.05, fh)
    if w["rc"] != 0:
        raise SystemExit(f"build failed ({w['rc']}): {' '.join(cmd)}")
    m = json.loads(out_json.read_text())
    e = m["export"]
    return {"release": name, "recipe": recipe, "wall": round(w["wall"], 2),
            "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1), "peak_rss_mib": round(w["peak_rss_mib"], 1),
            "per_process_peak_mib": w["per_process_peak_mib"], "stages": e["seconds"],
            "mlirb_bytes": e["main_mlirb"]["bytes"], "weight_fp16_bytes": e["weight_fp16_bytes"],
            "mlirb_over_fp16": e["mlirb_over_weights"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True, help="the tiny release (pinned)")
    ap.add_argument("--slice", type=Path, help="the real-width slice release (pinned); rows skipped without it")
    ap.add_argument("--work", type=Path, help="build folder (default: a temporary one)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="clef-bench-backbone-", dir=a.work) as tmp:
        for name, rel in (("tiny", a.tiny), ("slice", a.slice)):
            if rel is None:
                continue
            for recipe in RECIPES:
                row = build_row(name, rel, recipe, Path(tmp))
                rows.append(row)
                print(f"  {name} {recipe}: {row['wall']:.1f} s, peak anon+shmem {row['peak_anon_shmem_mib']:.0f} MiB "
                      f"(per process {row['per_process_peak_mib']}), total RSS {row['peak_rss_mib']:.0f} MiB, "
                      f"main.mlirb {row['mlirb_over_fp16']:.4f}x fp16", file=sys.stderr)
    targets = []
    for row in rows:
        if row["release"] != "slice":
            continue
        targets.append({"row": f"slice {row['recipe']}", "check": "wall <= 0.5 x straightforward (40.5 s)",
                        "value": row["wall"], "ok": row["wall"] <= TARGETS["wall_over_straightforward"] * STRAIGHTFORWARD["wall"]})
        targets.append({"row": f"slice {row['recipe']}", "check": "peak anon+shmem <= 1 GB",
                        "value": row["peak_anon_shmem_mib"] * 2**20, "ok": row["peak_anon_shmem_mib"] * 2**20 <= TARGETS["peak_anon_shmem_bytes"]})
        targets.append({"row": f"slice {row['recipe']}", "check": "main.mlirb <= 1.002 x fp16 bytes",
                        "value": row["mlirb_over_fp16"], "ok": row["mlirb_over_fp16"] <= TARGETS["mlirb_over_fp16"]})
    result = {"machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
              "straightforward": STRAIGHTFORWARD, "rows": rows, "targets": targets}
    out = ROOT / "benchmarks" / "results" / "backbone-latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'release':8} {'recipe':8} {'wall s':>7} {'anon+shm MiB':>13} {'RSS MiB':>8} {'mlirb/fp16':>10}")
    for r in rows:
        print(f"{r['release']:8} {r['recipe']:8} {r['wall']:7.1f} {r['peak_anon_shmem_mib']:13.0f} {r['peak_rss_mib']:8.0f} "
              f"{r['mlirb_over_fp16']:10.4f}")
    for t in targets:
        print(f"  {'pass' if t['ok'] else 'MISS'}  {t['row']}: {t['check']} ({t['value']:.4g})")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
