"""``build`` of a vision recipe: plan -> staged bundle -> export worker -> manifest -> build record
-> gate -> rename into place.

How it works: docs/modules.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from ..bundle import check_free_space
from ..digest import tree_bytes
from ..errors import IntegrityError
from ..formats import aimodel
from ..manifest import Compilation, TensorSpec, mlirb_digest, release_source
from ..sources.pinning import BACKBONE_CONFIG
from ..sources.safetensors import INDEX_FILE, shard_files
from ..provenance import asset_description, build_date
from ..sources.pinned_files import check_pinned, verify_files
from ..engine.streamed_weights import locate, scratch_bytes
from ..sources.image_processor import image_processor_settings, processor_files
from ..vision.contract import (INPUT_ORDER, KIND, OUTPUT_NAMES, VisionConfig, function_name, input_dtypes, input_shapes,
                               read_preprocessing, read_vision_config, weight_names)
from ..vision.manifest import (HOST_CALL, METADATA_VERSION, PREPROCESS_RULE, Function, Preprocess, Tower, VisionExport,
                               VisionInterface, VisionManifest)
from ..gate.vision import VisionVerifyConfig, tolerances, verify_vision

from .config import BuildConfig, Made, BuildPlan, refuse_head_options, resolve_output
from .core_ai import asset_outputs, export_seconds, made
from .process import run_export_hashing

MODEL = "vision"
SHIPS_LM_HEAD_TABLE = False
MARGIN = 64 << 20


@dataclass(frozen=True)
class Found:
    """What a vision build's plan found: the tower's and the processor's configuration, the located tensors."""

    vision: VisionConfig
    preprocess: Any  # vision.contract.Preprocessing
    infos: dict[str, Any]  # name -> engine.streamed_weights.TensorInfo
    parameters: int


def compiles(recipe) -> bool:
    return False


def read_files(source: Path) -> list[str]:
    """Every file of the release a vision build reads: config, preprocessor config, index, shards."""
    names = [BACKBONE_CONFIG, *processor_files(source)]
    if (source / INDEX_FILE).is_file():
        names.append(INDEX_FILE)
    return names + shard_files(source)


def refuse(cfg: BuildConfig) -> None:
    """Options a vision build cannot take: exit 2 naming the option and the model."""
    refuse_head_options(cfg, "a vision tower", "a vision bundle", "one seeded image of a non-square aspect per bucket")


def plan(cfg: BuildConfig, log=lambda m: None, defer: bool = False) -> BuildPlan:
    recipe = cfg.recipe
    pins, final, source = resolve_output(cfg)
    if not source.is_dir():
        raise IntegrityError(f"{source}: source folder not found")
    names = read_files(source)
    if not (source / BACKBONE_CONFIG).is_file():
        raise IntegrityError(f"{source / BACKBONE_CONFIG}: missing (a vision build reads the tower's configuration and "
                             f"its image processor's)")
    image_processor_settings(source)  # either layout; missing or two that disagree: refused before hashing
    later = [n for n in shard_files(source) if n in names] if defer else []
    check_pinned(source, pins, cfg.pins_path, later)
    digests = verify_files(source, pins, cfg.pins_path, [n for n in names if n not in later], log)
    vcfg = read_vision_config(source)
    pre = read_preprocessing(source, vcfg)
    if recipe.buckets[0] < pre.min_tokens:
        log(f"note: bucket {recipe.buckets[0]} is below the processor's smallest image ({pre.min_tokens} tokens)")
    infos = locate(source, weight_names(vcfg))
    fp16 = scratch_bytes(infos)
    parameters = sum(math.prod(t.shape) for t in infos.values())
    check_free_space(final.parent, fp16 * 3 + MARGIN, "the vision build (main.mlirb and the gate's compiled fp32 copy)")
    info = {"recipe": str(cfg.recipe_path), "name": final.name, "model": MODEL, "bundle": str(final),
            "source": str(source), "hf_id": pins.hf_id, "revision": pins.revision, "synthetic": pins.synthetic,
            "files": digests, "deferred": later, "functions": [function_name(b) for b in recipe.buckets],
            "buckets": list(recipe.buckets), "cap_tokens": recipe.cap, "weights": recipe.weights,
            "compute": recipe.compute, "parameters": parameters, "weight_fp16_bytes": fp16,
            "vision_config": vcfg.as_dict(), "preprocess": pre.as_dict()}
    return BuildPlan(cfg=cfg, pins=pins, source=source, bundle=final, files=digests, info=info, deferred=later,
                found=Found(vision=vcfg, preprocess=pre, infos=infos, parameters=parameters))


