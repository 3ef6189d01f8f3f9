"""The vision tower's gate: a finished vision bundle against the release it was built from.

How it works: docs/modules.md."""

from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import UsageError
from ..interrupts import run_async
from ..progress import plural
from ..report import GateConfig
from .rows import RowsReport, asset_facts_of, core_ai_schema, source_of  # noqa: F401 (source_of: gate.MODELS' entry)
from ..vision.bundle import check_files

TOLERANCES: dict[str, dict[str, tuple[float, str]]] = {
    "fp32": {
        "rel_max_abs_d": (1e-4, "fp32 compute on fp16 weights that hold the bf16 values exactly (scaled by powers of two): "
                                "only accumulation order differs; measured 1e-6 on the tiny tower, 2.5e-5 at real shape "
                                "(448^2, 27 blocks); the raster-order red arm is far above"),
        "min_row_cosine": (0.999999, "every image row points the same way as the reference's to fp32 accumulation noise"),
    },
    "fp16": {
        "rel_max_abs_d": (3e-2, "fp16 matmuls and activations (4.9e-4 a rounding) through every block, LayerNorm and softmax "
                                "in fp32: measured 6.3e-3 to 9.5e-3 on the tiny tower (the patch embedding's 1,536-term sums "
                                "in fp16); the raster-order red arm is 1.4"),
        "min_row_cosine": (0.999, "row direction to fp16 rounding (measured 0.99994 on the tiny tower)"),
    },
}
RED_ARMS = ("raster_order",)


def tolerances(compute: str) -> dict[str, dict[str, Any]]:
    return {k: {"bar": v[0], "reason": v[1]} for k, v in TOLERANCES[compute].items()}


@dataclass(frozen=True)
class VisionVerifyConfig(GateConfig):
    seed: int = 0
    all_buckets_max_parameters: int = 50_000_000
    numeric_max_parameters: int = 2_000_000_000
    red: bool = True
    scratch: Path | None = None
    pins: Any = None
    checked: dict[str, str] | None = None
    located: dict[str, Any] | None = None


@dataclass
class ImageResult:
    name: str  # the image, e.g. "n256 640x384"
    function: str
    tokens: int
    rel_max_abs_d: float
    min_row_cosine: float
    arm: str = "main"


@dataclass
class VisionReport(RowsReport):
    TOLERANCES: ClassVar = TOLERANCES
    NOUN: ClassVar = "image"

    def title(self) -> str:
        return f"verify {self.bundle} (vision tower, compute {self.compute})"

    def columns(self) -> list[str]:
        return ["image", "function", "tokens", "rel max |d|", "min row cosine"]

    def rows(self):
        out = []
        for r in self.results:
            out.append(([r.name if r.arm == "main" else f"{r.name} (red: {r.arm})", r.function, str(r.tokens),
                         f"{r.rel_max_abs_d:.2e}", f"{r.min_row_cosine:.7f}"], self.verdict(r)))
        return out

    def headline(self) -> str:
        main = self.main_results()
        if not main:
            return self.checks_headline()
        red = self.red_results()
        return (f"{plural(len(main), 'image')}, rel max |d| {max(r.rel_max_abs_d for r in main):.2e} (bar "
                f"{self.bars()['rel_max_abs_d']:g}); red arms " + ", ".join(f"{r.arm} {r.rel_max_abs_d:.2g}" for r in red))

    def summary(self) -> dict[str, Any]:
        main = self.main_results()
        return {"ok": self.ok, "compute": self.compute,
                "images": {r.name: {"function": r.function, "tokens": r.tokens, "rel_max_abs_d": r.rel_max_abs_d,
                                    "min_row_cosine": r.min_row_cosine} for r in main},
                "red": {r.arm: r.rel_max_abs_d for r in self.red_results()},
                "bars": self.bars(), "checks": {n: ok for n, ok, _ in self.checks}, "failures": self.failures,
                "notes": self.notes}


def gate_grid(bucket: int, below: int, min_tokens: int) -> tuple[int, int]:
    """A merged grid (H, W), H < W, whose tokens fill the bucket (more than the bucket below it and at
    least the processor's smallest image): the image the gate sends to that function."""
    for w in range(int(math.sqrt(bucket * 5 / 3)), bucket + 1):
        h = bucket // w
        if 0 < h < w and h * w > below and h * w >= min_tokens:
            return h, w
    raise UsageError(f"bucket {bucket}: no non-square grid of more than {below} tokens fits it")


def raster_order(patches: np.ndarray, grid) -> np.ndarray:
    """The red arm's patches: the same patches in raster order instead of merge-block order."""
    from ..vision.host import block_order

    rows, cols = block_order(grid)
    raster = np.empty_like(patches)
    raster[rows * grid.cols + cols] = patches
    return raster


