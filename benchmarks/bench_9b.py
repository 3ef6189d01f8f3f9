"""`make bench-9b`: the full-size backbone on this machine, in one run (not part of `make test`).

1. ``synth-release --size 9b``: the synthetic 9B release written streamed (size, write time, peak
   memory), then pinned;
2. the physical floor: ``cp`` of the release's safetensors into the work folder and ``sync``
   (reading and writing the bytes once), then the copy removed;
3. each recipe (fp16, fp16w32): ``build --no-verify`` watched as a process tree (``memwatch``: wall,
   peak anonymous + shared memory, peak total RSS, every 50 ms), its stages, ``main.mlirb`` against
   the fp16 bytes; then ``verify`` of that bundle (what runs at this size: files, the bytecode's
   descriptor, every weight against the release, streamed), watched the same way; then the
   bundle removed (disk: the release, the scratch file and ``main.mlirb`` at once);
4. with ``--slice``: the same for the real-width 4-layer slice (its ``cp`` floor, both builds),
   beside the straightforward route's recorded figures;
5. the targets (peak <= 4 GB, stretch 2 GB; build wall <= 3x the ``cp`` floor) and a projection for
   a 27B-class backbone from what scales (bytes-bound stages x3, layer-bound stages x64/32).

Writes ``benchmarks/results/9b-latest.json``. Needs about 70 GB of free disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from memwatch import watch  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"
RECIPES = {"fp16": ROOT / "conversion" / "backbone_pf64_fp16.toml", "fp16w32": ROOT / "conversion" / "backbone_pf64_fp16w32.toml"}
STRAIGHTFORWARD_SLICE = {"wall": 40.5, "rss_gib": 11.2, "anon_gib": 7.5}  # recorded (docs/performance.md), not re-run
TARGETS = {"peak_bytes": 4e9, "stretch_peak_bytes": 2e9, "wall_over_cp": 3.0}
LAYER_BOUND = ("trace",)  # grows with the layers; weights, convert, save grow with the bytes


def _watched(cmd: list[str], log: Path) -> dict:
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as errs:
        w = watch(cmd, 0.05, out, errs)
    if w["rc"] != 0:
        raise SystemExit(f"failed ({w['rc']}): {' '.join(cmd)}; see {log.with_suffix('.err')}")
    w["stdout"] = log.with_suffix(".out").read_text()
    return w


def _mem(w: dict) -> dict:
    return {"wall": round(w["wall"], 2), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
            "peak_rss_mib": round(w["peak_rss_mib"], 1), "per_process_peak_mib": w["per_process_peak_mib"]}


def shards(release: Path) -> list[Path]:
    return sorted(release.glob("*.safetensors"))


def cp_floor(release: Path, work: Path) -> dict:
    """``cp`` of the release's safetensors and a ``sync``: every byte read and written once."""
    dest = work / "cp-floor"
    dest.mkdir(parents=True)
    files = [str(p) for p in shards(release) if p.name != "joint_head.safetensors"]
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", *files, str(dest)], check=True)
    t_cp = time.perf_counter() - t0
    subprocess.run(["sync"], check=True)
    t_sync = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in dest.iterdir())
    shutil.rmtree(dest)
    subprocess.run(["sync"], check=True)
    return {"bytes": size, "cp_seconds": round(t_cp, 2), "cp_sync_seconds": round(t_sync, 2)}


def build_and_verify(name: str, release: Path, recipe: str, work: Path, verify: bool) -> dict:
    out = work / name
    w = _watched([str(EXE), "build", str(RECIPES[recipe]), "--source", str(release), "--out", str(out), "--overwrite",
                  "--no-verify", "--json"], work / f"{name}-{recipe}-build")
    m = json.loads(w["stdout"])
    e = m["export"]
    row = {"release": name, "recipe": recipe, "build": _mem(w), "stages": e["seconds"], "mlirb_bytes": e["main_mlirb"]["bytes"],
           "weight_fp16_bytes": e["weight_fp16_bytes"], "mlirb_over_fp16": e["mlirb_over_weights"]}
    bundle = out / m["name"]
    print(f"  {name} {recipe} build: {w['wall']:.1f} s, peak {w['peak_anon_shmem_mib']:.0f} MiB anon+shmem "
          f"({w['per_process_peak_mib']}), RSS {w['peak_rss_mib']:.0f} MiB, stages {e['seconds']}", file=sys.stderr)
    if verify:
        t = work / f"{name}-{recipe}-verify.json"
        v = _watched([str(EXE), "verify", str(bundle), "--source", str(release), "--transcript", str(t)],
                     work / f"{name}-{recipe}-verify")
        tr = json.loads(t.read_text())
        row["verify"] = {**_mem(v), "ok": tr["ok"], "checks": {c["check"]: c["ok"] for c in tr["checks"]},
                         "weights": next((c["detail"] for c in tr["checks"] if c["check"].startswith("every weight")), None),
                         "numeric_records": len(tr["records"]), "notes": tr["notes"]}
        print(f"  {name} {recipe} verify: {v['wall']:.1f} s, peak {v['peak_anon_shmem_mib']:.0f} MiB, ok {tr['ok']}; "
              f"{row['verify']['weights']}", file=sys.stderr)
    shutil.rmtree(out)
    return row


