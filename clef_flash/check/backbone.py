"""check-release's decoder part: the backbone bundle opened against the release, its bar, and the hidden
rows its asset computes chunk by chunk for the head to read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# With ``--backbone`` the hidden rows are the backbone asset's, so the bar is the backbone's when wider.
BACKBONE_BARS: dict[str, dict[str, Any]] = {
    "fp32": {"max_abs_dp": 1e-5, "mean_abs_dp": None,
             "reason": "the backbone computes in fp32 on fp16-stored bf16 weights (exact): its hidden rows are the "
                       "reference's up to fp32 accumulation order (the backbone gate's 1e-5 relative), and the head's "
                       "bar must still hold"},
    "fp16": {"max_abs_dp": 0.02, "mean_abs_dp": 0.002,
             "reason": "the backbone computes in fp16 as Mac hosts run it (about 1e-3 relative on its hidden rows): "
                       "the published port's bar (max 0.02, mean 0.002, argmax equal where the margin exceeds 0.02; "
                       "it measured 0.0112 on a Mac GPU)"},
    # compressed weights (either compute): the quantization moves the answers; the published port's bar
    "compressed": {"max_abs_dp": 0.02, "mean_abs_dp": 0.002,
                   "reason": "int8 / int4 weights: the quantization's cost end to end, against the published port's bar "
                             "(max 0.02, mean 0.002, argmax equal where the margin exceeds 0.02; its int8 with layers 0-11 "
                             "fp16 measured 0.0153 on a Mac GPU, every layer int8 0.075)"},
}


def open_part(path: Path, release: Path, hidden_size: int, hashed: dict[str, str]):
    """The backbone bundle checked against the release (``hashed``: release files hashed once for every part)."""
    from ..backbone.shipped import open_backbone

    return open_backbone(Path(path), release, hidden_size, hashed)


def bar(backbone, head_bar: float, head_reason: str) -> tuple[float, str, float | None]:
    """(max |dp| bar, its reason, mean |dp| bar): the backbone's bar where it is wider than the head's."""
    bb = BACKBONE_BARS["compressed" if backbone.manifest.export.weights != "fp16" else backbone.compute]
    if bb["max_abs_dp"] > head_bar:
        return bb["max_abs_dp"], bb["reason"], bb["mean_abs_dp"]
    return head_bar, f"{head_reason}; {bb['reason']}", bb["mean_abs_dp"]


def hidden_rows(backbone, red: str | None, seen_by, spans, entries, engine: str = "auto", device: str = "auto") -> list[Any]:
    """The backbone asset's hidden rows on the reference's token ids (an image's rows in ``spans``),
    each entry given its distance from the reference's rows; ``engine`` runs the asset."""
    from ..backbone.shipped import hidden_rows as run

    hiddens = run(backbone, [seen.ids for _, seen, _, _ in seen_by], red=red, images=spans, engine=engine, device=device)
    for (i, seen, _, _), h in zip(seen_by, hiddens, strict=True):
        entries[i]["backbone_rel_max_abs_d"] = float(np.abs(h - seen.hidden).max()
                                                     / max(float(np.abs(seen.hidden).max()), 1e-30))
    return hiddens


def summary(backbone, entries, seconds: float) -> dict[str, Any] | None:
    """The transcript summary's ``backbone`` section."""
    if backbone is None:
        return None
    bb_rel = [e["backbone_rel_max_abs_d"] for e in entries if "backbone_rel_max_abs_d" in e]
    return {"bundle": str(backbone.bundle), "compute": backbone.compute, "weights": backbone.manifest.export.weights,
            "asset_sha256": backbone.manifest.export.main_mlirb.sha256,
            "hidden_rel_max_abs_d": max(bb_rel, default=0.0), "seconds": seconds, "engine": backbone.ran_on.get("engine")}