def reference_tower(source: Path, infos: dict[str, Any]):
    """transformers' ``Qwen3_5VisionModel`` in fp32 on the release's tower weights, holding one
    block's weights at a time (as ``backbone.reference.StreamedTextModel`` does the decoder's): built
    on the meta device, the patch embedding and position table read now, each block's and the
    merger's tensors read by a pre-hook (bf16 -> fp32, exact) and dropped after. 1.8 GB of fp32
    weights at real shape become about 0.1 GB plus the activations. Everything else is
    transformers' forward as it is."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from transformers.utils import logging as hf_logging

    from ..engine.streamed_weights import read_f32
    from ..vision.contract import VISUAL

    hf_logging.set_verbosity_error()
    conf = AutoConfig.from_pretrained(source).vision_config
    with torch.device("meta"):
        model = Qwen3_5VisionModel._from_config(conf, dtype=torch.float32)

    def load(module, prefix: str) -> None:
        for name, _ in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            t = infos[f"{VISUAL}{prefix}{name}"]
            value = torch.from_numpy(read_f32(source, t))
            (module.get_submodule(owner) if owner else module)._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)

    def drop(module) -> None:
        for name, p in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            (module.get_submodule(owner) if owner else module)._parameters[attr] = torch.nn.Parameter(
                torch.empty(p.shape, device="meta"), requires_grad=False)

    load(model.patch_embed, "patch_embed.")
    load(model.pos_embed, "pos_embed.")
    for prefix, module in [(f"blocks.{i}.", b) for i, b in enumerate(model.blocks)] + [("merger.", model.merger)]:
        module.register_forward_pre_hook(lambda mod, args, prefix=prefix: load(mod, prefix))
        module.register_forward_hook(lambda mod, args, out: drop(mod))
    # the rotary's inverse frequencies, built at init on the meta device: computed again
    rope = model.rotary_pos_emb
    inv, _ = rope.compute_axial_rope_parameters(conf)
    rope.inv_freq = inv
    rope.original_inv_freq = inv.clone()
    return model.eval()


def processor_patches(source: Path, image) -> np.ndarray:
    """transformers' own image processor on ``image`` (the PIL backend: no torchvision here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..sources.image_processor import image_processor_settings

    raw, _where = image_processor_settings(Path(source))
    keep = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Qwen2VLImageProcessorPil(**keep)(images=[image], return_tensors="np")["pixel_values"]


