"""The gate's reference: transformers' own Qwen3.5 text model of a release in fp32, holding one
decoder layer's weights at a time.

How it works: docs/modules.md."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

from .contract import LM
from .held_weights import in_blocks
from ..errors import IntegrityError
from ..engine.streamed_weights import TensorInfo, as_f32, fp32_blocks, locate, read_f32, trim_freed_memory


def _read(folder: Path, t: TensorInfo, dtype, device="cpu"):
    import torch

    with open(folder / t.file, "rb") as fh:
        fh.seek(t.offset)
        raw = np.frombuffer(fh.read(t.nbytes), dtype=np.uint8)
    # widened in place: as_f32's own temporaries and a copy were 3 fp32 tensors beside the bytes
    # (the largest 9B matrix: 600 MB at once, on top of the layer read so far)
    wide = np.empty(t.shape, np.float32)
    as_f32(raw, t.dtype, wide.reshape(-1))
    return torch.from_numpy(wide).to(device=device, dtype=dtype)


def _read_stored(folder: Path, t: TensorInfo, device="cpu"):
    """The tensor in its stored 16 bits (bf16 / fp16), as a torch tensor."""
    import torch

    raw = bytearray(t.nbytes)
    with open(folder / t.file, "rb") as fh:
        fh.seek(t.offset)
        if fh.readinto(raw) != t.nbytes:
            raise IntegrityError(f"{folder / t.file}: ends inside {t.name}")
    dtype = torch.bfloat16 if t.dtype == "BF16" else torch.float16
    return torch.frombuffer(raw, dtype=dtype).reshape(t.shape).to(device=device)


class StreamedTextModel:
    """``rows(ids) -> hidden [T, H]`` fp32: transformers' text model, one layer in memory at a time."""

    def __init__(self, source: Path, dtype=None, weights=None, device="cpu", hold: bool = False, narrow: bool = False) -> None:
        """``dtype``: torch.float32 (the gate's) or torch.float64 (how far fp32 itself is from exact).
        ``weights``: name -> fp32 array, ``held_weights.OnUse`` or None, for tensors read from elsewhere
        than the release (a compressed asset's own dequantized weights: ``asset_readback.dequantized``),
        one layer at a time. ``device``: where the arithmetic runs (the plan's ``--device``); ``hold``:
        the release's weights stay there once read (a device the whole model fits on), else streamed.
        ``narrow`` (fp32 only): the linears' weights read where each linear is called, not held
        (streamed), or held in 16 bits as stored (``hold``), widened on use (``held_weights``: the
        same fp32 arithmetic)."""
        import torch

        from ..sources.reference import import_reference

        import_reference()
        from transformers import Qwen3_5Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel, Qwen3_5TextRotaryEmbedding
        from transformers.utils import logging as tf_logging

        tf_logging.set_verbosity_error()
        self.source = Path(source)
        self.dtype = dtype or torch.float32
        self.weights = weights
        self.device = torch.device(device)
        self.hold = hold
        self.narrow = narrow and self.dtype == torch.float32
        self._held: dict[str, object] = {}  # hold: name -> the release's tensor on the device
        self._manual: set[int] = set()  # layers loaded by ``layer_loaded``: the hooks leave them be
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = Qwen3_5Config.from_pretrained(self.source).text_config
            with torch.device("meta"):
                model = Qwen3_5TextModel(config)
            model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=config)  # its tables computed on the CPU
            model.rotary_emb.to(device=self.device, dtype=self.dtype)
        self.model = model.eval()
        if self.narrow:
            from .held_weights import widen_on_use

            widen_on_use(model.layers)
        wanted = {f"{LM}{n}": tuple(p.shape) for n, p in model.named_parameters()}
        self.infos = locate(self.source, wanted)
        self._load(model.norm, "norm.")
        self._start: tuple[int, object] | None = None  # ``rows(start=...)``: (layer, the hidden states entering it)
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda mod, args, prefix=f"layers.{i}.", i=i: None if self._skipped(i) or i in self._manual else self._load(mod, prefix))
            layer.register_forward_hook(lambda mod, args, out, i=i: None if i in self._manual else self._drop(mod))
            layer.forward = self._skipping(i, layer.forward)

    def _skipped(self, i: int) -> bool:
        return self._start is not None and i < self._start[0]

    def _skipping(self, i: int, forward):
        """Layer ``i``'s forward, or, for a layer before ``rows(start=...)``'s, nothing run and no
        weight read: it hands its input on, and the one just before the start hands on the hidden
        states given for it (the text model calls each layer with the hidden states first and
        takes back the layer's new ones)."""
        def run(hidden_states, *args, **kwargs):
            if self._skipped(i):
                return self._start[1] if i == self._start[0] - 1 else hidden_states
            return forward(hidden_states, *args, **kwargs)
        return run

    def _load(self, module, prefix: str, weights=None) -> None:
        import torch

        from .held_weights import OnUse

        weights = weights if weights is not None else self.weights
        for name, p in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            full = f"{LM}{prefix}{name}"
            narrow = self.narrow and attr == "weight" and isinstance(target, torch.nn.Linear)
            other = weights(full) if weights is not None else None
            if narrow:
                target.held_read = target.held_blocks = None
            if narrow and not self.hold and (isinstance(other, OnUse) or (other is None and self.infos[full].dtype in ("BF16", "F16"))):
                # streamed: read where the linear is called, not held for the layer (``held_weights.OnUse``)
                on_use = other if other is not None else self._reader(self.infos[full])
                target.held_read, target.held_blocks = on_use.read, on_use.blocks
                target._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)
                continue
            if isinstance(other, OnUse):
                value = other.read().to(device=self.device, dtype=self.dtype)
            elif other is not None:
                value = torch.from_numpy(other).to(device=self.device, dtype=self.dtype)
            elif full in self._held:
                value = self._held[full]
            else:
                stored = narrow and self.infos[full].dtype in ("BF16", "F16")
                value = _read_stored(self.source, self.infos[full], self.device) if stored else \
                    _read(self.source, self.infos[full], self.dtype, self.device)
                if self.hold:
                    self._held[full] = value
            target._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)

    def _reader(self, t: TensorInfo):
        """The release's 16-bit tensor ``t`` read where it is used (``held_weights.OnUse``): widened
        into a new fp32 tensor on the device, or a block of rows at a time (``streamed_weights.fp32_blocks``)."""
        import torch

        from .held_weights import BLOCK_BYTES, OnUse

        def read():
            wide = torch.empty(t.shape, dtype=torch.float32)
            read_f32(self.source, t, wide.numpy())
            return wide.to(self.device)

        def blocks():
            for r0, r1, wide in fp32_blocks(self.source, t, BLOCK_BYTES // 2):  # 16 bits a value
                yield r0, r1, wide.view(r1 - r0, -1).to(self.device)

        return OnUse(read, blocks)

    @contextmanager
    def layer_loaded(self, i: int, weights=None):
        """Layer ``i`` with its weights in place for calls made by hand (the plan's reverse sweep):
        read once for the block, ``weights`` (name -> fp32 array or None) where given, dropped after."""
        layer = self.model.layers[i]
        self._load(layer, f"layers.{i}.", weights)
        self._manual.add(i)
        try:
            yield layer
        finally:
            self._manual.discard(i)
            self._drop(layer)

    def _drop(self, module) -> None:
        import torch

        for name, p in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            target._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)
        if self.narrow:  # the layer's weights back to the kernel, not kept under the next layer's
            trim_freed_memory(collect=False)

    def embed(self, ids: np.ndarray):
        import torch

        t = self.infos[f"{LM}embed_tokens.weight"]
        table = np.memmap(self.source / t.file, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
        rows = table.reshape(t.shape[0], -1)[np.asarray(ids, dtype=np.int64)]
        values = as_f32(np.ascontiguousarray(rows).reshape(-1), t.dtype).reshape(len(ids), t.shape[1])
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype)

    def rows(self, ids: np.ndarray, image=None, start: tuple[int, np.ndarray] | None = None) -> np.ndarray:
        """The final-norm rows of ``ids``; with ``image`` (``host.ImageSpan``), what transformers'
        multimodal ``Qwen3_5Model`` does with an image's features: its rows in place of the tokens'
        embeddings and the three-axis positions of its own ``get_rope_index``. ``start``: (layer
        ``k``, the hidden states ``[T, H]`` entering it, from an earlier pass whose layers before
        ``k`` were these): only layers ``k`` on run (``sensitivity``: a layer compressed alone)."""
        import torch

        if start is not None and start[0] > 0:
            self._start = (start[0], torch.from_numpy(np.asarray(start[1])).to(device=self.device, dtype=self.dtype)[None])
        try:
            return self._rows(ids, image)
        finally:
            self._start = None

    def _rows(self, ids: np.ndarray, image=None) -> np.ndarray:
        import torch

        embeds = self.embed(ids)
        kwargs = {}
        if image is not None:
            n = image.tokens
            embeds[image.start:image.start + n] = torch.from_numpy(np.asarray(image.rows, np.float32)).to(device=self.device, dtype=self.dtype)
            kwargs["position_ids"] = self.positions(len(ids), image).to(self.device)
        # streamed linears compute by row blocks of their weights (``held_weights.in_blocks``: the same
        # dot products), so no whole fp32 matrix is alive (201 MB at the 9B's widest)
        blocks = in_blocks() if self.narrow and not self.hold else nullcontext()
        with torch.no_grad(), warnings.catch_warnings(), blocks:
            warnings.simplefilter("ignore")
            out = self.model(inputs_embeds=embeds[None], **kwargs).last_hidden_state[0]
        return out.float().cpu().numpy() if self.dtype == torch.float32 else out.cpu().numpy()

    def positions(self, length: int, image):
        """``(3, 1, T)`` positions from transformers' ``Qwen3_5Model.get_rope_index`` (called on a
        stand-in holding the release's config: the method reads nothing else of the model)."""
        from types import SimpleNamespace

        import torch
        from transformers import Qwen3_5Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

        full = Qwen3_5Config.from_pretrained(self.source)
        stand_in = SimpleNamespace(config=full)
        stand_in.get_vision_position_ids = lambda *a, **k: Qwen3_5Model.get_vision_position_ids(stand_in, *a, **k)
        types = torch.zeros((1, length), dtype=torch.int32)
        types[0, image.start:image.start + image.tokens] = 1
        merge = full.vision_config.spatial_merge_size
        grid = torch.tensor([[1, image.grid[0] * merge, image.grid[1] * merge]])
        ids = torch.zeros((1, length), dtype=torch.long)
        pos, _ = Qwen3_5Model.get_rope_index(stand_in, ids, types, image_grid_thw=grid)
        return pos
