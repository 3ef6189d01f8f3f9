"""The backbone side of ``check-release --backbone``: a backbone bundle proven to belong to the
release, then every request's token ids through its asset by the host loop.

How it works: docs/modules.md."""

from __future__ import annotations

import asyncio
import os

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..digest import sha256_file
from ..engine.bundle_read import OpenedBundle, check_built_from
from ..errors import IntegrityError
from ..interrupts import gather_all, run_async
from ..progress import plural

# check-release's red arm name -> the host loop's
RED = {"state": "state_reset"}


@dataclass(frozen=True)
class ShippedBackbone(OpenedBundle):  # manifest: BackboneManifest
    ran_on: dict = field(default_factory=dict)  # "engine": what ran it last (executor.EngineInfo.describe)

    @property
    def compute(self) -> str:
        return self.manifest.export.compute

    @property
    def max_context(self) -> int:
        return self.manifest.language.max_context

    def does_not_fit(self, tokens: int) -> str | None:
        """Why a record of ``tokens`` tokens cannot run through this backbone, or None."""
        from .contract import chunks_for

        chunk = self.manifest.language.prefill_chunk
        if chunks_for(tokens, chunk) * chunk > self.max_context:
            return f"{tokens} tokens in chunks of {chunk} exceed the backbone's context of {self.max_context}"
        return None


def read_backbone(bundle: Path, hidden_size: int, hashed: bool = True, release: Path | None = None,
                  digests: dict[str, str] | None = None) -> ShippedBackbone:
    """The bundle checked (files, ``release``'s when given, hidden size, descriptor); ``IntegrityError``
    naming the first file that is not right. ``hashed=False``: main.mlirb's digest already checked by
    the caller (a release's SHA256SUMS)."""
    from .bundle import check_files, descriptor_checks

    bundle = Path(bundle)
    m, asset, checks = check_files(bundle, hashed=hashed)
    if release is not None:  # which release it came from is said before any other mismatch
        release = Path(release)
        checks.append(check_built_from(bundle, release, m.source.files, "backbone", digests))
        for name, want in sorted(m.tokenizer.items()):
            path = release / name
            if not path.is_file() or sha256_file(path) != want:
                raise IntegrityError(f"{path}: missing or differs from {bundle}/tokenizer/{name}: the host would "
                                     f"tokenize otherwise than the author")
        checks.append(("release tokenizer = bundle's tokenizer/", True, f"{plural(len(m.tokenizer), 'file')}"))
    if m.language.hidden_size != hidden_size:
        raise IntegrityError(f"{bundle}: hidden rows of {m.language.hidden_size} values; the head takes {hidden_size}")
    desc = descriptor_checks(asset, m)
    bad = [f"{n}: {d}" for n, ok, d in desc if not ok]
    if bad:
        raise IntegrityError(f"{asset}: {bad[0]}")
    return ShippedBackbone(bundle=bundle, asset=asset, manifest=m, checks=checks + desc)


def open_backbone(bundle: Path, release: Path, hidden_size: int, digests: dict[str, str] | None = None) -> ShippedBackbone:
    """The bundle checked, and checked to be this release's backbone; ``IntegrityError`` naming the
    first file that is not."""
    return read_backbone(bundle, hidden_size, release=release, digests=digests)


def hidden_rows(bb: ShippedBackbone, records: Sequence[np.ndarray], red: str | None = None,
                images: Sequence[Any] | None = None, engine: str = "coreai", device: str = "auto") -> list[np.ndarray]:
    """Every record's hidden rows ``[T, hidden]`` (fp32), in the records' order (each record starts
    from zero states; several run at once). ``images``: per record a ``host.ImageSpan`` or None; an
    image's tokens go in as ids V + k and its rows as ``image_embeds`` (``red="image"``: its rows
    zeroed, the red arm). ``engine``: what runs the asset (``executor.choose_engine``)."""
    from .host import image_inputs, run_record
    from .manifest import functions_of
    from .runtime import runner

    m = bb.manifest
    from .host import image_ids

    vision = m.interface.vision  # a decoder with image inputs: text requests send the text-only values
    images = list(images) if images is not None else [None] * len(records)
    if any(im is not None for im in images) and vision is None:
        raise IntegrityError(f"{bb.bundle}: a text-only decoder (no image inputs): image requests need a backbone "
                             f"built with image_rows")

    def extra(image):
        if vision is None:
            return None
        dtype = np.float32 if vision.embeds_dtype == "fp32" else np.float16
        return image_inputs(vision.image_rows, m.language.hidden_size, dtype, image,
                            "image_zeroed" if red == "image" and image is not None else None)

    def sent(ids, image):
        return image_ids(ids, image, m.language.vocab_size) if image is not None else ids
    shapes = {n: tuple(int(x) for x in spec.shape) for n, spec in m.interface.states.items()}
    dtype = next(iter(m.interface.states.values())).dtype
    lang = m.language
    from .executor import EngineInfo, choose_engine

    choice = choose_engine(bb.bundle, m, engine, device)
    if choice.engine == "torch":
        if red in RED:
            raise IntegrityError(f"--red {red} breaks the runtime's host loop: run it on the coreai engine")
        return _torch_rows(bb, records, images, extra, sent, device)
    bb.ran_on["engine"] = EngineInfo("coreai", "cpu", m.export.compute).describe()

    async def run_all() -> list[np.ndarray]:
        from ..progress import counting, progress
        from .contract import chunks_for

        calls = sum(chunks_for(len(ids), lang.prefill_chunk) for ids in records)
        # records are independent (each its own zero states): two at a time, each record's chunks in
        # order, every answer the same; two, not one per core, so a wide backbone holds at most two
        # records' states and activations
        slots = asyncio.Semaphore(max(1, min(2, os.cpu_count() or 1)))
        async with runner(bb.asset, functions_of(m), shapes, dtype, lang.prefill_chunk) as (call, new_states):
            with progress(f"backbone: {plural(len(records), 'record')}", calls, "calls") as tick:
                counted = counting(call, tick)

                async def one(ids: np.ndarray, image) -> np.ndarray:
                    async with slots:
                        return await run_record(counted, new_states, sent(ids, image), lang.prefill_chunk,
                                                lang.pad_token_id, RED.get(red) if red else None, extra(image))

                return await gather_all(*[one(ids, im) for ids, im in zip(records, images, strict=True)])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_async(run_all)


def _torch_rows(bb: ShippedBackbone, records, images, extra, sent, device: str) -> list[np.ndarray]:
    """The records through the torch engine (``executor``), one at a time, a layer at a time."""
    from ..progress import progress
    from .executor import open_torch_decoder

    dec = open_torch_decoder(bb.bundle, bb.asset, bb.manifest, device, check_blobs=False)
    bb.ran_on["engine"] = dec.info.describe()
    layers = len(bb.manifest.language.layer_types)
    out = []
    with progress(f"backbone: {plural(len(records), 'record')}, torch engine on {dec.info.device}", layers * len(records),
                  "layers") as tick:
        for ids, image in zip(records, images, strict=True):
            out.append(dec.rows(sent(ids, image), extra(image), progress=lambda _i: tick()))
    return out
