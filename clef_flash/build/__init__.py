"""The build stage: plan -> staged bundle -> the model's export (a worker process) -> manifest and
build record -> the model's gate on the staged bundle -> rename into place.

How it works: docs/modules.md."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import ModuleType

from ..bundle import atomic_write_json, output_lock, staged_dir
from ..errors import ClefError
from ..layout import RECORD_FILE
from . import backbone, head, vision
from .config import BuildConfig, BuildResult, BuildPlan, bundle_name

MODELS: dict[str, ModuleType] = {m.MODEL: m for m in (head, backbone, vision)}

__all__ = ["MODELS", "BuildConfig", "BuildResult", "BuildPlan", "build", "bundle_name", "plan", "steps"]


@contextlib.contextmanager
def _named_as(staged: Path, final: Path):
    """An error from inside the staged bundle names the bundle being built, not the temporary
    folder that is about to vanish."""
    try:
        yield
    except ClefError as exc:
        text = str(exc)
        if str(staged) in text:
            raise type(exc)(text.replace(str(staged), str(final))) from None
        raise


def steps(recipe) -> ModuleType:
    """The build steps of the recipe's model (``recipe.load_recipe`` refused an unknown one)."""
    return MODELS[recipe.model]


def plan(cfg: BuildConfig, log=lambda msg: None) -> BuildPlan:
    """Everything checked that can be checked before the work: what ``--dry-run`` shows."""
    s = steps(cfg.recipe)
    s.refuse(cfg)
    return s.plan(cfg, log, defer=not cfg.dry_run)


def build(cfg: BuildConfig, log=lambda msg: None) -> BuildResult:
    """Plan, export, manifest, record, gate, land; ``seconds`` times the whole command by stage."""
    t_start = time.perf_counter()
    s = steps(cfg.recipe)
    p = plan(cfg, log)
    seconds = {"plan": time.perf_counter() - t_start}
    if cfg.dry_run:
        return BuildResult(bundle=p.bundle, manifest=None, record={}, plan=p.info, seconds=seconds)
    with output_lock(p.bundle), staged_dir(p.bundle, cfg.overwrite) as tmp, _named_as(tmp, p.bundle):
        t0 = time.perf_counter()
        made = s.export(p, tmp, log)
        seconds["export"] = time.perf_counter() - t0
        record = made.record
        if cfg.verify and cfg.recipe.verify.enabled:
            t0 = time.perf_counter()
            report = s.gate(p, tmp, log)
            seconds["gate"] = time.perf_counter() - t0
            record["verify"] = {**report.summary(), "headline": report.headline()}
            report.raise_for_failures()  # the staged bundle is discarded: nothing lands
        atomic_write_json(tmp / RECORD_FILE, record)
    seconds["total"] = time.perf_counter() - t_start
    return BuildResult(bundle=p.bundle, manifest=made.manifest, record=record, plan=p.info,
                       seconds={**{k: round(v, 3) for k, v in seconds.items()}, "export_stages": made.seconds})
