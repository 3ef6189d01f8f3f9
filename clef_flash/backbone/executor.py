"""The torch engine of a backbone asset: the export's own graph (``graph.DecoderChunk``) run by torch on
the weights read back from the asset's ``main.mlirb`` through its weight map (``engine.weight_map``:
fp16 as stored, int8 / int4 codes and scales dequantized by the runtime's rule, the folded 1-D
tensors), so what it computes is what the shipped bytes say, at torch's speed on any device.

A record runs a layer at a time over all its chunks (each chunk sees the states the chunks before
it left, exactly as the runtime's host loop): each layer's weights are read once a record, widened
to the compute dtype, then let go, so a 9B decoder runs in about one layer's memory. Held to the Core
AI runtime by the gate's "torch engine" rows and by the tests.

How it works: docs/modules.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .contract import LM, Chunking, TextConfig


@dataclass(frozen=True)
class EngineInfo:
    """What computed the rows, for the output, the transcript and the card."""

    engine: str  # "torch" or "coreai"
    device: str  # "cpu", "cuda (NVIDIA H100 …)", "mps", or the runtime's "Core AI runtime (CPU)"
    compute: str  # the precision the arithmetic ran in
    note: str = ""  # where it differs from the asset's own compute precision, and why

    def describe(self) -> str:
        return f"{self.engine} on {self.device}, {self.compute} compute" + (f" ({self.note})" if self.note else "")


ENGINES = ("auto", "coreai", "torch")
# decoders up to this many parameters run a chunk in seconds on the Linux CPU runtime (fp16 compute is
# about 37x slower there than fp32): past them it takes minutes a chunk (about 3 at 9B in fp32, over 38
# in fp16), and the torch engine, about 10x faster on the same CPU, is the default on Linux
RUNTIME_MAX_PARAMETERS = {"fp32": 2_000_000_000, "fp16": 50_000_000}


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "coreai" or "torch"
    why: str


def choose_engine(bundle: Path, manifest, engine: str = "auto", device: str = "auto") -> EngineChoice:
    """The engine a backbone asset runs on: as asked (``--engine``), or by what is fast where this runs
    (``auto``): the Core AI runtime on a Mac and for decoders it runs a chunk of in seconds (no torch
    imported: the host path needs none); the torch engine past ``RUNTIME_MAX_PARAMETERS`` or where a
    ``device`` is named. Refused before any work (exit 2) where it cannot run."""
    import importlib.util
    import sys

    from ..errors import UsageError
    from .contract import weight_names

    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "coreai":
        return EngineChoice("coreai", "asked for")
    has_map = manifest.export.weight_map is not None
    if importlib.util.find_spec("torch") is None:
        if engine == "torch":
            raise UsageError("--engine torch: torch is not installed here (pip install torch)")
        return EngineChoice("coreai", "torch is not installed here")
    if engine == "torch" and not has_map:
        raise UsageError(f"--engine torch: {bundle} has no weight map (built before the torch engine); build it again")
    if engine == "torch" or device != "auto":
        from ..devices import device_name

        device_name(device)  # a device the machine lacks: exit 2, before any work
    if engine == "torch":
        return EngineChoice("torch", "asked for")
    if sys.platform == "darwin":
        return EngineChoice("coreai", "the Core AI runtime is this Mac's own")
    if not has_map:
        return EngineChoice("coreai", f"{Path(bundle).name} has no weight map for the torch engine")
    params = sum(int(np.prod(shape)) for shape in weight_names(text_of(manifest)[0]).values())
    compute = manifest.export.compute
    if params > RUNTIME_MAX_PARAMETERS[compute]:
        return EngineChoice("torch", f"{params:,} parameters in {compute} compute: the Linux CPU runtime takes minutes a chunk")
    if device != "auto":
        return EngineChoice("torch", f"--device {device} named")
    return EngineChoice("coreai", f"{params:,} parameters: the Linux CPU runtime runs a chunk in seconds")


def text_of(manifest) -> tuple[TextConfig, Chunking]:
    lang = manifest.language
    cfg = TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in lang.text_config.items()})
    vision = manifest.interface.vision
    return cfg, Chunking(lang.prefill_chunk, lang.max_context, vision.image_rows if vision is not None else 0)


def open_shipped_weights(bundle: Path, asset: Path, manifest, check_blobs: bool = True, log=lambda m: None):
    """The asset's weights through the bundle's weight map (``engine.weight_map.open_weights``)."""
    from ..engine.weight_map import MAP_FILE, open_weights
    from ..errors import IntegrityError

    wm = manifest.export.weight_map
    if wm is None:
        raise IntegrityError(f"{bundle}: its manifest names no weight map ({MAP_FILE}): a bundle built before the "
                             f"torch engine; build it again to run it with --engine torch")
    return open_weights(Path(bundle) / MAP_FILE, wm.sha256, Path(asset) / "main.mlirb", manifest.export.main_mlirb.sha256,
                        check_blobs=check_blobs, log=log)


class TorchDecoder:
    """``rows(ids, extra) -> [T, hidden]`` fp32: the same inputs the runtime's host loop sends (ids with
    an image's tokens as V + k, the four image inputs in ``extra``), the same rows to fp32 rounding."""

    def __init__(self, manifest, weights, device: str = "auto") -> None:
        import torch

        from ..devices import pick_device
        from ..engine.streamed_weights import freed_memory_given_back
        from .graph import DecoderChunk, ImageDecoderChunk

        # a layer's widened weights (hundreds of MB at 9B) freed back to the OS, not kept in glibc's heap
        freed_memory_given_back()
        self.manifest, self.weights = manifest, weights
        self.cfg, self.ch = text_of(manifest)
        big = [w for w in weights.map.weights if len(w.shape) >= 2]
        self.device = pick_device(device, 4 * sum(int(np.prod(w.shape)) for w in big))
        asset_compute = manifest.export.compute
        self.compute = asset_compute
        note = ""
        if asset_compute == "fp16" and self.device.torch_device == "cpu":
            # torch's CPU fp16 matmuls are emulated and slow; the gap to the asset's fp16 arithmetic is
            # then the fp16 bound the gate states (gate.backbone.TOLERANCES["fp16"])
            self.compute, note = "fp32", "the asset computes in fp16; on a CPU torch runs it in fp32"
        self.info = EngineInfo("torch", self.device.label, self.compute, note)
        self.dtype = torch.float32 if self.compute == "fp32" else torch.float16
        # every matrix a placeholder: each layer's are set from main.mlirb when it runs (``_layer_weights``)
        placeholders = {w.name: torch.empty((0, 0), dtype=torch.float16) for w in big}
        placeholders.update({n: torch.from_numpy(np.array(a, np.float32)) for n, a in weights.folded.items()})
        cls = ImageDecoderChunk if self.ch.image_rows else DecoderChunk
        self.module = cls(self.cfg, self.ch, placeholders, self.compute, exponents=weights.exponents)
        dev = self.device.torch_device
        self.module.w = {n: t.to(dev) for n, t in self.module.w.items()}
        self.module.delta = {k: ([x.to(dev) for x in v] if isinstance(v, list) else v.to(dev) if hasattr(v, "to") else v)
                             for k, v in self.module.delta.items()}
        table = f"{LM}embed_tokens.weight"
        self.module._buffers[self.module._buffer[table]] = torch.from_numpy(weights.array(table))  # noqa: SLF001 (read on use)
        self._held: dict[str, Any] = {}
        self._empty = torch.empty(0, dtype=torch.float16)
        self._layer_bytes = None  # a streamed layer's blobs, the buffer reused layer after layer
        self._buffers = None  # ``weight_map.BlockBuffers``: made on first use, reused by every block

    def _layer_weights(self, i: int) -> dict[str, Any]:
        """Layer ``i``'s matrices on the device as stored (fp16: a view of the mapped file on a CPU;
        a compressed one dequantized to fp16), kept where the device holds them all; the graph
        widens each to the compute dtype where it is used (``graph._mat``: an exact cast). Where the
        device does not hold them, a linear's weight is read as stored into one buffer reused layer
        after layer (``ShippedWeights.read_blobs``), and the graph widens it where it is used a block
        of rows at a time (``ShippedWeights.widened_blocks``), so neither the layer's dequantized 16
        bits (0.44 GB at the 9B's width) nor one fp32 matrix (201 MB) is alive whole; each use
        dequantizes again."""
        prefix = f"{LM}layers.{i}."
        out = {}
        streamed = [w.name for w in self.weights.map.weights
                    if w.name.startswith(prefix) and len(w.shape) == 2 and not self.device.hold]
        if streamed:
            # the layer's stored bytes read once (int8 codes: 0.2 GB at the 9B's width), widened by
            # blocks at each use from memory
            raw, self._layer_bytes = self.weights.read_blobs(streamed, self._layer_bytes)
            for name in streamed:
                self.module.row_blocks[name] = lambda name=name, r=raw[name]: self._blocks(name, r)
                self.module.row_counts[name] = self.weights.by_name[name].shape[0]
        for w in self.weights.map.weights:
            if w.name.startswith(prefix) and len(w.shape) >= 2 and w.name not in self.module.row_blocks:
                if w.name in self._held:
                    out[w.name] = self._held[w.name]
                    continue
                t = self.weights.tensor(w.name).to(self.device.torch_device)
                out[w.name] = t
                if self.device.hold:
                    self._held[w.name] = t
        return out

    def _blocks(self, name: str, raw):
        from ..engine.weight_map import BlockBuffers

        if self._buffers is None:
            self._buffers = BlockBuffers(self.dtype)
        dev = self.device.torch_device
        for r0, r1, rows in self.weights.widened_blocks(name, self.dtype, raw=raw, buffers=self._buffers):
            yield r0, r1, rows if dev == "cpu" else rows.to(dev)

    def _states(self, kind: str, context: int):
        """One layer's zero states, shaped as the asset's function over ``context`` slots with one layer (index 0)."""
        import torch

        shapes = self.cfg.state_shapes(context)
        names = ("keyCache", "valueCache") if kind == "full_attention" else ("convState", "recState")
        dtype = torch.float32 if self.compute == "fp32" else torch.float16
        return {n: torch.zeros((1,) + tuple(shapes[n][1:]), dtype=dtype, device=self.device.torch_device) for n in names}

    def rows(self, ids: np.ndarray, extra: dict[str, np.ndarray] | None = None, progress=None) -> np.ndarray:
        """The record's hidden rows ``[T, hidden]`` (fp32); ``progress(layer)`` after each layer."""
        import torch

        from ..engine.streamed_weights import trim_freed_memory
        from ..interrupts import refuse_if_interrupted
        from .contract import fitting
        from .host import chunk_inputs
        from .manifest import functions_of

        lang, m = self.manifest.language, self.module
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        dev = self.device.torch_device
        # the function the runtime would run the record in: its slots, its states
        fn = fitting(functions_of(self.manifest), len(ids), lang.prefill_chunk)
        m.slots = torch.arange(fn.context, dtype=torch.int32)
        with torch.no_grad():
            chunks = []
            for inputs in chunk_inputs(ids, lang.prefill_chunk, fn.context, lang.pad_token_id, None, extra):
                image = None
                if self.ch.image_rows:
                    image = tuple(torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in
                                  ("image_embeds", "image_rc", "rope_shift_start", "rope_shift_amount"))
                x, pos, cos, sin, bias = m.prelude(torch.from_numpy(inputs["input_ids"]),
                                                   torch.from_numpy(inputs["position_ids"]), image)
                chunks.append([t.to(dev) for t in (x, pos, cos, sin, bias)])
            for i, kind in enumerate(self.cfg.layer_types):
                layer = self._layer_weights(i)
                for name, t in layer.items():
                    m._buffers[m._buffer[name]] = t  # noqa: SLF001
                s = self._states(kind, fn.context)  # this layer's states alone: its index in them is 0
                for c in chunks:  # the chunks in order: each sees the states the ones before it left
                    refuse_if_interrupted()  # Ctrl-C: back within one chunk of one layer
                    x, pos, cos, sin, bias = c
                    c[0] = m._layer(i, kind, 0, x, pos, cos, sin, bias, s.get("keyCache"), s.get("valueCache"),  # noqa: SLF001
                                    s.get("convState"), s.get("recState"))
                for name in layer:
                    m._buffers[m._buffer[name]] = self._empty  # noqa: SLF001 (let go)
                m.row_blocks.clear()
                del layer, s
                trim_freed_memory(collect=False)  # the layer's heap back to the kernel before the next
                if progress is not None:
                    progress(i)
            out = [m._norm(c[0], f"{LM}norm.weight").float().reshape(lang.prefill_chunk, -1).cpu() for c in chunks]  # noqa: SLF001
        return torch.cat(out).numpy()[: len(ids)]


def open_torch_decoder(bundle: Path, asset: Path, manifest, device: str = "auto", check_blobs: bool = True,
                       log=lambda m: None) -> TorchDecoder:
    """A backbone bundle's torch engine: its weights read back and checked (exit 3 before any
    arithmetic where they are not the manifest's), the device picked (exit 2 where asked for and absent)."""
    from ..devices import device_name

    device_name(device)  # a device the machine lacks refused before main.mlirb is read
    t0 = time.perf_counter()
    weights = open_shipped_weights(bundle, asset, manifest, check_blobs, log)
    engine = TorchDecoder(manifest, weights, device)
    log(f"torch engine: {engine.info.describe()}; weights read back in {time.perf_counter() - t0:.1f} s")
    return engine
