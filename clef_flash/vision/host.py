"""numpy only: the tower's inputs for one image, padded to a bucket, and the rows it returns.

What transformers derives from ``grid_thw`` inside its forward is computed here, in the same
float32 arithmetic (``vision_utils``): the bilinear taps that resample the learned position table
(align_corners: ``src = i * (side - 1) / max(n - 1, 1)``), each patch's (row, column) for the
2-D rotary, both in the processor's merge-block-major patch order. One image per call: the
attention spans the image's patches, and the ``patch_count`` mask hides the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contract import TAPS, VisionConfig, function_name
from .preprocess import Grid


def block_order(grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in merge-block-major order (``get_vision_position_ids``)."""
    m = grid.merge
    r, c = np.meshgrid(np.arange(grid.rows), np.arange(grid.cols), indexing="ij")
    shape = (grid.rows // m, m, grid.cols // m, m)
    return (r.reshape(shape).transpose(0, 2, 1, 3).reshape(-1).astype(np.int64),
            c.reshape(shape).transpose(0, 2, 1, 3).reshape(-1).astype(np.int64))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0)).astype(np.float32)


def position_taps(grid: Grid, side: int) -> tuple[np.ndarray, np.ndarray]:
    """``pos_index [P, 4]`` and ``pos_weight [P, 4]`` of the image's patches."""
    rows, cols = block_order(grid)
    ht, hw = _axis_taps(rows, grid.rows, side)
    wt, ww = _axis_taps(cols, grid.cols, side)
    index = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, TAPS)
    weight = (hw[:, :, None] * ww[:, None, :]).reshape(-1, TAPS)
    return index, weight


@dataclass(frozen=True)
class TowerCall:
    """One call of the tower asset: the function and its inputs."""

    function: str
    tokens: int  # the bucket's N
    inputs: dict[str, np.ndarray]
    grid: Grid


def choose_bucket(tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``tokens`` (None: over the cap)."""
    return next((b for b in buckets if b >= tokens), None)


def tower_inputs(patches: np.ndarray, grid: Grid, cfg: VisionConfig, bucket: int) -> TowerCall:
    """The image's patches and grid tensors, zero-padded to ``bucket`` tokens."""
    n = grid.patches
    size = bucket * cfg.merge_unit
    if n > size:
        raise ValueError(f"{grid.tokens} vision tokens do not fit the bucket of {bucket}")
    if patches.shape != (n, cfg.patch_dim):
        raise ValueError(f"patches {patches.shape}, expected {(n, cfg.patch_dim)}")
    index, weight = position_taps(grid, cfg.side)
    rows, cols = block_order(grid)
    out = {"patches": np.zeros((size, cfg.patch_dim), np.float32), "pos_index": np.zeros((size, TAPS), np.int32),
           "pos_weight": np.zeros((size, TAPS), np.float32), "patch_rc": np.zeros((size, 2), np.int32),
           "patch_count": np.array([n], np.int32)}
    out["patches"][:n] = patches
    out["pos_index"][:n] = index
    out["pos_weight"][:n] = weight
    out["patch_rc"][:n, 0], out["patch_rc"][:n, 1] = rows, cols
    return TowerCall(function=function_name(bucket), tokens=bucket, inputs=out, grid=grid)


def image_rows(output: np.ndarray, call: TowerCall) -> np.ndarray:
    """The image's ``[N, out_hidden]`` rows of a call's ``image_embeds`` (the padding's dropped)."""
    return np.asarray(output)[: call.grid.tokens]
