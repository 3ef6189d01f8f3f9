"""The head's Core AI backend (macOS 27), the published format: ``ClefHeadGraph`` traced per group
(one dynamic-T trace for the single-block buckets, one static trace for t4096), one converter, the
dynamic function specialised per bucket, saved by ``formats.aimodel``. The manifest is the published
one, key for key."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from ..digest import tree_bytes
from ..formats.aimodel import (  # noqa: F401 (the backend's functions: one module per format)
    AOT, FORMAT, HASH, MLIRB, NAMING_SEED, SUFFIX, cannot_run, check_files, deterministic_naming, describe,
    import_toolchain, needs_decomposition, runner, save, specialise,
)
from ..manifest import Aot, Compilation, FileDigest, Head, Seconds, Strict
from . import contract

RECIPE = "head_bucket_fp16w32.toml"  # in conversion/: what `build --format aimodel` builds
SCHEMA_FILE = "metadata.schema.json"


DYNAMIC_ENTRY = "tdyn"


class ExportAttempt(Strict):
    externalize: str
    ok: bool
    seconds: float


class Export(Strict):
    aimodel_bytes: int = Field(ge=0)
    main_mlirb: FileDigest
    seconds: Seconds
    export_attempts: list[ExportAttempt]


class Manifest(Strict):
    """``metadata.json`` of a Core AI bundle: the published manifest, key for key."""

    metadata_version: str
    kind: str
    name: str
    assets: dict[str, str]
    head: Head
    export: Export
    aot: Aot | None
    compilation: Compilation


def manifest(common: dict[str, Any], recipe, asset_dir: Path, outputs: dict[str, str], seconds: Seconds) -> Manifest:
    """The published manifest's shape; ``outputs`` are the digests already taken (relative to the
    bundle), so nothing is hashed twice."""
    mlirb = asset_dir / MLIRB
    return Manifest(
        **common,
        export=Export(
            aimodel_bytes=tree_bytes(asset_dir),
            main_mlirb=FileDigest(bytes=mlirb.stat().st_size, sha256=outputs[f"{asset_dir.name}/{MLIRB}"]),
            seconds=seconds,
            export_attempts=[ExportAttempt(externalize="no externalize specs", ok=True, seconds=seconds.export)],
        ),
    )


def record_parameters() -> dict[str, Any]:
    """What the build record says about how this backend made its bytes reproducible."""
    return {"naming_seed": NAMING_SEED, "resource_names": "w_<sha256 of the blob's bytes, 20 hex>"}


def asset_digest(m: Manifest) -> str:
    return m.export.main_mlirb.sha256


def sizes(m: Manifest) -> dict[str, int]:
    return {"asset_bytes": m.export.aimodel_bytes, "main_mlirb_bytes": m.export.main_mlirb.bytes}


def summary(m: Manifest) -> str:
    return f"main.mlirb {m.export.main_mlirb.bytes:,} bytes"


def trace_program(graph, buckets: tuple[int, ...], hidden_size: int, q_pad: int, o_pad: int):
    """``torch.export`` (static T, or dynamic T over ``buckets``), decomposed only if coreai needs it."""
    from .tracing import export_graph

    ep = export_graph(graph, buckets, hidden_size, q_pad, o_pad)
    if needs_decomposition(ep):  # ClefHeadGraph is written in ops coreai lowers directly: never, so far
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = ep.run_decompositions(import_toolchain().get_decomp_table())
    return ep


def _specialise(program, buckets: tuple[int, ...], hidden_size: int, q_pad: int, o_pad: int) -> None:
    """One static function per bucket from the dynamic-T graph, named like the rest (t512 …)."""
    from .tracing import T_AXES

    shapes = {b: contract.input_shapes(b, hidden_size, q_pad, o_pad) for b in buckets}
    specialise(program, DYNAMIC_ENTRY, {b: {n: s[n] for n in T_AXES} for b, s in shapes.items()}, contract.function_name)


def convert(graph, recipe, hidden_size: int, asset_dir: Path, log: Callable[[str], None] = lambda msg: None):
    """One converter, one entrypoint per trace group: the optimized multi-function program with one
    function per bucket. Not under ``inference_mode``: torch.export traces twice as fast without it."""
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    from .tracing import trace_groups

    import_toolchain()
    converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
    dynamic: tuple[int, ...] = ()
    for kind, buckets in trace_groups(recipe.buckets):
        names = ", ".join(contract.function_name(b) for b in buckets)
        log(f"tracing {names}" + (" (one trace, dynamic T)" if kind == "dynamic" else ""))
        ep = trace_program(graph, buckets, hidden_size, recipe.q_pad, recipe.o_pad)
        entry = DYNAMIC_ENTRY if kind == "dynamic" else contract.function_name(buckets[0])
        dynamic = buckets if kind == "dynamic" else dynamic
        converter.add_exported_program(ep, input_names=list(contract.INPUT_ORDER),
                                       output_names=list(contract.OUTPUT_NAMES), entrypoint_name=entry)
    log("converting")
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        program = converter.to_coreai()
        if dynamic:
            _specialise(program, dynamic, hidden_size, recipe.q_pad, recipe.o_pad)
    strip_debug_info(program)  # source locations would embed this machine's paths
    return program


def read_back(asset: Path, m: Manifest, hidden_size: int, params: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Nothing beyond the files: the Core AI runtime runs the asset, which is the stronger check."""
    return []
