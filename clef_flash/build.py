"""Build orchestration: plan -> staged bundle -> export worker -> manifest -> build record -> gate
-> rename into place.

``plan`` checks everything that can be checked cheaply (pins, source hashes, output path, free
space) before any heavy work. The bundle is built in a temporary sibling folder
(``bundle.staged_dir``): it appears complete or not at all, and a failed gate lands nothing.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from . import contract
from .author import check_author_trusted
from .backends import backend
from .bundle import atomic_write_json, check_output_path, output_lock, staged_dir
from .digest import sha256_file, tree_files
from .errors import OutputError, UsageError
from .gate import VerifyConfig, verify_bundle
from .layout import MANIFEST_FILE, RECORD_FILE
from .manifest import Seconds, common_fields
from .pins import CODE_FILE, WEIGHTS_FILE, load_pins
from .provenance import build_date, build_record
from .recipe import Recipe
from .worker import run_export


@dataclass(frozen=True)
class BuildConfig:
    recipe: Recipe
    recipe_path: Path
    source: Path | None
    pins_path: Path
    out: Path
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = True
    verify_records: int | None = None
    name: str | None = None  # the release's name in the bundle's name (default: the pins')


@dataclass
class BuildResult:
    bundle: Path
    manifest: BaseModel | None
    record: dict[str, Any]
    plan: dict[str, Any] = field(default_factory=dict)


def bundle_name(recipe: Recipe, pins, name: str | None = None) -> str:
    """The recipe's name for this release: ``--name``, else the pins' release name."""
    release = name or pins.release_name
    if not re.fullmatch(r"[A-Za-z0-9_]+", release):
        raise UsageError(f"release name {release!r}: letters, digits and _ only")
    return recipe.bundle_name(release)


def check_free_space(final: Path, weight_bytes: int) -> None:
    """Fail before the expensive work when the bundle cannot fit (weights once, plus the graph)."""
    probe = next(p for p in [final.parent, *final.parent.parents] if p.exists())
    need = weight_bytes + (64 << 10)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise OutputError(f"{probe}: not enough free space for the bundle (needs about {need:,} bytes, {free:,} free)")


def plan(cfg: BuildConfig) -> dict[str, Any]:
    """What a build would do; checks everything that can be checked without heavy work."""
    from .source import require_verified, resolve_source

    recipe = cfg.recipe
    pins = load_pins(cfg.pins_path)
    final = Path(cfg.out) / bundle_name(recipe, pins, cfg.name)
    check_output_path(final, cfg.overwrite)
    source = resolve_source(cfg.source, pins)
    checks = require_verified(source, pins)
    check_author_trusted(source / CODE_FILE, pins.files[CODE_FILE], pins.trusted_author_sha256)
    check_free_space(final, (source / WEIGHTS_FILE).stat().st_size * (1 if recipe.weights == "fp16w32" else 2))
    return {
        "recipe": str(cfg.recipe_path),
        "name": final.name,
        "format": recipe.format,
        "bundle": str(final),
        "source": str(source),
        "hf_id": pins.hf_id,
        "revision": pins.revision,
        "synthetic": pins.synthetic,
        "files": {c.name: c.actual for c in checks},
        "functions": [contract.function_name(b) for b in recipe.buckets],
        "weights": recipe.weights,
    }


def build(cfg: BuildConfig, log=lambda msg: None) -> BuildResult:
    """Verify, trace, convert, save, write the manifest and the record, and gate the saved asset."""
    recipe = cfg.recipe
    fmt = backend(recipe.format)
    t_start = time.perf_counter()
    info = plan(cfg)
    pins = load_pins(cfg.pins_path)
    source = Path(info["source"])
    final = Path(info["bundle"])
    if cfg.dry_run:
        return BuildResult(bundle=final, manifest=None, record={}, plan=info)
    with output_lock(final), staged_dir(final, cfg.overwrite) as tmp:
        asset_dir = tmp / f"{final.name}{fmt.SUFFIX}"
        timings = run_export(source, cfg.pins_path, recipe, asset_dir, log)
        hidden_size = int(timings["hidden_size"])

        # every output hashed once: the manifest and the build record share these digests
        outputs = {f"{asset_dir.name}/{k}": v for k, v in tree_files(asset_dir).items()}
        seconds = Seconds(build=timings["build"], export=timings["export"], optimize=0.0, save=timings["save"],
                          total=timings["build"] + timings["export"] + timings["save"])
        common = common_fields(name=final.name, asset=asset_dir.name, buckets=recipe.buckets, weights=recipe.weights,
                               pins=pins, hidden_size=hidden_size, date=build_date(), q_pad=recipe.q_pad,
                               o_pad=recipe.o_pad)
        manifest = fmt.manifest(common, recipe, asset_dir, outputs, seconds)
        atomic_write_json(tmp / MANIFEST_FILE, manifest.model_dump(mode="json"))
        outputs[MANIFEST_FILE] = sha256_file(tmp / MANIFEST_FILE)
        record = build_record(recipe, cfg.recipe_path, pins, dict(sorted(outputs.items())), hidden_size,
                              fmt.record_parameters())

        if cfg.verify and recipe.verify.enabled:
            log("verifying the saved asset against the author's head")
            report = verify_bundle(
                VerifyConfig(bundle=tmp, source=source, pins_path=cfg.pins_path,
                             records=cfg.verify_records or recipe.verify.records, seed=recipe.verify.seed),
                log=log,
            )
            record["verify"] = report.summary()
            report.raise_for_failures()  # the staged bundle is discarded: nothing lands
        atomic_write_json(tmp / RECORD_FILE, record)
        log(f"built in {time.perf_counter() - t_start:.1f} s")
    return BuildResult(bundle=final, manifest=manifest, record=record, plan=info)
