"""Export of ``DecoderChunk``: ``torch.export`` (input_ids, a dynamic-length position_ids, the four
states as inputs updated in place) with coreai-torch's decompositions in the same trace (conv1d,
index_copy, softplus … are not lowered otherwise) -> one coreai-torch converter, the states named
-> ``to_coreai`` -> debug locations stripped -> a streamed save (``aimodel.save`` with ``mlirb.inflate``).

Memory and disk: the weights are never all in memory, and their fp16 bytes are written once. The
graph is traced over views of a sparse scratch file (``weights``, streamed): nothing reads the
large tensors' values before the save. The converter would copy each constant into a temporary
resource file (a second full copy on disk, 16 GB for the 9B); ``constants_from_buffers`` gives it
the small tensors' mapped arrays as resources instead and declares each large one an empty
resource. The bytecode is then written small, and ``mlirb.inflate`` writes ``main.mlirb`` in one
pass, converting each large tensor from the release into its place and hashing it on the way:
byte for byte what the converter writes given the data (tests hold both routes equal).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .contract import FUNCTION, IMAGE_INPUTS, INPUT_ORDER, NO_IMAGE, OUTPUT_NAMES, STATE_ORDER, Chunking, TextConfig, input_order, input_shapes
from .weights import release_freed_memory
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


def export_lowered(module, args: tuple, dynamic_shapes, log: Callable[[str], None] = lambda m: None, what: str = "the graph"):
    """``module`` exported in the ops coreai-torch lowers (its decomposition table applied in the
    trace: ``head.tracing.export_aten``)."""
    from ..formats.aimodel import import_toolchain
    from ..head.tracing import export_aten

    t0 = time.perf_counter()
    ep = export_aten(module, args, dynamic_shapes, import_toolchain().get_decomp_table())
    release_freed_memory()
    log(f"traced {what} and decomposed in {time.perf_counter() - t0:.1f} s")
    return ep


PLACEHOLDER_TAG = b"clef-fill"[:8]  # + an 8-byte number: a streamed tensor's data until main.mlirb is written
RESOURCE_ALIGNMENT = 16  # what the converter's own resource blobs use (coreai-torch 0.4.3): same bytes


@dataclass
class Resources:
    """What ``constants_from_buffers`` made: how many resources, and the placeholders of the streamed
    tensors (its 16 bytes of data -> (weight name, bytes)). The compiler renames resources and merges
    those of equal data, so a placeholder is found by its data: a tag and its own number."""

    count: int = 0
    streamed: dict[bytes, tuple[str, int]] = field(default_factory=dict)  # placeholder data -> (weight, bytes)


@contextlib.contextmanager
def constants_from_buffers(streamed: dict[int, tuple[str, int]] | None = None, packed: dict[int, Any] | None = None):
    """While converting, every fp16 or int8 constant of two or more dimensions becomes a resource
    that points at the tensor's own memory (our mapped scratch file) instead of the converter's
    temporary file copy; a tensor in ``streamed`` (by data pointer: (weight name, bytes)) becomes an
    empty resource that ``mlirb.inflate`` fills. ``packed``: int4 codes by the data pointer of their
    unpacked int8 view -> the view of their packed bytes; the converter's packing step
    (``IntxTensor.from_unpacked``, which would read and pack every value) takes that view instead,
    and the packed constant is declared by a placeholder too. Private coreai-torch API
    (``TorchConverter._constant_from_tensor``, ``IntxTensor``), pinned with coreai-torch 0.4.3;
    ``tests/test_backbone.py`` and ``tests/test_compressed.py`` hold the bytes equal to the
    converter's own path."""
    import numpy as np
    import torch
    from coreai._compiler.dialects import coreai
    from coreai._compiler.ir import DenseResourceElementsAttr
    from coreai_torch import TorchConverter
    from coreai_torch import converter as tc
    from coreai_torch._compression import _intx

    original = TorchConverter._constant_from_tensor
    original_unpacked = _intx.IntxTensor.from_unpacked.__func__
    made = Resources()
    seen: dict = {}
    streamed = streamed or {}
    packed = packed or {}

    def from_unpacked(cls, unpacked, nbits):
        view = packed.get(unpacked.data_ptr()) if isinstance(unpacked, torch.Tensor) and nbits == 4 else None
        if view is None:
            return original_unpacked(cls, unpacked, nbits)
        return cls(view, unpacked.shape, nbits)  # the packed bytes' own view: nothing read

    def from_buffer(self, tensor):
        # the same tensor asked again (another entrypoint of a multi-function program) is the same
        # resource: one blob, one placeholder
        base = tensor.elem if isinstance(tensor, _intx.IntxTensor) else tensor
        ident = (type(tensor).__name__, base.data_ptr(), tuple(tensor.shape), str(tensor.dtype)) \
            if isinstance(base, torch.Tensor) and base.numel() else None
        if ident is not None and ident in seen:
            return coreai.ConstantOp(value=seen[ident]).result
        if isinstance(tensor, _intx.IntxTensor) and tensor.elem.data_ptr() in streamed:
            key, dtype, raw = tensor.elem.data_ptr(), torch.int4, tensor.elem
        else:
            plain = type(tensor) is torch.Tensor and not hasattr(tensor, "future_dtype")
            # every one a blob, small ones too (the converter would write those inline): the gate finds
            # each compressed tensor's codes and scales among the blobs and reads them back
            if not (plain and tensor.dtype in (torch.float16, torch.int8) and tensor.dim() >= 2 and tensor.is_contiguous()):
                return original(self, tensor)
            key, dtype, raw = tensor.data_ptr(), tensor.dtype, tensor
        made.count += 1
        name = f"clef_w{made.count}"  # a placeholder name: save renames every blob after its bytes
        known = streamed.get(key)
        if known is not None and known[1] == raw.numel() * raw.element_size():
            tag = PLACEHOLDER_TAG + struct.pack("<Q", made.count)  # filled when main.mlirb is written
            data = np.frombuffer(tag, dtype=np.uint8 if dtype == torch.int4 else raw.detach().numpy().dtype)
            made.streamed[tag] = known
        else:
            data = raw.detach().numpy()
        attr = DenseResourceElementsAttr.get_from_buffer(
            data, name, tc.get_tensor_type(tensor, self._location, dtype=dtype), alignment=RESOURCE_ALIGNMENT)
        if ident is not None:
            seen[ident] = attr
        return coreai.ConstantOp(value=attr).result

    TorchConverter._constant_from_tensor = from_buffer
    _intx.IntxTensor.from_unpacked = classmethod(from_unpacked)
    try:
        yield made
    finally:
        TorchConverter._constant_from_tensor = original
        _intx.IntxTensor.from_unpacked = classmethod(original_unpacked)


