"""What a Core AI model's export step (the decoder's, the tower's) does around its asset: the saved
files' digests (main.mlirb's from main.hash, which the save wrote from its own hash), the export's
seconds, and the manifest and build record written into the staged bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..bundle import atomic_write_json
from ..digest import sha256_file, tree_files
from ..layout import MANIFEST_FILE
from ..provenance import build_record
from .config import Made, BuildPlan

STAGES = ("weights", "trace", "convert", "save")


def asset_outputs(asset_dir: Path) -> dict[str, str]:
    """Every file of the saved asset -> sha256, relative to the bundle (main.mlirb not read again)."""
    known = {"main.mlirb": (asset_dir / "main.hash").read_bytes().hex()}
    return {f"{asset_dir.name}/{k}": v for k, v in tree_files(asset_dir, known).items()}


def export_seconds(timings: dict[str, Any]) -> dict[str, float]:
    seconds = {k: round(timings[k], 3) for k in STAGES}
    seconds["total"] = round(sum(seconds.values()), 3)
    return seconds


def made(p: BuildPlan, tmp: Path, manifest: BaseModel, outputs: dict[str, str], hidden_size: int,
         record: dict[str, Any], seconds: dict[str, float]) -> Made:
    """The manifest and the build record written into the staged bundle ``tmp``."""
    atomic_write_json(tmp / MANIFEST_FILE, manifest.model_dump(mode="json"))
    outputs[MANIFEST_FILE] = sha256_file(tmp / MANIFEST_FILE)
    rec = build_record(p.cfg.recipe, p.cfg.recipe_path, p.pins, dict(sorted(outputs.items())), hidden_size, record)
    return Made(manifest=manifest, record=rec, seconds={k: v for k, v in seconds.items() if k != "total"})
