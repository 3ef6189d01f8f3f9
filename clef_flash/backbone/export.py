"""Export of ``DecoderChunk``: ``torch.export`` (input_ids, a dynamic-length position_ids, the four
states as inputs updated in place) lowered in one trace (``engine.lowered``), converted with the
engine's resource hooks (large tensors as placeholders) and saved streamed, so the weights are never
all in memory and their bytes are written once (docs/backbone.md says how)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from .contract import FUNCTION, IMAGE_INPUTS, INPUT_ORDER, NO_IMAGE, OUTPUT_NAMES, STATE_ORDER, Chunking, TextConfig, input_order, input_shapes
from ..engine.converter import Entry
from ..engine.converter import convert as convert_entries
from ..engine.lowered import export_lowered
from ..engine.streamed_weights import trim_freed_memory
from ..progress import plural

STATE_DTYPES = {"fp32": "fp32", "fp16": "fp16"}  # compute -> the states' storage dtype


def example_args(cfg: TextConfig, ch: Chunking, state_dtype):
    import torch

    shapes = input_shapes(ch, cfg.hidden_size)
    ids = torch.zeros(shapes["input_ids"], dtype=torch.int32)
    pos = torch.arange(ch.context, dtype=torch.int32)[None]
    image = ()
    if ch.image_rows:  # the text-only values; the image rows in the compute's dtype
        image = (torch.zeros(shapes["image_embeds"], dtype=state_dtype), torch.zeros(shapes["image_rc"], dtype=torch.int32),
                 torch.tensor([NO_IMAGE["rope_shift_start"]], dtype=torch.int32),
                 torch.tensor([NO_IMAGE["rope_shift_amount"]], dtype=torch.int32))
    states = tuple(torch.zeros(s, dtype=state_dtype) for s in cfg.state_shapes(ch.context).values())
    return (ids, pos, *image, *states)


def trace(module, cfg: TextConfig, ch: Chunking, state_dtype, log: Callable[[str], None] = lambda m: None,
          stitched: bool = True):
    """The exported, decomposed program of one chunk. ``stitched``: one layer of each group traced and
    copied for the rest (``stitch``; the same program, 15.4 -> 4.7 s at 9B); where the trace is not of
    the shape the copy assumes, every layer is traced, as with ``stitched`` False."""
    from torch.export import Dim

    from .stitch import StitchError, stitch, templates

    seq = Dim("seq", min=ch.chunk, max=ch.context)
    dynamic = {"input_ids": None, "position_ids": {1: seq}, **{n: None for n in IMAGE_INPUTS if ch.image_rows},
               **{n: None for n in STATE_ORDER}}
    args = example_args(cfg, ch, state_dtype)
    layers = len(cfg.layer_types)
    traced = frozenset(templates(module).values())
    if stitched and len(traced) < layers:
        module.only = traced
        try:
            tep = export_lowered(module, args, dynamic, log, f"{plural(len(traced), 'layer')} of {layers}")
        finally:
            module.only = None
        t0 = time.perf_counter()
        try:
            ep = stitch(tep, module)
        except StitchError as exc:
            log(f"the traced layers could not be copied ({exc}): tracing all {layers}")
        else:
            log(f"copied them to {layers} layers in {time.perf_counter() - t0:.1f} s")
            return ep
    return export_lowered(module, args, dynamic, log, f"{layers} layers")


def convert(ep, log: Callable[[str], None] = lambda m: None, buffers: bool = True,
            streamed: dict[int, tuple[str, int]] | None = None, packed: dict[int, Any] | None = None,
            inputs: tuple[str, ...] | None = None):
    """The decoder's functions converted into one program (``engine.converter.convert``): the
    program, and the placeholders the save fills. ``ep``: one exported program (``main``), or
    function name -> program; the functions read the same weights, so each is one blob."""
    programs = ep if isinstance(ep, dict) else {FUNCTION: ep}
    entries = [Entry(name, prog, tuple(inputs or INPUT_ORDER), OUTPUT_NAMES, STATE_ORDER) for name, prog in programs.items()]
    return convert_entries(entries, log, buffers=buffers, streamed=streamed, packed=packed)


def _part(key: str) -> tuple[str, str]:
    """A streamed placeholder's key -> (tensor, part): ``name`` (fp16), ``name#codes``, ``name#scales``."""
    name, _, part = key.partition("#")
    return name, part or "fp16"


