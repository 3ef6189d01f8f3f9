"""Export of ``VisionTower``: one ``torch.export`` with a dynamic patch count (P = merge^2 * n) and
coreai-torch's decompositions in the same trace (``backbone.export.export_lowered``) -> one
coreai-torch converter (the backbone's resource hooks: matrices as placeholders filled when
``main.mlirb`` is written) -> one static function per bucket (``set_static_shape_config``, as
the head's buckets) -> a streamed save (``mlirb.inflate``).

The weights are shared by every function (one set of blobs), and never all in memory: the release's
bf16 matrices are converted to fp16 straight into ``main.mlirb`` (``backbone.weights``).
"""

from __future__ import annotations

import contextlib
import os
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

    from ..backbone.export import export_lowered

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
    """One converter, one entrypoint per trace group ``(entry, buckets, exported program)``."""
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    from ..backbone.export import Resources, constants_from_buffers
    from ..formats.aimodel import deterministic_naming

    t0 = time.perf_counter()
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            constants_from_buffers(streamed) as hooked:
        converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
        for entry, _buckets, ep in programs:
            converter.add_exported_program(ep, input_names=list(INPUT_ORDER), output_names=list(OUTPUT_NAMES),
                                           entrypoint_name=entry)
        program = converter.to_coreai()
        for entry, buckets, _ep in programs:
            if entry == DYNAMIC_ENTRY:
                _specialise(program, cfg, buckets)
    made = hooked or Resources()
    strip_debug_info(program)  # source locations would embed this machine's paths
    if streamed and len(set(made.streamed.values())) != len(streamed):
        missing = sorted(set(n for n, _ in streamed.values()) - set(n for n, _ in made.streamed.values()))
        raise RuntimeError(f"the converter did not take {missing[0]} as the tensor it was given"
                           + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return program, made


def export_job(job: dict, log: Callable[[str], None]) -> dict:
    """The worker's vision job: weights mapped, traced once, converted, specialised, saved."""
    from ..backbone.weights import load_weights, release_freed_memory
    from ..errors import ToolchainError
    from ..formats.aimodel import import_toolchain, save
    from ..formats.mlirb import MissingPlaceholders
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
    release_freed_memory()
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
    fill = None
    if made.streamed:
        fill = ({tag: size for tag, (_, size) in made.streamed.items()}, lambda tag: weights.stream(made.streamed[tag][0]))
    try:
        save(program, asset_dir, job["description"], log, fill=fill)
    except MissingPlaceholders as exc:
        lost = sorted(made.streamed[k][0] for k in exc.keys)
        raise ToolchainError(f"{asset_dir}: the compiler folded or inlined {lost[0]}"
                             + (f" (+{len(lost) - 1} more)" if len(lost) > 1 else "") + "; its bytes would be lost") from None
    t_save = time.perf_counter() - t0
    fp16_bytes = weights.fp16_bytes
    weights.close()
    return {"weights": t_weights, "trace": t_trace, "convert": t_convert, "save": t_save,
            "weight_fp16_bytes": fp16_bytes, "scaled_tensors": sum(1 for k in weights.exponents.values() if k)}
