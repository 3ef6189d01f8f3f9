"""`make bench`: the build against the straightforward export, hashing, size, latency, start-up.

Runs each measured command as a whole process and reads wall time and peak RSS from the OS
(``os.wait4``), alternating build and baseline pair by pair so the ratio holds on a noisy machine.
Writes ``benchmarks/results/latest.json`` and prints a table. Informational latencies come from the
Core AI CPU runtime and eager torch; the target runtime is the Apple GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXE = Path(sys.executable).parent / "clef-export"
# the published asset's size, from its manifest kept in the repository
PUBLISHED = ROOT / "manifests" / "published" / "clef_flash_head_bucket_fp16w32.metadata.json"
PUBLISHED_MLIRB = json.loads(PUBLISHED.read_text())["export"]["main_mlirb"]["bytes"]
NAME = "clef_flash_head_bucket_fp16w32"


def timed(cmd: list[str], **kw) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MB (the process and the children it waited for), stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024.0, out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def bench_builds(source: Path, pins: Path, runs: int, work: Path, coreml: bool = True) -> dict:
    build_cmd = [str(EXE), "build", "--source", str(source), "--pins", str(pins), "--out", str(work / "b"),
                 "--overwrite", "--no-verify", "--json"]
    # the Core ML package as a release builds it: its gate (read-back checks) included
    coreml_cmd = [str(EXE), "build", "--format", "mlpackage", "--source", str(source), "--pins", str(pins),
                  "--out", str(work / "m"), "--overwrite", "--json"]
    base_cmd = [sys.executable, str(ROOT / "benchmarks" / "baseline_export.py"), str(source), str(pins)]
    rows: dict[str, list] = {"build": [], "baseline": [], "coreml": []}
    for i in range(runs + 1):  # the first pair is the warm-up
        wall_b, rss_b, out = timed(build_cmd)
        manifest = json.loads(out)
        shutil.rmtree(work / "base.aimodel", ignore_errors=True)
        wall_r, rss_r, out_r = timed(base_cmd + [str(work / "base.aimodel")])
        if coreml and i > 0:  # no warm-up of its own: the pair before warmed the same caches
            wall_c, rss_c, out_c = timed(coreml_cmd)
            rows["coreml"].append({"wall": wall_c, "rss_mb": rss_c, "stages": json.loads(out_c)["export"]["seconds"]})
        if i == 0:
            continue
        rows["build"].append({"wall": wall_b, "rss_mb": rss_b, "stages": manifest["export"]["seconds"]})
        rows["baseline"].append({"wall": wall_r, "rss_mb": rss_r, "stages": json.loads(out_r.strip().splitlines()[-1])})
        extra = f", Core ML {rows['coreml'][-1]['wall']:.1f} s / {rows['coreml'][-1]['rss_mb']:.0f} MB" if coreml else ""
        print(f"  pair {i}: build {wall_b:.1f} s / {rss_b:.0f} MB, baseline {wall_r:.1f} s / {rss_r:.0f} MB{extra}",
              file=sys.stderr)
    ratios = [b["wall"] / r["wall"] for b, r in zip(rows["build"], rows["baseline"], strict=True)]
    coreml_ratios = [c["wall"] / r["wall"] for c, r in zip(rows["coreml"], rows["baseline"], strict=True)]
    return {**rows, "ratios": ratios, "coreml_ratios": coreml_ratios, "mlirb_bytes": manifest["export"]["main_mlirb"]["bytes"],
            "bundle": str(work / "b" / NAME)}


def bench_hashes(source: Path, pins: Path) -> dict:
    from clef_flash.digest import sha256_file
    from clef_flash.sources.pins import load_pins

    files = [source / f for f in load_pins(pins).files]
    size = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache for both sides
        f.read_bytes()
    ours, theirs, proc = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for f in files:
            sha256_file(f)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, capture_output=True)
        theirs.append(time.perf_counter() - t0)
        wall, _, _ = timed([str(EXE), "verify-hashes", "--source", str(source), "--pins", str(pins), "--json"])
        proc.append(wall)
    gb = size / 1e9
    return {"bytes": size, "ours_gb_s": gb / statistics.median(ours), "sha256sum_gb_s": gb / statistics.median(theirs),
            "verify_hashes_command_s": statistics.median(proc)}


async def _runtime_latency(asset: Path, arrays_by_fn: dict) -> dict:
    from coreai.authoring.asset import AIModelAsset
    from coreai.runtime import NDArray

    out = {}
    async with AIModelAsset.load(asset).executable() as model:
        for name, arrays in arrays_by_fn.items():
            fn = model.load_function(name)
            inputs = {k: NDArray(v) for k, v in arrays.items()}
            t0 = time.perf_counter()
            await fn(inputs)
            out[name] = time.perf_counter() - t0
    return out


def bench_latency(bundle: Path, source: Path, pins: Path) -> dict:
    import numpy as np
    import torch

    from clef_flash.sources.author import load_head
    from clef_flash.head.contract import BUCKETS, INPUT_ORDER, function_name
    from clef_flash.head.records import random_records
    from clef_flash.head.graph import ClefHeadGraph
    from clef_flash.head.host import head_inputs
    from clef_flash.sources.pins import load_pins

    _, _, head = load_head(source, load_pins(pins), torch.float16)
    graph = ClefHeadGraph(head)
    table = np.random.default_rng(0).standard_normal((512, 4096), dtype=np.float32)
    arrays_by_fn, eager = {}, {}
    for b in BUCKETS:
        rec = random_records(1, b, 0, 4096, 512, seed=1)[0]
        arrays = head_inputs(rec.hidden, rec.ids, rec.questions, table, b).arrays
        arrays_by_fn[function_name(b)] = arrays
        args = [torch.from_numpy(arrays[k]) for k in INPUT_ORDER]
        with torch.inference_mode():
            graph(*args)
            t0 = time.perf_counter()
            graph(*args)
            eager[function_name(b)] = time.perf_counter() - t0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime = asyncio.run(_runtime_latency(bundle / f"{NAME}.aimodel", arrays_by_fn))
    return {"coreai_cpu_s": runtime, "eager_torch_s": eager}


def bench_help() -> float:
    walls = [timed([str(EXE), "--help"])[0] for _ in range(5)]
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--pins", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-coreml", action="store_true", help="leave out the Core ML package build")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="clef-bench-"))
    try:
        print("builds (build and baseline, pair by pair) …", file=sys.stderr)
        builds = bench_builds(args.source, args.pins, args.runs, work, coreml=not args.skip_coreml)
        print("hashing …", file=sys.stderr)
        hashes = bench_hashes(args.source, args.pins)
        latency = None if args.skip_latency else bench_latency(Path(builds["bundle"]), args.source, args.pins)
        help_s = bench_help()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b_wall = [r["wall"] for r in builds["build"]]
    r_wall = [r["wall"] for r in builds["baseline"]]
    b_rss = [r["rss_mb"] for r in builds["build"]]
    r_rss = [r["rss_mb"] for r in builds["baseline"]]
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "builds": builds, "hashes": hashes, "latency": latency, "help_s": help_s,
        "targets": {
            "build_over_baseline_median <= 0.5": statistics.median(builds["ratios"]),
            "build_peak_rss_mb <= 1024": max(b_rss),
            "verify_hashes_gb_s >= 1 and >= sha256sum": [hashes["ours_gb_s"], hashes["sha256sum_gb_s"]],
            "mlirb_over_published <= 1.002": builds["mlirb_bytes"] / PUBLISHED_MLIRB,
            "help_s <= 0.5": help_s,
            **({"coreml_over_baseline_median <= 2.0": statistics.median(builds["coreml_ratios"]),
                "coreml_peak_rss_mb <= 1024": max(r["rss_mb"] for r in builds["coreml"])} if builds["coreml"] else {}),
        },
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"machine: {os.cpu_count()} CPUs, {platform.platform()}",
        "| measure | value | target |",
        "|---|---|---|",
        f"| build wall s (median of {len(b_wall)}) | {spread(b_wall)} | |",
        f"| baseline wall s | {spread(r_wall)} | |",
        f"| build / baseline, pair by pair (median) | {', '.join(f'{x:.2f}' for x in builds['ratios'])} "
        f"({statistics.median(builds['ratios']):.2f}) | median <= 0.5 |",
        f"| build peak RSS MB | {spread(b_rss)} | <= 1024 |",
        f"| baseline peak RSS MB | {spread(r_rss)} | |",
        "| build stages s (last run) | " + ", ".join(f"{k} {v:.2f}" for k, v in builds['build'][-1]['stages'].items()) + " | |",
        f"| verify-hashes sha256 GB/s (in-process) | {hashes['ours_gb_s']:.2f} | >= 1, >= sha256sum |",
        f"| sha256sum GB/s | {hashes['sha256sum_gb_s']:.2f} | |",
        f"| `clef-export verify-hashes` command s ({hashes['bytes'] / 1e6:.0f} MB) | {hashes['verify_hashes_command_s']:.2f} | |",
        f"| main.mlirb bytes | {builds['mlirb_bytes']:,} ({builds['mlirb_bytes'] / PUBLISHED_MLIRB:.6f} x published) | <= 1.002 x |",
        f"| `clef-export --help` s | {help_s:.2f} | <= 0.5 |",
    ]
    if builds["coreml"]:
        c_wall = [r["wall"] for r in builds["coreml"]]
        c_rss = [r["rss_mb"] for r in builds["coreml"]]
        lines += [
            f"| Core ML package build wall s, gate included (median of {len(c_wall)}) | {spread(c_wall)} | |",
            f"| Core ML build / baseline, pair by pair (median) | {', '.join(f'{x:.2f}' for x in builds['coreml_ratios'])} "
            f"({statistics.median(builds['coreml_ratios']):.2f}) | median <= 2.0 |",
            f"| Core ML build peak RSS MB | {spread(c_rss)} | <= 1024 |",
            "| Core ML build stages s (last run) | " + ", ".join(f"{k} {v:.2f}" for k, v in builds['coreml'][-1]['stages'].items())
            + " | |",
        ]
    if latency:
        for name in latency["coreai_cpu_s"]:
            lines.append(f"| {name} latency s: Core AI CPU / eager torch | {latency['coreai_cpu_s'][name]:.2f} / {latency['eager_torch_s'][name]:.3f} | info |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