def projection(rows: list[dict], layers: int = 32, layers_27b: int = 64, bytes_factor: float = 3.0) -> dict:
    """A 27B-class backbone from the 9B's rows: stages bound to the bytes x3, to the layers x64/32;
    memory: the worker's per-layer growth (between the slice and the 9B) over the extra layers."""
    out = {}
    by = {(r["release"], r["recipe"]): r for r in rows}
    for recipe in RECIPES:
        full, part = by.get(("9b", recipe)), by.get(("slice", recipe))
        if not full:
            continue
        st = full["stages"]
        byte_s = sum(v for k, v in st.items() if k not in LAYER_BOUND and k != "total")
        layer_s = sum(st[k] for k in LAYER_BOUND)
        other = full["build"]["wall"] - st["total"]  # start, hashing, the bundle's own files
        wall = bytes_factor * (byte_s + other) + layer_s * layers_27b / layers
        peak = full["build"]["peak_anon_shmem_mib"]
        per_layer = (peak - part["build"]["peak_anon_shmem_mib"]) / (layers - 4) if part else None
        out[recipe] = {"wall_s": round(wall), "peak_gb": round((peak + (per_layer or 0) * (layers_27b - layers)) * 2**20 / 1e9, 2),
                       # main.mlirb alone: the weights are written once, and no numeric gate runs at that size
                       "disk_gb": round(bytes_factor * full["weight_fp16_bytes"] / 1e9, 1),
                       "assumes": f"{bytes_factor}x the 9B's decoder bytes over {layers_27b} layers"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", type=Path, default=ROOT / ".cache" / "synth-9b", help="where the 9B release is written")
    ap.add_argument("--reuse", action="store_true", help="keep an existing pinned release (no write time reported)")
    ap.add_argument("--slice", type=Path, help="the pinned real-width slice: its rows beside the 9B's")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-9b")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    a = ap.parse_args()
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    result: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
                    "targets": TARGETS, "rows": []}
    if not (a.reuse and (a.release / "pins.json").is_file()):
        author = ROOT / ".cache" / "author" / "joint_schema_model.py"
        w = _watched([str(EXE), "synth-release", str(a.release), "--size", "9b", "--seed", "0", "--author-code", str(author),
                      "--overwrite"], a.work / "synth")
        result["release"] = {"write": _mem(w)}
        t0 = time.perf_counter()
        subprocess.run([str(EXE), "pin", str(a.release), "--name", "synth_9b", "--overwrite"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result["release"]["pin_seconds"] = round(time.perf_counter() - t0, 2)
    result.setdefault("release", {})["bytes"] = sum(p.stat().st_size for p in a.release.iterdir() if p.is_file())
    print(f"  release: {result['release']}", file=sys.stderr)
    releases = [("9b", a.release)] + ([("slice", a.slice)] if a.slice else [])
    result["cp_floor"] = {}
    for name, rel in releases:
        result["cp_floor"][name] = cp_floor(rel, a.work)
        print(f"  {name} cp floor: {result['cp_floor'][name]}", file=sys.stderr)
        for recipe in a.recipes:
            result["rows"].append(build_and_verify(name, rel, recipe, a.work, a.verify and name == "9b"))
    checks = []
    for r in result["rows"]:
        floor = result["cp_floor"][r["release"]]["cp_sync_seconds"]
        peak = r["build"]["peak_anon_shmem_mib"] * 2**20
        checks.append({"row": f"{r['release']} {r['recipe']}", "check": "build peak anon+shmem <= 4 GB", "value": peak,
                       "ok": peak <= TARGETS["peak_bytes"]})
        checks.append({"row": f"{r['release']} {r['recipe']}", "check": "stretch: build peak <= 2 GB", "value": peak,
                       "ok": peak <= TARGETS["stretch_peak_bytes"]})
        checks.append({"row": f"{r['release']} {r['recipe']}", "check": f"build wall <= 3 x cp floor ({floor:.1f} s)",
                       "value": r["build"]["wall"] / floor, "ok": r["build"]["wall"] <= TARGETS["wall_over_cp"] * floor})
        if "verify" in r:
            vpeak = r["verify"]["peak_anon_shmem_mib"] * 2**20
            checks.append({"row": f"{r['release']} {r['recipe']}", "check": "verify passes within 4 GB",
                           "value": vpeak, "ok": r["verify"]["ok"] and vpeak <= TARGETS["peak_bytes"]})
    result["checks"] = checks
    result["straightforward_slice"] = STRAIGHTFORWARD_SLICE
    result["projection_27b"] = projection(result["rows"])
    out = ROOT / "benchmarks" / "results" / "9b-latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'release':8} {'recipe':8} {'wall s':>7} {'x cp':>5} {'anon+shm MiB':>13} {'RSS MiB':>8} {'mlirb/fp16':>10} {'verify s':>9} {'verify MiB':>10}")
    for r in result["rows"]:
        floor = result["cp_floor"][r["release"]]["cp_sync_seconds"]
        v = r.get("verify", {})
        print(f"{r['release']:8} {r['recipe']:8} {r['build']['wall']:7.1f} {r['build']['wall'] / floor:5.2f} "
              f"{r['build']['peak_anon_shmem_mib']:13.0f} {r['build']['peak_rss_mib']:8.0f} {r['mlirb_over_fp16']:10.5f} "
              f"{v.get('wall', float('nan')):9.1f} {v.get('peak_anon_shmem_mib', float('nan')):10.0f}")
    for c in checks:
        print(f"  {'pass' if c['ok'] else 'MISS'}  {c['row']}: {c['check']} ({c['value']:.4g})")
    for recipe, p in result["projection_27b"].items():
        print(f"  27B-class projection, {recipe}: {p}")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
