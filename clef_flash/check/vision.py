"""check-release's tower part: an image request the way a Mac host sends it (preprocessed by the host,
the tower asset at its native grid, its rows in the decoder's image inputs), held to the author's
processor and prompt."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

# the published port squashes an image to a square tile; its own measurement against native grids at 448^2
PORT_SQUARE_TILE_DP = 0.44


def failures(with_image: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in with_image:
        if "host_patches_equal" in e["image"] and not e["image"]["host_patches_equal"]:
            out.append(f"{e['id']}: the host's patches differ from the author's processor's pixel_values")
        if "host_prompt_equal" in e["image"] and not e["image"]["host_prompt_equal"]:
            out.append(f"{e['id']}: the host's image prompt (the text prompt, the image's N + 3 tokens inserted, "
                       f"the spans shifted) differs from the author's")
    return out


def host_prompt_equal(ref_model, body: dict[str, Any], seen, tokens: int) -> bool:
    """Whether the host's image prompt (``vision.prompt``: the same request's text-only prompt with
    the image's tokens inserted after the prefix and the spans shifted) is the author's."""
    from ..vision.prompt import insert_image, shift_span

    tok = ref_model.processor.tokenizer
    text = ref_model.encode({k: v for k, v in body.items() if k not in ("images", "media_kwargs")})
    at = seen.record.media.get("token_offset") if seen.record.media else None
    if at is None:
        return False
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    prompt = insert_image(text.input_ids, at, tokens, start_id=ids["<|vision_start|>"], pad_id=ids["<|image_pad|>"],
                          end_id=ids["<|vision_end|>"], newline=tok("\n", add_special_tokens=False).input_ids)
    spans = [(shift_span(q.question_span, prompt), tuple(shift_span(o, prompt) for o in q.option_spans)) for q in text.questions]
    theirs = [(q.question_span, tuple(q.option_spans)) for q in seen.record.questions]
    return prompt.ids == tuple(seen.ids.tolist()) and spans == theirs


def image_not_run(ref_model, backbone, vision) -> str | None:
    """Why an image request is listed as not run here, or None."""
    if not getattr(ref_model, "images", False):
        return getattr(ref_model, "why_no_images", None) or \
            "the release has no preprocessor_config.json nor processor_config.json: its processor cannot take images"
    if backbone is not None and vision is None:
        return "an image request through --backbone needs --vision (the tower asset computes the image's rows)"
    if backbone is not None and backbone.manifest.interface.vision is None:
        return f"{backbone.bundle} is a text-only decoder (built without image_rows)"
    return None


def image_spans(vision, ref_model, seen_by, prepared, entries):
    """The host's images through the tower asset: per checked request, the decoder's ImageSpan (its
    first image token's index in the author's ids, the tower's rows, the merged grid) or None."""
    from ..backbone.host import ImageSpan
    from ..vision.shipped import tower_rows

    t0 = time.perf_counter()
    order = [i for i, *_ in seen_by if i in prepared]
    rows = dict(zip(order, tower_rows(vision, [prepared[i] for i in order]), strict=True))
    image_id = ref_model.processor.image_token_id
    spans = []
    for i, seen, _, _ in seen_by:
        if i not in prepared:
            spans.append(None)
            continue
        im = prepared[i]
        where = np.flatnonzero(seen.ids == image_id)
        if len(where) != im.grid.tokens or (len(where) and where[-1] - where[0] + 1 != len(where)):
            raise RuntimeError(f"request {entries[i]['id']}: the author's prompt holds {len(where)} image tokens; the host's "
                               f"grid gives {im.grid.tokens}")
        if seen.image_rows is not None:
            want = seen.image_rows
            entries[i]["image"]["vision_rel_max_abs_d"] = float(np.abs(rows[i] - want).max() / max(float(np.abs(want).max()), 1e-30))
        spans.append(ImageSpan(start=int(where[0]), rows=rows[i], grid=im.grid.merged))
    return spans, time.perf_counter() - t0


def open_part(path: Path, release: Path, hidden_size: int, hashed: dict[str, str]):
    """The vision bundle checked against the release (``hashed``: as the backbone part's)."""
    from ..vision.shipped import open_vision

    return open_vision(Path(path), release, hidden_size, hashed)


def fit(req, entry: dict[str, Any], vision, backbone):
    """The host's image of a request (``vision.shipped.prepare``), or ``HostInputError`` saying which
    limit it passes (the tower's cap, the decoder's image rows)."""
    from ..head.host import HostInputError
    from ..vision.shipped import prepare

    im = prepare(vision, req.images[0], req.body.get("media_kwargs"))
    entry["image"].update({"tokens": im.grid.tokens, "grid": list(im.grid.merged)})
    if im.bucket is None:
        raise HostInputError(f"{im.grid.tokens} vision tokens ({im.grid.merged[0]} x {im.grid.merged[1]}) "
                             f"exceed the vision asset's cap of {vision.cap} (media_kwargs max_pixels "
                             f"bounds an image)")
    rows = backbone.manifest.interface.vision.image_rows
    if im.grid.tokens > rows:
        raise HostInputError(f"{im.grid.tokens} vision tokens exceed the backbone's {rows} image rows")
    return im


def record(entry: dict[str, Any], im, seen, ref_model, body: dict[str, Any]) -> None:
    """What the host's image gave against the author's processor and prompt, in the request's entry."""
    theirs = np.asarray(seen.record.media["pixel_values"])
    entry["image"]["host_patches_equal"] = bool(theirs.shape == im.patches.shape and np.array_equal(theirs, im.patches))
    entry["image"]["host_prompt_equal"] = host_prompt_equal(ref_model, body, seen, im.grid.tokens)
    entry["image"]["function"] = f"n{im.bucket}"


def summary(vision, with_image: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The transcript summary's ``images`` section."""
    image_dp = [c["max_abs_dp"] for e in with_image for c in e.get("compare", {}).values()]
    return {"requests": len(with_image), "through_vision": sum(1 for e in with_image if "function" in e["image"]),
            "max_abs_dp": max(image_dp, default=0.0),
            "vision_rel_max_abs_d": max((e["image"].get("vision_rel_max_abs_d", 0.0) for e in with_image), default=0.0),
            "host_patches_equal": all(e["image"].get("host_patches_equal", True) for e in with_image),
            "host_prompt_equal": all(e["image"].get("host_prompt_equal", True) for e in with_image),
            "native_grid": True, "port_square_tile_max_abs_dp": PORT_SQUARE_TILE_DP,
            "vision": None if vision is None else {"bundle": str(vision.bundle), "compute": vision.manifest.export.compute,
                                                   "asset_sha256": vision.manifest.export.main_mlirb.sha256,
                                                   "seconds": seconds}}