def interface(vcfg: VisionConfig, buckets: tuple[int, ...], compute: str) -> VisionInterface:
    out = "fp32" if compute == "fp32" else "fp16"
    dtypes = input_dtypes()
    fns = [Function(name=function_name(b), tokens=b, patches=b * vcfg.merge_unit,
                    inputs={n: TensorSpec(shape=list(s), dtype=dtypes[n]) for n, s in input_shapes(vcfg, b).items()},
                    outputs={OUTPUT_NAMES[0]: TensorSpec(shape=[b, vcfg.out_hidden_size], dtype=out)}) for b in buckets]
    return VisionInterface(input_order=list(INPUT_ORDER), functions=fns, buckets=list(buckets), cap_tokens=buckets[-1],
                           host_call=HOST_CALL)


def export(p: BuildPlan, tmp: Path, log=lambda m: None) -> Made:
    recipe, pins, source = p.cfg.recipe, p.pins, p.source
    vcfg, pre = p.found.vision, p.found.preprocess
    asset_dir = tmp / f"{p.bundle.name}{aimodel.SUFFIX}"
    job = {"model": MODEL, "source": str(source), "asset_dir": str(asset_dir), "vision_config": vcfg.as_dict(),
           "buckets": list(recipe.buckets), "compute": recipe.compute,
           "description": {**asset_description(pins), "description": f"Qwen3.5 vision tower of {pins.label}, "
                           f"buckets {list(recipe.buckets)} tokens, weights {recipe.weights}, compute {recipe.compute}"}}
    timings = run_export_hashing(p, asset_dir, job, read_files(source), log)
    outputs = asset_outputs(asset_dir)
    mlirb = asset_dir / "main.mlirb"
    seconds = export_seconds(timings)
    fp16 = int(timings["weight_fp16_bytes"])
    manifest = VisionManifest(
        metadata_version=METADATA_VERSION, kind=KIND, name=p.bundle.name, assets={"main": asset_dir.name},
        tower=Tower(vision_config=vcfg.as_dict(), out_hidden_size=vcfg.out_hidden_size, parameters=p.found.parameters),
        preprocess=Preprocess(**pre.as_dict(), rule=PREPROCESS_RULE),
        interface=interface(vcfg, recipe.buckets, recipe.compute),
        source=release_source(pins, p.files),
        export=VisionExport(weights=recipe.weights, compute=recipe.compute, aimodel_bytes=tree_bytes(asset_dir),
                            main_mlirb=mlirb_digest(asset_dir, outputs),
                            weight_fp16_bytes=fp16, mlirb_over_weights=round(mlirb.stat().st_size / max(fp16, 1), 6),
                            seconds=seconds, tolerances=tolerances(recipe.compute)),
        compilation=Compilation(date=build_date(), targets=[]),
    )
    return made(p, tmp, manifest, outputs, vcfg.out_hidden_size,
                {"model": MODEL, "vision_config": vcfg.as_dict(), "seconds": seconds,
                 "scaled_tensors": int(timings.get("scaled_tensors", 0))}, seconds)


def gate(p: BuildPlan, tmp: Path, log=lambda m: None):
    recipe = p.cfg.recipe
    log("verifying the saved vision tower against transformers' Qwen3_5VisionModel")
    return verify_vision(VisionVerifyConfig(bundle=tmp, source=p.source, pins_path=p.cfg.pins_path, seed=recipe.verify.seed,
                                            all_buckets_max_parameters=recipe.verify.all_buckets_max_parameters,
                                            numeric_max_parameters=recipe.verify.numeric_max_parameters,
                                            scratch=tmp, pins=p.pins, checked=p.files, located=p.found.infos), log=log)


def summary(manifest) -> str:
    e, i = manifest.export, manifest.interface
    return (f"main.mlirb {e.main_mlirb.bytes:,} bytes ({e.mlirb_over_weights:.4f} x the fp16 weights), "
            f"{len(i.functions)} functions {', '.join(f.name for f in i.functions)} (cap {i.cap_tokens} tokens)")


def export_job(job: dict, log) -> dict:
    from ..vision.export import export_job as run

    return run(job, log)