def export_job(job: dict, log: Callable[[str], None]) -> dict:
    """The worker's backbone job: weights mapped, graph traced, converted, saved; returns timings and
    sizes. Runs in the export worker (its memory goes back to the OS when it ends)."""
    import torch

    from ..engine.converter import save_filled
    from ..errors import ToolchainError
    from ..formats.aimodel import import_toolchain
    from ..engine.codes_ahead import start as start_ahead
    from ..engine.shard_hashes import BackgroundHashes, shard_digests
    from .contract import check_contract, decoder_functions, weight_names
    from .graph import DecoderChunk, ImageDecoderChunk
    from ..engine.quantize import Scheme
    from ..engine.streamed_weights import load_weights

    import_toolchain()
    source, asset_dir = Path(job["source"]), Path(job["asset_dir"])
    cfg = TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["text_config"].items()})
    ch = Chunking(int(job["chunk"]), int(job["context"]), int(job.get("image_rows", 0)))
    check_contract(cfg, ch)
    t0 = time.perf_counter()
    log("laying out the release's weights as fp16")
    # fp32 compute: tensors stored scaled by powers of two, so no weight is an fp16 subnormal (``weights``).
    # Large tensors are streamed: converted when main.mlirb is written, straight into it.
    buffers = job.get("buffers", True)  # False: the converter's own copies of every value (bench)
    stream = job.get("stream", buffers)  # False: every value laid out before converting (tests)
    quant = job.get("quantization")  # {"bits", "block", "tensors"}: a compressed recipe
    scheme = Scheme(int(quant["bits"]), int(quant["block"])) if quant else None
    weights = load_weights(source, weight_names(cfg), asset_dir.parent, log, scaled=job["compute"] == "fp32",
                           streamed=stream, scheme=scheme, compressed=quant["tensors"] if quant else ())
    tensors = weights.tensors()
    quantized = weights.quantized()
    functions = decoder_functions(ch.context, job.get("short_contexts") or ())
    # one module a function, over the same tensors: its slots are its context
    modules = {f.name: (ImageDecoderChunk if ch.image_rows else DecoderChunk)(
        cfg, Chunking(ch.chunk, f.context, ch.image_rows), tensors, job["compute"], exponents=weights.exponents,
        quantized=quantized, bits=scheme.bits if scheme else 8) for f in functions}
    streamed, packed = {}, {}
    for n in weights.streamed:
        if n in quantized:
            codes, scales = quantized[n]
            if scheme.bits == 4:
                view = torch.from_numpy(weights.packed_codes(n))
                packed[codes.data_ptr()] = view
                streamed[view.data_ptr()] = (f"{n}#codes", view.numel())
            else:
                streamed[codes.data_ptr()] = (f"{n}#codes", codes.numel())
            streamed[scales.data_ptr()] = (f"{n}#scales", scales.numel() * 2)
        else:
            streamed[tensors[n].data_ptr()] = (n, tensors[n].numel() * 2)
    to_hash = list(job.get("hash_shards") or ())  # the plan's deferred shards, hashed here (the parent checks them)
    ahead = hashes = None
    try:
        trim_freed_memory()
        if job.get("ahead", True) and weights.streamed:  # their bytes made on the other core while this one traces
            ahead = start_ahead(weights, log, hashed=to_hash)
        hashes = BackgroundHashes(source, to_hash) if to_hash and ahead is None else None
        t_weights = time.perf_counter() - t0
        state_dtype = torch.float32 if job["compute"] == "fp32" else torch.float16
        try:
            t0 = time.perf_counter()
            ep = {}
            for f in functions:
                if len(functions) > 1:
                    log(f"tracing {f.name} ({f.context:,} slots)")
                ep[f.name] = trace(modules[f.name], cfg, Chunking(ch.chunk, f.context, ch.image_rows), state_dtype, log,
                                   stitched=job.get("stitched", True))
            t_trace = time.perf_counter() - t0
            t0 = time.perf_counter()
            program, made = convert(ep, log, buffers=buffers, streamed=streamed, packed=packed, inputs=input_order(ch))
            t_convert = time.perf_counter() - t0
        except (ValueError, RuntimeError, TypeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolchainError(f"export of the backbone failed: {type(exc).__name__}: {first}") from exc
        del ep, modules, tensors, quantized
        t0 = time.perf_counter()
        log(f"saving {asset_dir.name}" + (f", {plural(len(made.streamed), 'tensor')} converted into main.mlirb" if made.streamed else ""))
        written = save_filled(program, asset_dir, job["description"], log, made,
                              supply=lambda key: weights.stream(*_part(key)),
                              upcoming=lambda key: weights.prefetch(_part(key)[0]),
                              planned=lambda keys: weights.ahead_order([_part(k)[0] for k in keys]))
        t_save = time.perf_counter() - t0
        shards = shard_digests(source, to_hash, ahead, hashes, log) if to_hash else {}
    finally:
        if hashes is not None:
            hashes.stop()
        weights.close()  # the process making bytes ahead ends with it, on every path
    fp16_bytes = weights.fp16_bytes
    return {"weights": t_weights, "trace": t_trace, "convert": t_convert, "save": t_save,
            "weight_fp16_bytes": fp16_bytes, "scaled_tensors": sum(1 for k in weights.exponents.values() if k),
            "written": written.as_json(),  # the gate's proof of main.mlirb's blobs by one hash of the file
            **({"shards": shards} if to_hash else {})}
