"""`make crosscheck-coreai-opt`: our int8 / int4 per-block quantization against coreai-opt's own
(Apple's compression library, 0.3.0, pinned to the same coreai-core / coreai-torch), on the same
weights: the tiny release's decoder linears and a real-width 9B-shaped matrix of bf16 values.

coreai-opt is not a dependency (it pulls torchao into every process): the Makefile target installs
it with ``--no-deps`` into ``.cache/coreai-opt`` and runs this with that folder on ``PYTHONPATH``.
Its weight pass (``_compute_qparams_by_dtype``, symmetric, blocks of 32 along the input axis) is
called on each weight as fp32; then, per tensor: codes equal, scales equal after fp16 rounding, and
the largest difference of the two dequantized weights in steps of our scale.

Expected differences, each measured here: coreai-opt computes ``scale = (2 absmax + 1e-6) / 254``
(an epsilon, no floor) and the codes with that unrounded scale, then rounds the scale to the
weights' dtype; ours rounds the scale to fp16 first and computes the codes of the scale the asset
holds, and floors it at 2**-14. So a code can differ by one where a value lies within rounding of
half a step, and its dequantized value then by about one step; elsewhere they agree.
Writes ``benchmarks/results/crosscheck-coreai-opt.json``; exits 1 if a difference is not one of those.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def theirs(w: np.ndarray, bits: int):
    from coreai_opt.coreai_utils._coreai_imports import compression_types as ct
    from coreai_opt.coreai_utils._utils.quantize_utils import _compute_qparams_by_dtype
    from coreai_opt.coreai_utils.common import QScheme

    dtype = ct.int8 if bits == 8 else ct.int4
    q, s, _ = _compute_qparams_by_dtype(w, dtype, QScheme.SYMMETRIC, [1, 32])  # one scale per row and block of 32
    return q.astype(np.int8), s.astype(np.float32)


def compare(name: str, w: np.ndarray, bits: int) -> dict:
    from clef_flash.engine.quantize import Scheme, dequantize, quantize_np

    sch = Scheme(bits, 32)
    codes, scales = quantize_np(w, sch)
    q, s = theirs(w, bits)
    ours = dequantize(codes, scales, sch).astype(np.float32)
    other = (q.reshape(w.shape[0], -1, 32).astype(np.float32) * s.astype(np.float16).astype(np.float32)[..., None]).reshape(w.shape)
    step = np.repeat(scales.astype(np.float32), 32, axis=1)
    diff = np.abs(codes.astype(np.int16) - q.astype(np.int16))
    steps = np.abs(ours - other) / step
    # a differing code: the value within the scale's fp16 rounding (2**-11 relative, times the code) of half a step
    ratio = w / step
    near_half = np.abs(np.abs(ratio - np.trunc(ratio)) - 0.5) < 2.0 ** -10 * np.maximum(1.0, np.abs(ratio))  # fp16 scale rounding: 2**-11 relative
    # or in a block whose scale came out another fp16 value (their epsilon, their rounding of it after the codes)
    other_scale = np.repeat(s.astype(np.float16) != np.maximum(scales, np.float16(2.0 ** -14)), 32, axis=1)
    explained = bool(np.all(diff <= 1) and np.all((near_half | other_scale)[diff == 1]) and np.all(steps <= 1.1))
    return {"tensor": name, "bits": bits, "shape": list(w.shape), "codes_equal": float((diff == 0).mean()),
            "codes_off_by_one": int((diff == 1).sum()), "codes_off_by_more": int((diff > 1).sum()),
            "scales_equal_in_fp16": float((s.astype(np.float16) == np.maximum(scales, np.float16(2.0 ** -14))).mean()),
            "max_dequantized_diff_in_steps": float(steps.max()),
            "off_by_one_in_blocks_of_another_scale": int(((diff == 1) & other_scale).sum()),
            "off_by_one_at_half_steps": int(((diff == 1) & near_half & ~other_scale).sum()), "explained": explained}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True, help="the tiny release (its decoder linears)")
    a = ap.parse_args()
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.backbone.contract import compressed_names
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import as_f32, locate, raw_blocks

    cfg = read_text_config(a.tiny)
    infos = locate(a.tiny, weight_names(cfg))
    rows = []
    for bits in (8, 4):
        for n in compressed_names(weight_names(cfg), Scheme(bits, 32), ()):
            t = infos[n]
            w = np.concatenate([as_f32(raw, t.dtype) for _, _, raw in raw_blocks(a.tiny, t)]).reshape(t.shape)
            rows.append(compare(n, w, bits))
        rng = np.random.default_rng(0)  # a 9B-shaped MLP matrix of bf16 values (std 0.02)
        w = (rng.standard_normal((1024, 4096)) * 0.02).astype(np.float32)
        w = ((w.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32)
        rows.append(compare("random [1024, 4096] bf16, std 0.02", w, bits))
    out = {"rows": rows, "all_explained": all(r["explained"] for r in rows)}
    path = ROOT / "benchmarks" / "results" / "crosscheck-coreai-opt.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    for bits in (8, 4):
        mine = [r for r in rows if r["bits"] == bits]
        print(f"int{bits}: {len(mine)} tensors; codes equal {min(r['codes_equal'] for r in mine):.6f} (worst tensor), "
              f"off by one {sum(r['codes_off_by_one'] for r in mine)} ({sum(r['off_by_one_in_blocks_of_another_scale'] for r in mine)} in blocks whose fp16 scale differs, "
              f"{sum(r['off_by_one_at_half_steps'] for r in mine)} at half steps), by more {sum(r['codes_off_by_more'] for r in mine)}; "
              f"scales equal in fp16 {min(r['scales_equal_in_fp16'] for r in mine):.6f}; dequantized apart by at most "
              f"{max(r['max_dequantized_diff_in_steps'] for r in mine):.3f} steps; explained: {all(r['explained'] for r in mine)}")
    print(f"wrote {path.relative_to(ROOT)}")
    sys.exit(0 if out["all_explained"] else 1)


if __name__ == "__main__":
    main()
