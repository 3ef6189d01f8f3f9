"""What a build is asked (``BuildConfig``), what its plan found (``BuildPlan``: pins loaded once, the
resolved source, the checked digests, the model's own findings, typed by the model), and what it made (``BuildResult``).
The plan is made once and handed to the export, the manifest and the gate: nothing is re-derived."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import UsageError


@dataclass(frozen=True)
class BuildConfig:
    recipe: Any  # recipe.Recipe or recipe.BackboneRecipe: its ``model`` picks the build steps
    recipe_path: Path
    source: Path | None
    pins_path: Path
    out: Path
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = True
    verify_records: int | None = None  # head only: records per function for the gate
    format: str | None = None  # --format as given (None: the recipe's)
    aot: bool = False
    name: str | None = None  # the release's name in the bundle's name (default: the pins')


@dataclass
class BuildPlan:
    cfg: BuildConfig
    pins: Any  # sources.pins.Pins
    source: Path
    bundle: Path
    files: dict[str, str]  # file -> sha256, checked (or, for ``deferred``, checked beside the export)
    info: dict[str, Any]  # what --dry-run prints
    deferred: list[str] = field(default_factory=list)
    found: Any = None  # the model's own findings, its own frozen type (build.backbone.Found, build.vision.Found)
    handoff: Any = None  # what the export hands the gate, the model's own type (build.backbone.Handoff)


@dataclass
class Made:
    """What a model's export step put in the staged bundle."""

    manifest: BaseModel
    record: dict[str, Any]
    seconds: dict[str, float]  # the export's own stages


@dataclass
class BuildResult:
    bundle: Path
    manifest: BaseModel | None
    record: dict[str, Any]
    plan: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # plan, export, gate, total: the whole command


def bundle_name(recipe: Any, pins, name: str | None = None) -> str:
    """The recipe's name for this release: ``--name``, else the pins' release name."""
    release = name or pins.release_name
    if not re.fullmatch(r"[A-Za-z0-9_]+", release):
        raise UsageError(f"release name {release!r}: letters, digits and _ only")
    return recipe.bundle_name(release)


def resolve_output(cfg: BuildConfig) -> tuple[Any, Path, Path]:
    """Every build's first checks: the pins (loaded once), the bundle's final path (free, or
    ``--overwrite``), and the source folder the pins resolve to."""
    from ..bundle import check_output_path
    from ..sources.fetch import resolve_source
    from ..sources.pins import load_pins

    pins = load_pins(cfg.pins_path)
    final = Path(cfg.out) / bundle_name(cfg.recipe, pins, cfg.name)
    check_output_path(final, cfg.overwrite)
    return pins, final, resolve_source(cfg.source, pins)


def refuse_head_options(cfg: BuildConfig, model: str, bundle: str, gate_runs: str) -> None:
    """A Core AI model other than the head takes no ``--format``, ``--verify-records`` or ``--aot``:
    exit 2 naming the option and the model (``model``: "a backbone", ``bundle``: "a backbone bundle",
    ``gate_runs``: what its gate runs instead)."""
    from ..formats import aimodel

    if cfg.format is not None and cfg.format != aimodel.FORMAT:
        raise UsageError(f"{cfg.recipe_path}: --format {cfg.format}: {model} is built as a Core AI asset only")
    if cfg.verify_records is not None:
        raise UsageError(f"{cfg.recipe_path}: --verify-records is for a head's gate; {model}'s gate runs {gate_runs}")
    if cfg.aot:
        raise UsageError(f"{cfg.recipe_path}: --aot is not offered for {bundle} yet")
