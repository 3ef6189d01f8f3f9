"""Export of ``VisionTower``: one ``torch.export`` with a dynamic patch count (P = merge^2 * n),
lowered in one trace (``engine.lowered``), converted with the engine's resource hooks, one static
function per bucket (as the head's buckets), saved streamed. The weights are shared by every function
(one set of blobs) and never all in memory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from .contract import INPUT_ORDER, OUTPUT_NAMES, VisionConfig, function_name, input_shapes

DYNAMIC_ENTRY = "ndyn"


def example_args(cfg: VisionConfig, tokens: int):
    import torch

    shapes = input_shapes(cfg, tokens)
    dtypes = {"patches": torch.float32, "pos_weight": torch.float32}
    args = [torch.zeros(shapes[n], dtype=dtypes.get(n, torch.int32)) for n in INPUT_ORDER]
    args[-1][0] = shapes["patches"][0]
    return tuple(args)


def trace_groups(cfg: VisionConfig, buckets: tuple[int, ...], key_block: int) -> list[tuple[str, tuple[int, ...]]]:
    """Buckets whose patches attend in one key block share one trace with a dynamic patch count
    (specialised per bucket after converting); a larger bucket (key blocks: a loop over a static
    count) is traced on its own. Every function reads the same weight blobs."""
    plain = tuple(b for b in buckets if b * cfg.merge_unit <= key_block)
    groups = [(DYNAMIC_ENTRY, plain)] if len(plain) >= 2 else [(function_name(b), (b,)) for b in plain]
    return groups + [(function_name(b), (b,)) for b in buckets if b * cfg.merge_unit > key_block]


def trace(module, cfg: VisionConfig, buckets: tuple[int, ...], log: Callable[[str], None] = lambda m: None):
    """The exported, decomposed program of one trace group: a dynamic patch count over its buckets
    (one bucket: static)."""
    from torch.export import Dim

    from ..engine.lowered import export_lowered

    dynamic = None
    if len(buckets) > 1:
        n = Dim("n", min=min(buckets), max=max(buckets))
        p = cfg.merge_unit * n
        dynamic = {"patches": {0: p}, "pos_index": {0: p}, "pos_weight": {0: p}, "patch_rc": {0: p}, "patch_count": None}
    what = f"{cfg.depth} blocks for {', '.join(function_name(b) for b in buckets)}"
    return export_lowered(module, example_args(cfg, max(buckets)), dynamic, log, what)


def _specialise(program, cfg: VisionConfig, buckets: tuple[int, ...]) -> None:
    """One static function per bucket from the dynamic graph, named ``n<N>`` (``aimodel.specialise``)."""
    from ..formats.aimodel import specialise

    shapes = {b: input_shapes(cfg, b) for b in buckets}
    specialise(program, DYNAMIC_ENTRY, {b: {n: s[n] for n in INPUT_ORDER if n != "patch_count"} for b, s in shapes.items()},
               function_name)


def convert(programs: list[tuple[str, tuple[int, ...], object]], cfg: VisionConfig,
            streamed: dict[int, tuple[str, int]], log: Callable[[str], None] = lambda m: None):
    """One converter, one entrypoint per trace group ``(entry, buckets, exported program)``; the
    dynamic one specialised per bucket."""
    from ..engine.converter import Entry
    from ..engine.converter import convert as convert_entries

    def specialise(program) -> None:
        for entry, buckets, _ep in programs:
            if entry == DYNAMIC_ENTRY:
                _specialise(program, cfg, buckets)

    entries = [Entry(entry, ep, INPUT_ORDER, OUTPUT_NAMES) for entry, _buckets, ep in programs]
    return convert_entries(entries, log, streamed=streamed, specialise=specialise)


def export_job(job: dict, log: Callable[[str], None]) -> dict:
    """The worker's vision job: weights mapped, traced once, converted, specialised, saved."""
    from ..engine.converter import save_filled
    from ..engine.streamed_weights import load_weights, trim_freed_memory
    from ..errors import ToolchainError
    from ..formats.aimodel import import_toolchain
    from .contract import weight_names
    from .graph import VisionTower

    import_toolchain()
    source, asset_dir = Path(job["source"]), Path(job["asset_dir"])
    cfg = VisionConfig(**job["vision_config"])
    buckets = tuple(int(b) for b in job["buckets"])
    t0 = time.perf_counter()
    log("laying out the tower's weights as fp16")
    stream = job.get("stream", True)  # False: every value laid out before converting (tests)
    weights = load_weights(source, weight_names(cfg), asset_dir.parent, log, scaled=job["compute"] == "fp32",
                           streamed=stream)
    tensors = weights.tensors()
    module = VisionTower(cfg, tensors, job["compute"], exponents=weights.exponents)
    streamed = {tensors[n].data_ptr(): (n, tensors[n].numel() * 2) for n in weights.streamed}
    trim_freed_memory()
    t_weights = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        programs = [(entry, group, trace(module, cfg, group, log)) for entry, group in trace_groups(cfg, buckets, module.key_block)]
        t_trace = time.perf_counter() - t0
        t0 = time.perf_counter()
        program, made = convert(programs, cfg, streamed, log)
        t_convert = time.perf_counter() - t0
    except (ValueError, RuntimeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ToolchainError(f"export of the vision tower failed: {type(exc).__name__}: {first}") from exc
    del programs, module, tensors
    t0 = time.perf_counter()
    save_filled(program, asset_dir, job["description"], log, made, supply=weights.stream)
    t_save = time.perf_counter() - t0
    fp16_bytes = weights.fp16_bytes
    weights.close()
    return {"weights": t_weights, "trace": t_trace, "convert": t_convert, "save": t_save,
            "weight_fp16_bytes": fp16_bytes, "scaled_tensors": sum(1 for k in weights.exponents.values() if k)}
