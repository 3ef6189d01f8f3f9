"""`make bench-vision`: the vision tower at real shape (issue 30), on a synthetic release with the
9B's tower (27 blocks, hidden 1152, 456,010,480 parameters, random bf16) beside a 4-layer text slice.

1. ``build conversion/vision_fp16w32.toml`` with its gate, watched as a process tree (wall, peak
   anonymous + shared memory, total RSS); main.mlirb against the fp16 weights; the gate's image
   (the smallest bucket, a 4:1 aspect) against transformers' tower, and the raster-order red arm;
2. one call per bucket (n64, n256, n1024) of the saved asset on the Linux CPU runtime, each on an
   image of a non-square aspect that fills the bucket, timed, with its rows against transformers'
   (``--buckets`` to run fewer: n1024 takes minutes);
3. ``--whole``: the whole image request at real width: the release's head bundle and its backbone
   (fp32 compute, image inputs; built without their gates, which ``bench-slice-int8`` and the head's
   own benchmarks cover) and ``check-release --vision`` on ``--whole-requests`` of the project's
   image requests, watched: tower + chunks + head against the author's systemone.

Writes ``benchmarks/results/vision-latest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from memwatch import watch  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"


def calls(bundle: Path, release: Path, buckets: list[int]) -> list[dict]:
    import numpy as np
    import torch
    from PIL import Image

    from clef_flash.engine.streamed_weights import locate
    from clef_flash.gate.backbone import _compare
    from clef_flash.gate.vision import gate_grid, reference_tower
    from clef_flash.vision.contract import VisionConfig, read_preprocessing, weight_names
    from clef_flash.vision.preprocess import pixel_patches
    from clef_flash.vision.runtime import runner

    m = json.loads((bundle / "metadata.json").read_text())
    cfg = VisionConfig(**m["tower"]["vision_config"])
    pre = read_preprocessing(release, cfg)
    all_buckets = m["interface"]["buckets"]
    rng = np.random.default_rng(7)
    cases = []
    for b in buckets:
        i = all_buckets.index(b)
        h, w = gate_grid(b, all_buckets[i - 1] if i else 0, pre.min_tokens)
        im = Image.fromarray(rng.integers(0, 256, (h * pre.factor, w * pre.factor, 3), dtype=np.uint8))
        px, grid = pixel_patches(im, pre)
        cases.append((b, grid, px))
    ref = reference_tower(release, locate(release, weight_names(cfg)))
    wants = {}
    for b, grid, px in cases:
        t0 = time.perf_counter()
        with torch.no_grad():
            wants[b] = ref(torch.from_numpy(px), torch.tensor([[1, grid.rows, grid.cols]])).pooler_output.numpy()
        wants[(b, "s")] = time.perf_counter() - t0

    async def run():
        out = []
        t0 = time.perf_counter()
        async with runner(next(bundle.glob("*.aimodel")), cfg) as (call, _functions):
            load = time.perf_counter() - t0
            for b, grid, px in cases:
                t0 = time.perf_counter()
                got, c = await call(px, grid, b)
                secs = time.perf_counter() - t0
                rel, cos = _compare(got, wants[b])
                out.append({"function": c.function, "image": f"{grid.cols * pre.patch_size}x{grid.rows * pre.patch_size}",
                            "tokens": grid.tokens, "patches": grid.patches, "seconds": round(secs, 1),
                            "torch_eager_seconds": round(wants[(b, "s")], 1), "rel_max_abs_d": rel,
                            "min_row_cosine": cos, "load_seconds": round(load, 1)})
                print(out[-1], flush=True)
        return out

    return asyncio.run(run())


def whole(a, vision: Path) -> dict:
    work = a.work / "whole"
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    recipe = work / "backbone_img.toml"
    recipe.write_text('model = "backbone"\nname = "{release}_decode_fp16w32_pf64"\nchunk = 64\ncontext = 4096\n'
                      'weights = "fp16"\ncompute = "fp32"\nimage_rows = 1024\n')
    for key, r in (("head", ROOT / "conversion" / "head_bucket_fp16w32.toml"), ("backbone", recipe)):
        log = work / key
        with open(log.with_suffix(".out"), "wb") as o, open(log.with_suffix(".err"), "wb") as e:
            w = watch([str(EXE), "build", str(r), "--source", str(a.release), "--out", str(work), "--no-verify", "--json"],
                      0.05, o, e)
        if w["rc"]:
            raise SystemExit(f"{key} build failed: {log.with_suffix('.err').read_text()[-2000:]}")
        out[f"{key}_build"] = {"wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1)}
        out[f"{key}_bundle"] = str(work / json.loads(log.with_suffix(".out").read_text())["name"])
    lines = (ROOT / "conversion" / "requests-images.jsonl").read_text().splitlines()[: a.whole_requests]
    requests = ROOT / "conversion" / f".bench-whole-{a.whole_requests}.jsonl"  # beside images/: paths relative to it
    requests.write_text("\n".join(lines) + "\n")
    try:
        log = work / "check"
        with open(log.with_suffix(".out"), "wb") as o, open(log.with_suffix(".err"), "wb") as e:
            w = watch([str(EXE), "check-release", str(a.release), "--bundle", out["head_bundle"], "--backbone",
                       out["backbone_bundle"], "--vision", str(vision), "--requests", str(requests), "--json"], 0.05, o, e)
    finally:
        requests.unlink()
    out["check_release"] = {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
                            "peak_rss_mib": round(w["peak_rss_mib"], 1)}
    if w["rc"] in (0, 4):
        out["check_release"]["summary"] = json.loads(log.with_suffix(".out").read_text())
    else:
        out["check_release"]["stderr_tail"] = log.with_suffix(".err").read_text().splitlines()[-12:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-vision")
    ap.add_argument("--buckets", type=int, nargs="*", default=[64, 256, 1024])
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--whole-requests", type=int, default=2)
    ap.add_argument("--skip-build", type=Path, help="an already built vision bundle (skips 1 and 2)")
    a = ap.parse_args()
    if a.skip_build:
        result = {"release": str(a.release), "whole": whole(a, a.skip_build)}
        print(json.dumps(result, indent=2))
        (ROOT / "benchmarks" / "results" / "vision-whole-latest.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    result: dict = {"release": str(a.release)}
    log = a.work / "build"
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as errs:
        w = watch([str(EXE), "build", str(ROOT / "conversion" / "vision_fp16w32.toml"), "--source", str(a.release),
                   "--out", str(a.work / "out"), "--json"], 0.05, out, errs)
    row = {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
           "peak_rss_mib": round(w["peak_rss_mib"], 1), "per_process_peak_mib": w["per_process_peak_mib"]}
    if w["rc"] == 0:
        m = json.loads(log.with_suffix(".out").read_text())
        bundle = a.work / "out" / m["name"]
        record = json.loads((bundle / "build-record.json").read_text())
        row.update({"main_mlirb_bytes": m["export"]["main_mlirb"]["bytes"], "weight_fp16_bytes": m["export"]["weight_fp16_bytes"],
                    "mlirb_over_weights": m["export"]["mlirb_over_weights"], "export_seconds": m["export"]["seconds"],
                    "gate": record["verify"]})
        result["build"] = row
        result["calls"] = calls(bundle, a.release, a.buckets) if a.buckets else []
        if a.whole:
            result["whole"] = whole(a, bundle)
    else:
        row["stderr_tail"] = log.with_suffix(".err").read_text().splitlines()[-12:]
        result["build"] = row
    out = ROOT / "benchmarks" / "results" / "vision-latest.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if w["rc"] == 0 else 1)


if __name__ == "__main__":
    main()