def verify_vision(cfg: VisionVerifyConfig, log=lambda msg: None) -> VisionReport:
    import torch
    from PIL import Image

    from ..engine.asset_readback import compare
    from ..engine.streamed_weights import locate
    from ..provenance import tool_versions
    from ..vision.contract import VisionConfig, function_name, read_preprocessing, weight_names
    from ..vision.runtime import runner
    from ..vision.preprocess import pixel_patches
    from .backbone import _compare, release_of

    t_start = time.perf_counter()
    m, asset, checks = check_files(cfg.bundle)
    pins, source = release_of(cfg, m, checks)
    vcfg = VisionConfig(**m.tower.vision_config)
    pre = read_preprocessing(source, vcfg)
    compute = m.export.compute
    infos = cfg.located or locate(source, weight_names(vcfg))
    weights = compare(asset / "main.mlirb", source, infos, scaled=compute == "fp32", log=log)
    checks.extend(weights.checks())
    params = m.tower.parameters
    buckets = list(m.interface.buckets)
    notes: list[str] = []
    results: list[ImageResult] = []
    if params > cfg.numeric_max_parameters:
        notes.append(f"numeric check not run: {params:,} parameters exceed numeric_max_parameters "
                     f"({cfg.numeric_max_parameters:,}); fp16 compute on the Linux CPU runtime is too slow at this size")
    else:
        run_on = buckets if params <= cfg.all_buckets_max_parameters else buckets[:1]
        if run_on != buckets:
            notes.append(f"numeric check on {run_on[0]} only: {params:,} parameters exceed all_buckets_max_parameters "
                         f"({cfg.all_buckets_max_parameters:,}); every function shares the weights and the graph")
        rng = np.random.default_rng([cfg.seed, 31])
        cases = []  # (name, bucket, grid, patches, arm)
        same = True
        for i, b in enumerate(run_on):
            h, w = gate_grid(b, buckets[buckets.index(b) - 1] if buckets.index(b) else 0, pre.min_tokens)
            side = pre.factor
            image = Image.fromarray(rng.integers(0, 256, (h * side, w * side, 3), dtype=np.uint8))
            px, grid = pixel_patches(image, pre)
            same &= np.array_equal(px, processor_patches(source, image))
            cases.append((f"{w * side}x{h * side}", b, grid, px, "main"))
        checks.append(("host patches = transformers' image processor (bit for bit)", bool(same),
                       f"{plural(len(cases), 'image')}, {', '.join(c[0] for c in cases)}"))
        if cfg.red:
            name, b, grid, px, _ = cases[0]
            cases.append((name, b, grid, raster_order(px, grid), RED_ARMS[0]))
        log("gate: reference, transformers' Qwen3_5VisionModel in fp32")
        ref = reference_tower(source, infos)
        wants = {}
        with torch.no_grad():
            for name, b, grid, px, arm in cases:
                if arm == "main":
                    thw = torch.tensor([[1, grid.rows, grid.cols]])
                    wants[name] = ref(torch.from_numpy(px), thw).pooler_output.float().numpy()
        del ref
        gc.collect()

        async def run_all():
            out = []
            async with runner(asset, vcfg, cfg.scratch) as (call, have):
                missing = [f.name for f in m.interface.functions if f.name not in have]
                checks.append(("functions = manifest", not missing,
                               f"{', '.join(sorted(have))}" + (f"; missing {missing[0]}" if missing else "")))
                for name, b, grid, px, arm in cases:
                    if function_name(b) not in have:  # a failed check above: the other functions still run
                        continue
                    t0 = time.perf_counter()
                    got, c = await call(px, grid, b)
                    out.append((name, c, arm, got, time.perf_counter() - t0))
            return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = run_async(run_all)
        for name, call, arm, got, secs in runs:
            rel, cos = _compare(got, wants[name])
            results.append(ImageResult(name=name, function=call.function, tokens=call.grid.tokens, rel_max_abs_d=rel,
                                       min_row_cosine=cos, arm=arm))
            log(f"{call.function} {name} ({plural(call.grid.tokens, 'token')})" + ("" if arm == "main" else f" red {arm}")
                + f": rel max |d| {rel:.2e}, min row cosine {cos:.7f} ({secs:.1f} s)")
    transcript = {"bundle": str(cfg.bundle), "compute": compute, "source": {"hf_id": pins.hf_id, "revision": pins.revision},
                  "bars": tolerances(compute), "seed": cfg.seed,
                  "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
                  "images": [r.__dict__ for r in results], "notes": notes, "versions": tool_versions(),
                  "seconds": time.perf_counter() - t_start}
    report = VisionReport(bundle=Path(cfg.bundle), compute=compute, results=results, checks=checks, transcript=transcript,
                          notes=notes, red_arms=RED_ARMS if cfg.red and results else ())
    transcript["ok"], transcript["failures"] = report.ok, report.failures
    return report


# ---------------------------------------------------------------- the gate stage's entry (gate.MODELS)

KIND = "vision-tower"
MODEL = "vision"
OPTIONS = ("--red", "--seed")
FIXED_RECORDS = "runs one seeded image of a non-square aspect per bucket"


def manifest_of(bundle: Path):
    return check_files(bundle)[0]


def run(opts, manifest, pins_path: Path, log=lambda msg: None) -> VisionReport:
    return verify_vision(VisionVerifyConfig(bundle=opts.bundle, source=opts.source, pins_path=pins_path, seed=opts.seed),
                         log=log)


def inspect(bundle: Path) -> dict[str, Any]:
    from ..formats import aimodel

    m, asset, _ = check_files(bundle)
    return {"name": m.name, "kind": m.kind, "format": aimodel.FORMAT, "weights": m.export.weights,
            "compute": m.export.compute, "asset_bytes": m.export.aimodel_bytes, "main_mlirb": m.export.main_mlirb.model_dump(),
            "source": {"hf_id": m.source.hf_id, "revision": m.source.revision},
            "tower": {"parameters": m.tower.parameters, "out_hidden_size": m.tower.out_hidden_size,
                      "cap_tokens": m.interface.cap_tokens},
            "functions": [{"name": f.name,
                           "inputs": [{"name": n, "shape": s.shape, "dtype": s.dtype} for n, s in f.inputs.items()],
                           "outputs": [{"name": n, "shape": s.shape, "dtype": s.dtype} for n, s in f.outputs.items()]}
                          for f in m.interface.functions]}


def asset_facts(bundle: Path) -> tuple[str, str, str]:
    return asset_facts_of(check_files(bundle))


def schema(fmt: str | None = None) -> dict[str, Any]:
    from ..vision.manifest import json_schema

    return core_ai_schema(fmt, "a vision bundle", json_schema)