def convert(ep, log: Callable[[str], None] = lambda m: None, buffers: bool = True,
            streamed: dict[int, tuple[str, int]] | None = None, packed: dict[int, Any] | None = None,
            inputs: tuple[str, ...] | None = None):
    """The Core AI program, and what the converter was handed (``Resources``: the placeholders of the
    streamed tensors, which ``save`` fills); a streamed tensor it did not take is an error."""
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    from ..formats.aimodel import deterministic_naming

    t0 = time.perf_counter()
    # the hooks from the start: adding the program packs int4 codes (``inject_subbyte_tensors``)
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            (constants_from_buffers(streamed, packed) if buffers else contextlib.nullcontext()) as hooked:
        converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
        converter.add_exported_program(ep, input_names=list(inputs or INPUT_ORDER), output_names=list(OUTPUT_NAMES),
                                       state_names=list(STATE_ORDER), entrypoint_name=FUNCTION)
        program = converter.to_coreai()
    made = hooked or Resources()
    strip_debug_info(program)  # source locations would embed this machine's paths
    if streamed and len(made.streamed) != len(streamed):  # one read from the sparse file would be zeros
        missing = sorted(set(n for n, _ in streamed.values()) - set(n for n, _ in made.streamed.values()))
        raise RuntimeError(f"the converter did not take {missing[0]} as the tensor it was given"
                           + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return program, made


def _part(key: str) -> tuple[str, str]:
    """A streamed placeholder's key -> (tensor, part): ``name`` (fp16), ``name#codes``, ``name#scales``."""
    name, _, part = key.partition("#")
    return name, part or "fp16"


def export_job(job: dict, log: Callable[[str], None]) -> dict:
    """The worker's backbone job: weights mapped, graph traced, converted, saved; returns timings and
    sizes. Runs in the export worker (its memory goes back to the OS when it ends)."""
    import torch

    from ..formats.aimodel import import_toolchain, save
    from ..formats.mlirb import MissingPlaceholders
    from ..errors import ToolchainError
    from .ahead import start as start_ahead
    from .files import BackgroundHashes
    from .contract import check_contract, weight_names
    from .graph import DecoderChunk, ImageDecoderChunk
    from .quantize import Scheme
    from .weights import load_weights

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
    module = (ImageDecoderChunk if ch.image_rows else DecoderChunk)(
        cfg, ch, tensors, job["compute"], exponents=weights.exponents, quantized=quantized, bits=scheme.bits if scheme else 8)
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
        release_freed_memory()
        if job.get("ahead", True) and weights.streamed:  # their bytes made on the other core while this one traces
            ahead = start_ahead(weights, log, hashed=to_hash)
        hashes = BackgroundHashes(source, to_hash) if to_hash and ahead is None else None
        t_weights = time.perf_counter() - t0
        state_dtype = torch.float32 if job["compute"] == "fp32" else torch.float16
        try:
            t0 = time.perf_counter()
            ep = trace(module, cfg, ch, state_dtype, log, stitched=job.get("stitched", True))
            t_trace = time.perf_counter() - t0
            t0 = time.perf_counter()
            program, made = convert(ep, log, buffers=buffers, streamed=streamed, packed=packed, inputs=input_order(ch))
            t_convert = time.perf_counter() - t0
        except (ValueError, RuntimeError, TypeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolchainError(f"export of the backbone failed: {type(exc).__name__}: {first}") from exc
        del ep, module, tensors, quantized
        t0 = time.perf_counter()
        log(f"saving {asset_dir.name}" + (f", {plural(len(made.streamed), 'tensor')} converted into main.mlirb" if made.streamed else ""))
        fill = None
        if made.streamed:
            fill = ({tag: size for tag, (_, size) in made.streamed.items()}, lambda tag: weights.stream(*_part(made.streamed[tag][0])),
                    lambda tag: weights.prefetch(_part(made.streamed[tag][0])[0]),
                    lambda tags: weights.ahead_order([_part(made.streamed[tag][0])[0] for tag in tags]))
        try:
            written = save(program, asset_dir, job["description"], log, fill=fill)
        except MissingPlaceholders as exc:  # name the tensors, not the placeholders
            lost = sorted(made.streamed[k][0] for k in exc.keys)
            raise ToolchainError(f"{asset_dir}: the compiler folded or inlined {lost[0]}" + (f" (+{len(lost) - 1} more)" if len(lost) > 1 else "")
                                 + "; a streamed tensor's bytes would be lost") from None
        t_save = time.perf_counter() - t0
        shards = _shard_digests(source, to_hash, ahead, hashes, log) if to_hash else {}
    finally:
        if hashes is not None:
            hashes.stop()
        weights.close()  # the process making bytes ahead ends with it, on every path
    fp16_bytes = weights.fp16_bytes
    return {"weights": t_weights, "trace": t_trace, "convert": t_convert, "save": t_save,
            "weight_fp16_bytes": fp16_bytes, "scaled_tensors": sum(1 for k in weights.exponents.values() if k),
            "written": written.as_json(),  # the gate's proof of main.mlirb's blobs by one hash of the file
            **({"shards": shards} if to_hash else {})}


def _shard_digests(source: Path, names: list[str], ahead, hashes, log: Callable[[str], None]) -> dict[str, str]:
    """The shards' sha256: from the reads that made the codes (``ahead``), or from the thread that
    hashed them beside the export; any the process did not reach (it stopped) hashed here."""
    from ..digest import sha256_file

    t0 = time.perf_counter()
    got = ahead.digests() if ahead is not None else hashes.digests()
    missing = [n for n in names if n not in got]
    for n in missing:
        got[n] = sha256_file(source / n)
    how = "from the reads that made the codes" if ahead is not None else "beside the export"
    log(f"{plural(len(names) - len(missing), 'shard')} hashed {how}" + (f", {len(missing)} after it" if missing else "")
        + f" ({time.perf_counter() - t0:.1f} s waited)")
    return {n: got[n] for n in names}
