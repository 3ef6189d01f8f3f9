"""How much each decoder layer's answers move when its linears are compressed, measured on the
release's own weights, one layer in memory at a time (``reference.StreamedTextModel``).

How it works: docs/modules.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .contract import layer_of
from .held_weights import OnUse
from ..engine.streamed_weights import TensorInfo, raw_blocks, scale_exponent


def dequantized_release(folder: Path, t: TensorInfo, scheme, scaled: bool) -> np.ndarray:
    """The release tensor as the compressed asset computes with it (fp32): codes and scales of the
    values times ``2**k`` (fp32 compute; ``k`` by the build's rule), dequantized, times ``2**-k``."""
    return dequantized_wide(folder, t, scheme, scaled).numpy()


def dequantized_wide(folder: Path, t: TensorInfo, scheme, scaled: bool):
    """``dequantized_release`` as a torch tensor: the build's quantizer (``quantize.scales_torch`` /
    ``codes_torch``, held equal to the gate's numpy rule by tests) over row tiles in the CPU's
    cache, each tile's fp16 values written into one fp32 tensor (exact), times ``2**-k``. The
    release's bytes are read twice from the page cache (the largest magnitude, then the tiles)
    rather than held whole: the tensor is read again at each use (``held_weights.OnUse``)."""
    import torch

    from ..engine.quantize import codes_torch, dequantize_torch, scales_torch
    from ..engine.streamed_weights import TILE_VALUES, torch_view

    rows, cols = t.shape
    out = torch.empty((rows, cols), dtype=torch.float32)
    k = 0
    if scaled and rows:
        top = 0.0
        for _, _, raw in raw_blocks(folder, t):
            block = torch_view(raw, t.dtype)
            top = max(top, abs(float(block.min())), abs(float(block.max())))
        k = scale_exponent(top)
    step = max(1, TILE_VALUES // cols)
    work = torch.empty(step * cols, dtype=torch.float32)
    w = torch.empty(step * cols, dtype=torch.float32)
    for r0, r1, raw in raw_blocks(folder, t):
        block = torch_view(raw, t.dtype).view(r1 - r0, cols)
        for a in range(0, r1 - r0, step):  # a row's codes depend on that row alone: tiles may start anywhere
            tile = w[: min(step, r1 - r0 - a) * cols].view(-1, cols)
            tile.copy_(block[a:a + step])
            if k:
                tile.mul_(2.0 ** k)
            scales = scales_torch(tile, scheme, work)
            out[r0 + a:r0 + a + len(tile)] = dequantize_torch(codes_torch(tile, scales, scheme, work), scales, scheme, work)
    if k:
        out.mul_(2.0 ** -k)  # as ``held_weights.widen``: exact
    return out


class Dequantizer:
    """name -> the dequantized release tensor, for the names of ``layers`` (None elsewhere), read
    where it is used (``OnUse``: ``dequantized_wide``; a reference that holds its weights reads it
    once, on load)."""

    def __init__(self, folder: Path, infos: dict[str, TensorInfo], scheme, compressed: list[str], scaled: bool) -> None:
        self.folder, self.infos, self.scheme, self.scaled = Path(folder), infos, scheme, scaled
        self.compressed = set(compressed)
        self.layers: set[int] = set()

    def __call__(self, name: str) -> OnUse | None:
        if name in self.compressed and layer_of(name) in self.layers:
            t = self.infos[name]
            return OnUse(lambda: dequantized_wide(self.folder, t, self.scheme, self.scaled))
        return None


class LayerOutputs:
    """Every decoder layer's uncompressed output for every record (fp32 ``[T, H]``), in files of a
    folder of this process's own (1.4 GB at the 9B with four requests: not held in memory), so that
    a trial whose first compressed layer is ``k`` starts there (``rows_with``). A context manager:
    the folder goes at the block's end, and a killed process's is swept by the next
    (``tmpdirs``)."""

    def __init__(self, parent: Path | None = None) -> None:
        from ..tmpdirs import owned_folder

        self.path = owned_folder(parent, "layer-outputs")

    def put(self, layer: int, record: int, value: np.ndarray) -> None:
        self.save(f"{layer}-{record}.npy", value)

    def save(self, name: str, value: np.ndarray) -> None:
        """``value`` as fp32 in ``name`` of the folder; a full disk an ``OutputError`` naming the folder."""
        try:
            np.save(self.path / name, np.ascontiguousarray(value, dtype=np.float32))
        except OSError as exc:
            raise self._full(exc) from None

    def keep(self, name: str, obj) -> Path:
        """``obj`` saved by torch as ``name`` of the folder; a full disk an ``OutputError``."""
        import torch

        path = self.path / name
        try:
            torch.save(obj, path)
        except OSError as exc:
            raise self._full(exc) from None
        return path

    def mapped(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A new fp32 ``.npy`` file ``name`` of the folder, mapped for writing, its blocks reserved
        first: on a full disk a write through a map is a SIGBUS, which no handler can turn into an
        error (plan-weights died of it, exit -7, its folder left); a reservation that finds no room
        is an ``OutputError`` naming the folder, before anything is written."""
        import os

        path = self.path / name
        try:
            out = np.lib.format.open_memmap(path, "w+", np.float32, shape)  # a sparse file: nothing written yet
            if hasattr(os, "posix_fallocate"):  # not on macOS, where the map's pages are taken as written
                fd = os.open(path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise self._full(exc) from None
        return out

    def _full(self, exc: OSError):
        from ..errors import OutputError

        return OutputError(f"{self.path.parent}: cannot write plan-weights' layer outputs ({exc.strerror or exc})")

    def entering(self, layer: int, record: int) -> np.ndarray | None:
        """The hidden states entering ``layer`` for ``record`` (None for layer 0: the embedding)."""
        return np.load(self.path / f"{layer - 1}-{record}.npy") if layer > 0 else None

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "LayerOutputs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rows_with(ref, records: list[np.ndarray], deq: Dequantizer, compressed_layers: set[int], tick=lambda: None,
              outputs: LayerOutputs | None = None, which: list[int] | None = None):
    """Every record's hidden rows (those numbered ``which`` alone, when given) through ``ref`` (a
    ``reference.StreamedTextModel``) with ``compressed_layers``' linears dequantized (fp32 eager);
    with the uncompressed pass's ``outputs``, from the first compressed layer on (each layer alone:
    about half the layers run, summed over the layers)."""
    deq.layers = set(compressed_layers)
    ref.weights, kept = deq, ref.weights
    try:
        first = min(compressed_layers, default=0) if outputs is not None else 0
        out = []
        for r in range(len(records)) if which is None else which:
            out.append(ref.rows(records[r], start=(first, outputs.entering(first, r)) if first else None))
            tick()
        return out
    finally:
        ref.weights = kept
