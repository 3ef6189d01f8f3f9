"""The image processor's rule in numpy + Pillow (no torch): what ``Qwen2VLImageProcessor`` does to
one image, bit for bit (``tests/test_vision.py`` holds it equal to transformers' own class).

How it works: docs/modules.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .contract import Preprocessing

MAX_ASPECT = 200  # the processor refuses a longer side over 200 times the shorter


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: sides multiples of ``factor``, aspect kept, pixels in range.
    Python's ``round`` (half to even) and float math as the processor computes them."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Grid:
    """An image's patch grid after the resize: ``rows`` x ``cols`` patches (multiples of merge)."""

    rows: int
    cols: int
    merge: int

    @property
    def patches(self) -> int:
        return self.rows * self.cols

    @property
    def tokens(self) -> int:
        return self.patches // (self.merge * self.merge)

    @property
    def merged(self) -> tuple[int, int]:
        """The merged grid (H, W) the decoder's positions use."""
        return self.rows // self.merge, self.cols // self.merge


def target_grid(width: int, height: int, pre: Preprocessing, max_pixels: int | None = None,
                min_pixels: int | None = None) -> Grid:
    h, w = smart_resize(height, width, pre.factor, pre.min_pixels if min_pixels is None else min_pixels,
                        pre.max_pixels if max_pixels is None else max_pixels)
    return Grid(h // pre.patch_size, w // pre.patch_size, pre.merge_size)


def open_image(path: Path):
    """The image as transformers' ``load_image`` opens a file: EXIF orientation applied, RGB."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            return im.convert("RGB")
    except FileNotFoundError:
        raise UsageError(f"{path}: image not found") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise UsageError(f"{path}: not an image Pillow can read ({str(exc).splitlines()[0][:120]})") from None


def pixel_patches(image, pre: Preprocessing, max_pixels: int | None = None,
                  min_pixels: int | None = None) -> tuple[np.ndarray, Grid]:
    """``pixel_values [gh * gw, C*T*p*p] fp32`` and the grid of one RGB Pillow image."""
    from PIL import Image

    width, height = image.size
    grid = target_grid(width, height, pre, max_pixels, min_pixels)
    p, m, t = pre.patch_size, pre.merge_size, pre.temporal_patch_size
    resized = image.resize((grid.cols * p, grid.rows * p), resample=Image.Resampling.BICUBIC)
    x = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)  # [C, H, W]
    x = (x.astype(np.float64) * pre.rescale_factor).astype(np.float32)
    mean, std = np.asarray(pre.image_mean, np.float32), np.asarray(pre.image_std, np.float32)
    x = ((x.T - mean) / std).T
    c = x.shape[0]
    x = x.reshape(c, grid.rows // m, m, p, grid.cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(grid.patches, c * t * p * p)), grid
