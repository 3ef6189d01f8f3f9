"""The vision side of ``check-release --vision``: a vision bundle proven to belong to the release,
then each image request's image through the host (numpy + Pillow) and the tower asset.

1. the bundle's files against its manifest (``gate.vision.check_files``); the release's files
   against the manifest's source digests (config, preprocessor config, every shard);
2. ``prepare``: the image file opened and preprocessed as the author's processor does (with the
   request's ``media_kwargs`` bounds), the bucket chosen (an image over the cap does not fit);
3. ``tower_rows``: one asset call per image, the padding's rows dropped: the rows the decoder's
   ``image_embeds`` takes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..digest import sha256_file
from ..errors import IntegrityError
from ..interrupts import run_async
from ..progress import plural
from .contract import INPUT_ORDER, Preprocessing, VisionConfig
from .preprocess import Grid


@dataclass(frozen=True)
class ShippedVision:
    bundle: Path
    asset: Path
    manifest: Any  # VisionManifest
    checks: list[tuple[str, bool, str]]
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


def open_vision(bundle: Path, release: Path, hidden_size: int) -> ShippedVision:
    from .bundle import check_files

    bundle, release = Path(bundle), Path(release)
    m, asset, checks = check_files(bundle)
    for name, want in sorted(m.source.files.items()):
        path = release / name
        if not path.is_file():
            raise IntegrityError(f"{path}: missing; the vision tower {bundle} was built from a release that has it")
        if sha256_file(path) != want:
            raise IntegrityError(f"{path}: sha256 differs from {bundle}'s manifest: the tower was built from another release")
    checks.append(("release vision files = bundle's source", True, f"{plural(len(m.source.files), 'file')}"))
    cfg = VisionConfig(**m.tower.vision_config)
    if cfg.out_hidden_size != hidden_size:
        raise IntegrityError(f"{bundle}: image rows of {cfg.out_hidden_size} values; the decoder takes {hidden_size}")
    pre = Preprocessing(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in m.preprocess.model_dump().items()
                           if k != "rule"})
    return ShippedVision(bundle=bundle, asset=asset, manifest=m, checks=checks, cfg=cfg, pre=pre)


def _bounds(media_kwargs: dict[str, Any] | None) -> dict[str, int | None]:
    """The request's pixel bounds as the processor reads them (``size`` or min / max_pixels)."""
    kw = dict(media_kwargs or {})
    size = kw.get("size") or {}
    return {"max_pixels": kw.get("max_pixels", size.get("longest_edge")),
            "min_pixels": kw.get("min_pixels", size.get("shortest_edge"))}


def prepare(vision: ShippedVision, file: Path, media_kwargs: dict[str, Any] | None = None) -> PreparedImage:
    from .host import choose_bucket
    from .preprocess import open_image, pixel_patches

    patches, grid = pixel_patches(open_image(file), vision.pre, **_bounds(media_kwargs))
    return PreparedImage(file=file, patches=patches, grid=grid, bucket=choose_bucket(grid.tokens, vision.buckets))


def tower_rows(vision: ShippedVision, images: Sequence[PreparedImage]) -> list[np.ndarray]:
    """The tower asset's rows ``[N, out_hidden]`` (fp32) of each image, one call each."""
    from ..progress import progress
    from .host import image_rows, tower_inputs

    async def run() -> list[np.ndarray]:
        from coreai.authoring.asset import AIModelAsset
        from coreai.runtime import NDArray

        from ..quiet import native_stderr
        from ..tmpdirs import owned_tempdir

        out = []
        with native_stderr(), owned_tempdir():
            async with AIModelAsset.load(vision.asset).executable() as model:
                with progress(f"vision: {plural(len(images), 'image')}", len(images), "calls") as tick:
                    for im in images:
                        call = tower_inputs(im.patches, im.grid, vision.cfg, im.bucket)
                        fn = model.load_function(call.function)
                        if fn is None:
                            raise IntegrityError(f"{vision.asset}: function {call.function} not found")
                        res = await fn({k: NDArray(np.ascontiguousarray(call.inputs[k])) for k in INPUT_ORDER})
                        out.append(image_rows(np.array(res["image_embeds"].numpy(), dtype=np.float32, copy=True), call))
                        tick()
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_async(run)
