"""The vision side of ``check-release --vision``: a vision bundle proven to belong to the release,
then each image request's image through the host (numpy + Pillow) and the tower asset.

How it works: docs/modules.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..engine.bundle_read import OpenedBundle
from ..errors import IntegrityError, UsageError
from ..interrupts import run_async
from ..progress import plural
from .contract import Preprocessing, VisionConfig
from .preprocess import Grid


@dataclass(frozen=True)
class ShippedVision(OpenedBundle):  # manifest: VisionManifest
    cfg: VisionConfig
    pre: Preprocessing

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.manifest.interface.buckets)

    @property
    def cap(self) -> int:
        return self.manifest.interface.cap_tokens


@dataclass
class PreparedImage:
    file: Path
    patches: np.ndarray  # [P, C*T*p*p] fp32, the processor's order
    grid: Grid
    bucket: int | None  # None: over the cap


def read_vision(bundle: Path, hidden_size: int) -> ShippedVision:
    """The bundle checked on its own (files, rows as wide as the decoder's)."""
    from .bundle import check_files

    bundle = Path(bundle)
    m, asset, checks = check_files(bundle)
    cfg = VisionConfig(**m.tower.vision_config)
    if cfg.out_hidden_size != hidden_size:
        raise IntegrityError(f"{bundle}: image rows of {cfg.out_hidden_size} values; the decoder takes {hidden_size}")
    pre = Preprocessing(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in m.preprocess.model_dump().items()
                           if k != "rule"})
    return ShippedVision(bundle=bundle, asset=asset, manifest=m, checks=checks, cfg=cfg, pre=pre)


def open_vision(bundle: Path, release: Path, hidden_size: int, digests: dict[str, str] | None = None) -> ShippedVision:
    """The bundle checked, and checked to be this release's tower (``digests``: as ``open_backbone``'s)."""
    from ..engine.bundle_read import check_built_from

    v = read_vision(bundle, hidden_size)
    v.checks.append(check_built_from(Path(bundle), Path(release), v.manifest.source.files, "vision tower", digests))
    return v


def pixel_bounds(media_kwargs: dict[str, Any] | None) -> dict[str, int | None]:
    """The request's pixel bounds as the processor reads them (``size`` or min / max_pixels), each a
    whole number of pixels (``UsageError`` otherwise: a request's input, never a crash deeper in)."""
    kw = dict(media_kwargs or {})
    size = kw.get("size") or {}
    if not isinstance(size, dict):
        raise UsageError(f"media_kwargs size must be an object (shortest_edge, longest_edge), got {size!r}")
    out = {"max_pixels": kw.get("max_pixels", size.get("longest_edge")),
           "min_pixels": kw.get("min_pixels", size.get("shortest_edge"))}
    for k, v in out.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise UsageError(f"media_kwargs {k} must be a whole number of pixels (1 and up), got {v!r}")
    if out["max_pixels"] is not None and out["min_pixels"] is not None and out["min_pixels"] > out["max_pixels"]:
        raise UsageError(f"media_kwargs min_pixels {out['min_pixels']} is over max_pixels {out['max_pixels']}")
    return out


def prepare(vision: ShippedVision, file: Path, media_kwargs: dict[str, Any] | None = None) -> PreparedImage:
    from .host import choose_bucket
    from .preprocess import open_image, pixel_patches

    patches, grid = pixel_patches(open_image(file), vision.pre, **pixel_bounds(media_kwargs))
    return PreparedImage(file=file, patches=patches, grid=grid, bucket=choose_bucket(grid.tokens, vision.buckets))


def tower_rows(vision: ShippedVision, images: Sequence[PreparedImage]) -> list[np.ndarray]:
    """The tower asset's rows ``[N, out_hidden]`` (fp32) of each image, one call each."""
    from ..progress import progress
    from .runtime import runner

    async def run() -> list[np.ndarray]:
        out = []
        async with runner(vision.asset, vision.cfg) as (call, _functions):
            with progress(f"vision: {plural(len(images), 'image')}", len(images), "calls") as tick:
                for im in images:
                    out.append((await call(im.patches, im.grid, im.bucket))[0])
                    tick()
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_async(run)
