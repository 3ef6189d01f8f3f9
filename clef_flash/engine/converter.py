"""The converter run with our resource hooks: constants as blobs over our own memory, streamed
tensors as placeholders that the save fills, so no weight is copied twice."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


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


@dataclass(frozen=True)
class Entry:
    """One exported program, added to the converter as one function."""

    name: str
    program: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    states: tuple[str, ...] = ()


def convert(entries: list[Entry], log: Callable[[str], None] = lambda m: None, *, buffers: bool = True,
            streamed: dict[int, tuple[str, int]] | None = None, packed: dict[int, Any] | None = None,
            specialise: Callable[[Any], None] | None = None):
    """The Core AI program of ``entries`` (one converter), and what the converter was handed
    (``Resources``: the placeholders of the streamed tensors, which ``save_filled`` fills); a streamed
    tensor it did not take is an error. ``specialise(program)`` runs under the same naming seed."""
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    from ..formats.aimodel import deterministic_naming

    t0 = time.perf_counter()
    # the hooks from the start: adding the program packs int4 codes (``inject_subbyte_tensors``)
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            (constants_from_buffers(streamed, packed) if buffers else contextlib.nullcontext()) as hooked:
        converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
        for e in entries:
            states = {"state_names": list(e.states)} if e.states else {}
            converter.add_exported_program(e.program, input_names=list(e.inputs), output_names=list(e.outputs),
                                           entrypoint_name=e.name, **states)
        program = converter.to_coreai()
        if specialise is not None:
            specialise(program)
    made = hooked or Resources()
    strip_debug_info(program)  # source locations would embed this machine's paths
    if streamed and len(set(made.streamed.values())) != len(streamed):  # one read from the sparse file would be zeros
        missing = sorted(set(n for n, _ in streamed.values()) - set(n for n, _ in made.streamed.values()))
        raise RuntimeError(f"the converter did not take {missing[0]} as the tensor it was given"
                           + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return program, made


def save_filled(program, asset_dir: Path, description: dict[str, str], log: Callable[[str], None], made: Resources,
                supply: Callable[[str], Any], upcoming: Callable[[str], None] | None = None,
                planned: Callable[[list[str]], None] | None = None):
    """``aimodel.save`` with each placeholder's bytes from ``supply(key)`` (``key``: the weight name
    the placeholder stands for); ``upcoming`` and ``planned`` are told keys too. A placeholder the
    compiler dropped is a ``ToolchainError`` naming its tensor."""
    from ..errors import ToolchainError
    from ..formats.aimodel import save
    from ..formats.mlirb import Fill, MissingPlaceholders

    fill = None
    if made.streamed:
        key = lambda tag: made.streamed[tag][0]  # noqa: E731
        fill = Fill(sizes={tag: size for tag, (_, size) in made.streamed.items()}, supply=lambda tag: supply(key(tag)),
                    upcoming=(lambda tag: upcoming(key(tag))) if upcoming else None,
                    planned=(lambda tags: planned([key(t) for t in tags])) if planned else None)
    try:
        return save(program, asset_dir, description, log, fill=fill)
    except MissingPlaceholders as exc:  # name the tensors, not the placeholders
        lost = sorted(made.streamed[k][0] for k in exc.keys)
        raise ToolchainError(f"{asset_dir}: the compiler folded or inlined {lost[0]}" + (f" (+{len(lost) - 1} more)" if len(lost) > 1 else "")
                             + "; a streamed tensor's bytes would be lost") from None
