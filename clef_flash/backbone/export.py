"""Export of ``DecoderChunk``: ``torch.export`` (input_ids, a dynamic-length position_ids, the four
states as inputs updated in place) -> ``run_decompositions`` (conv1d, index_copy, softplus … are
not lowered otherwise) -> one coreai-torch converter, the states named -> ``to_coreai`` -> debug
locations stripped -> a streamed save (``save_streamed``).

Memory and disk: the weights are memory-mapped fp16 (``weights``); neither torch.export nor the
converter copies them into anonymous memory. The converter would copy each constant into a
temporary resource file under ``TMPDIR`` (a second full copy on disk, 16 GB for the 9B);
``constants_from_buffers`` hands it the mapped arrays themselves as resources instead, with the
converter's own alignment, so ``main.mlirb`` is byte for byte what the converter writes (a test
holds it). ``save_asset`` would read the whole written ``main.mlirb`` back into memory to hash it;
``aimodel.save`` writes the same files and hashes ``main.mlirb`` in blocks instead.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .contract import FUNCTION, INPUT_ORDER, OUTPUT_NAMES, STATE_ORDER, Chunking, TextConfig, input_shapes
from .weights import release_freed_memory

STATE_DTYPES = {"fp32": "fp32", "fp16": "fp16"}  # compute -> the states' storage dtype


def example_args(cfg: TextConfig, ch: Chunking, state_dtype):
    import torch

    shapes = input_shapes(ch)
    ids = torch.zeros(shapes["input_ids"], dtype=torch.int32)
    pos = torch.arange(ch.context, dtype=torch.int32)[None]
    states = tuple(torch.zeros(s, dtype=state_dtype) for s in cfg.state_shapes(ch.context).values())
    return (ids, pos, *states)


def trace(module, cfg: TextConfig, ch: Chunking, state_dtype, log: Callable[[str], None] = lambda m: None):
    """The exported, decomposed program of one chunk."""
    import gc

    import torch
    from torch.export import Dim

    from ..aimodel import import_toolchain
    from ..tracing import no_stack_traces

    seq = Dim("seq", min=ch.chunk, max=ch.context)
    dynamic = {"input_ids": None, "position_ids": {1: seq}, **{n: None for n in STATE_ORDER}}
    args = example_args(cfg, ch, state_dtype)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), no_stack_traces():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
        log(f"traced {len(cfg.layer_types)} layers in {time.perf_counter() - t0:.1f} s")
        release_freed_memory()
        t0 = time.perf_counter()
        ep = ep.run_decompositions(import_toolchain().get_decomp_table())
    ep.example_inputs = None
    gc.collect()
    log(f"decomposed in {time.perf_counter() - t0:.1f} s")
    return ep


RESOURCE_ALIGNMENT = 16  # what the converter's own resource blobs use (coreai-torch 0.4.3): same bytes


@contextlib.contextmanager
def constants_from_buffers():
    """While converting, every fp16 constant of two or more dimensions becomes a resource that
    points at the tensor's own memory (our mapped scratch file) instead of the converter's temporary
    file copy. Private coreai-torch API (``TorchConverter._constant_from_tensor``), pinned with
    coreai-torch 0.4.3; ``tests/test_backbone.py`` holds the bytes equal to the converter's path."""
    import torch
    from coreai._compiler.dialects import coreai
    from coreai._compiler.ir import DenseResourceElementsAttr
    from coreai_torch import TorchConverter
    from coreai_torch import converter as tc

    original = TorchConverter._constant_from_tensor
    count = [0]

    def from_buffer(self, tensor):
        plain = type(tensor) is torch.Tensor and not hasattr(tensor, "future_dtype")
        if not (plain and tensor.dtype == torch.float16 and tensor.dim() >= 2 and tensor.is_contiguous()):
            return original(self, tensor)
        count[0] += 1  # a placeholder name: save renames every blob after its bytes
        attr = DenseResourceElementsAttr.get_from_buffer(
            tensor.detach().numpy(), f"clef_w{count[0]}", tc.get_tensor_type(tensor, self._location, dtype=torch.float16),
            alignment=RESOURCE_ALIGNMENT)
        return coreai.ConstantOp(value=attr).result

    TorchConverter._constant_from_tensor = from_buffer
    try:
        yield count
    finally:
        TorchConverter._constant_from_tensor = original


def convert(ep, log: Callable[[str], None] = lambda m: None, buffers: bool = True):
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    from ..aimodel import deterministic_naming

    converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
    converter.add_exported_program(ep, input_names=list(INPUT_ORDER), output_names=list(OUTPUT_NAMES),
                                   state_names=list(STATE_ORDER), entrypoint_name=FUNCTION)
    t0 = time.perf_counter()
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            (constants_from_buffers() if buffers else contextlib.nullcontext()):
        program = converter.to_coreai()
    strip_debug_info(program)  # source locations would embed this machine's paths
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return program


def export_job(job: dict, log: Callable[[str], None]) -> dict:
    """The worker's backbone job: weights mapped, graph traced, converted, saved; returns timings and
    sizes. Runs in the export worker (its memory goes back to the OS when it ends)."""
    import torch

    from ..aimodel import import_toolchain, save
    from ..errors import ToolchainError
    from .contract import check_contract, weight_names
    from .graph import DecoderChunk
    from .weights import load_weights

    import_toolchain()
    source, asset_dir = Path(job["source"]), Path(job["asset_dir"])
    cfg = TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["text_config"].items()})
    ch = Chunking(int(job["chunk"]), int(job["context"]))
    check_contract(cfg, ch)
    t0 = time.perf_counter()
    log("mapping the release's weights as fp16")
    # fp32 compute: tensors stored scaled by powers of two, so no weight is an fp16 subnormal (``weights``).
    # The values are converted in a thread while the graph is traced (the trace reads none of them);
    # the converter, which does, starts after the thread has finished.
    weights = load_weights(source, weight_names(cfg), asset_dir.parent, log, scaled=job["compute"] == "fp32",
                           defer=job.get("overlap", True))
    module = DecoderChunk(cfg, ch, weights.tensors(), job["compute"], exponents=weights.exponents)
    release_freed_memory()
    t_weights = time.perf_counter() - t0
    state_dtype = torch.float32 if job["compute"] == "fp32" else torch.float16
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            filling = pool.submit(weights.fill)
            t0 = time.perf_counter()
            ep = trace(module, cfg, ch, state_dtype, log)
            t_trace = time.perf_counter() - t0
            t0 = time.perf_counter()
            t_fill = filling.result()
            t_weights += time.perf_counter() - t0  # what the conversion added beyond the trace
        t0 = time.perf_counter()
        program = convert(ep, log, buffers=job.get("buffers", True))  # False: the converter's own copies (bench)
        t_convert = time.perf_counter() - t0
    except (ValueError, RuntimeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ToolchainError(f"export of the backbone failed: {type(exc).__name__}: {first}") from exc
    del ep, module
    t0 = time.perf_counter()
    log(f"saving {asset_dir.name}")
    save(program, asset_dir, job["description"], log)
    t_save = time.perf_counter() - t0
    fp16_bytes = weights.fp16_bytes
    weights.close()
    return {"weights": t_weights, "trace": t_trace, "convert": t_convert, "save": t_save,
            "weights_beside_trace": t_fill, "weight_fp16_bytes": fp16_bytes, "scaled_tensors": sum(1 for k in weights.exponents.values() if k)}
