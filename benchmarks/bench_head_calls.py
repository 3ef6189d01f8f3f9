"""The head's cost per call at each function size (issue 59), measured on the Core AI runtime: one
bundle (or several) loaded once, each function called ``--calls`` times on a record of its full
size (every token, question and option real), the median said. Writes
``benchmarks/results/head-calls-<name>.json``; the figures choose which head a host runs
(docs/host.md, docs/performance.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_result import finish  # noqa: E402


def full_record(bucket: int, q_pad: int, o_pad: int, hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A record filling the function: ``bucket`` tokens, ``q_pad`` questions sharing ``o_pad`` options."""
    from clef_flash.head.contract import INPUT_ORDER

    rng = np.random.default_rng(seed)
    per = max(2, o_pad // q_pad)
    a = {
        "hidden": rng.standard_normal((bucket, hidden), dtype=np.float32),
        "key_valid": np.ones((bucket,), np.float32),
        "q_avg": np.zeros((q_pad, bucket), np.float32),
        "o_avg": np.zeros((o_pad, bucket), np.float32),
        "g_avg": np.zeros((1, bucket), np.float32),
        "lexical": rng.standard_normal((o_pad, hidden), dtype=np.float32),
        "member": np.zeros((q_pad, o_pad), np.float32),
        "type_ids": np.ones((q_pad,), np.int32),
        "q_valid": np.ones((q_pad,), np.float32),
        "o_valid": np.ones((o_pad,), np.float32),
    }
    a["g_avg"][0, -1] = 1.0
    for q in range(q_pad):
        a["q_avg"][q, q % bucket] = 1.0
        a["member"][q, q * per:(q + 1) * per] = 1.0
    for o in range(o_pad):
        a["o_avg"][o, (o * 7) % bucket] = 1.0
    return {k: a[k] for k in INPUT_ORDER}


async def measure(bundle: Path, calls: int) -> list[dict]:
    from clef_flash.gate.artifact import check_bundle
    from clef_flash.manifest import pads

    manifest, fmt, asset, _ = check_bundle(bundle)
    q_pad, o_pad = pads(manifest.head)
    hidden = int(manifest.head.inputs["hidden"].split(",")[1].split("]")[0])
    names = {b: name for name, b in manifest.head.buckets}
    rows = []
    async with fmt.runner(asset, sorted(names.values())) as call:
        for bucket in sorted(names):
            arrays = full_record(bucket, q_pad, o_pad, hidden)
            await call(names[bucket], arrays)  # the first call pays the function's load
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await call(names[bucket], arrays)
                times.append(time.perf_counter() - t0)
            rows.append({"bundle": bundle.name, "function": names[bucket], "tokens": bucket, "q_pad": q_pad,
                         "o_pad": o_pad, "median_s": statistics.median(times), "calls": calls})
            print(f"{bundle.name} {names[bucket]}: Q {q_pad} O {o_pad}: {statistics.median(times) * 1000:.1f} ms "
                  f"(median of {calls})", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--name", default="tiny")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for b in args.bundles:
        rows += asyncio.run(measure(b, args.calls))
    finish({"name": args.name, "rows": rows}, f"head-calls-{args.name}.json", [])


if __name__ == "__main__":
    main()
