"""A release in one command: build -> verify -> AOT (where the toolchain exists) -> ``dist/``.

How it works: docs/modules.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bundle import atomic_write_bytes, check_output_path, output_lock, staged_dir
from ..digest import tree_files
from ..errors import IntegrityError, ToolchainError, UsageError
from ..layout import HOST_DIR, LICENSE_FILES, SUMS_FILE, VECTORS_FILE
from ..recipe import AnyRecipe
from ..progress import plural



@dataclass(frozen=True)
class ReleaseConfig:
    recipes: tuple[tuple[AnyRecipe, Path], ...]  # (recipe, its file), one bundle each
    source: Path | None
    pins_path: Path
    dist: Path
    overwrite: bool = False
    verify_records: int | None = None
    aot: str = "auto"  # auto: when `xcrun -f coreai-build` finds one; on: required; off
    name: str | None = None  # the release's name in the bundles' names (default: the pins')


def release(cfg: ReleaseConfig, log=lambda msg: None) -> dict[str, Any]:
    """Every recipe built and verified into one staged ``dist/``; AOT for the ``.aimodel`` ones."""
    from ..build.aot import AotConfig, aot_compile, find_coreai_build
    from ..build import BuildConfig, build, bundle_name, steps
    from ..sources.pins import load_pins

    dist = Path(cfg.dist)
    check_output_path(dist, cfg.overwrite)
    pins = load_pins(cfg.pins_path)
    names = [bundle_name(r, pins, cfg.name) for r, _ in cfg.recipes]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"release needs one or more recipes with distinct names, got {names}")
    compilable = any(steps(r).compiles(r) for r, _ in cfg.recipes)
    whole = any(steps(r).SHIPS_LM_HEAD_TABLE for r, _ in cfg.recipes)
    do_aot = cfg.aot == "on"
    if do_aot and not compilable:
        raise UsageError("--aot on: coreai-build compiles .aimodel assets, and no recipe builds one")
    if cfg.aot == "auto" and compilable:
        try:
            find_coreai_build()
            do_aot = True
        except ToolchainError as exc:
            log(f"no AOT compile: {exc}")
    elif do_aot:
        find_coreai_build()
    bundles = []
    with output_lock(dist), staged_dir(dist, cfg.overwrite) as tmp:
        for recipe, recipe_path in cfg.recipes:
            bcfg = BuildConfig(recipe=recipe, recipe_path=recipe_path, source=cfg.source, pins_path=cfg.pins_path,
                               out=tmp, verify=True, verify_records=cfg.verify_records, name=cfg.name)
            result = build(bcfg, log=log)
            if not result.record.get("verify", {}).get("ok"):
                raise ToolchainError(f"{result.bundle}: the gate did not run; a release needs it")
            if do_aot and steps(recipe).compiles(recipe):
                aot_compile(AotConfig(bundle=result.bundle), log=log)
            bundles.append(result.bundle.name)
        table = None
        if whole:
            from ..sources.lm_head import lm_head_table

            log("writing the lm_head table the host reads")
            table = lm_head_table(cfg.source, pins, cfg.pins_path, tmp / HOST_DIR, log=log)
        for lock in tmp.glob(".*.lock"):  # the per-bundle build locks: not part of what ships
            lock.unlink()
        licence = _copy_licence(cfg, pins, tmp)
        if licence:
            log(f"the release's {', '.join(licence)} shipped beside the bundles")
        files = tree_files(tmp)
        if whole:  # what each host step gives, from the staged assets themselves
            files.update(_host_vectors(tmp, files, log))
        lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(files.items()))
        atomic_write_bytes(tmp / SUMS_FILE, lines.encode())
    log(f"release in {dist}: {plural(len(files), 'file')}, {SUMS_FILE}")
    return {"dist": str(dist), "files": sorted(files), "aot": do_aot, "bundles": bundles,
            "lm_head_table": None if table is None else f"{HOST_DIR}/{Path(table['table']).name}",
            "licence": licence}


def _host_vectors(tmp: Path, files: dict[str, str], log) -> dict[str, str]:
    """``host/host-vectors.jsonl`` written by the release's own assets; its digest."""
    from ..digest import sha256_file
    from ..host.dist import open_checked
    from ..host.vectors import write_vectors

    try:
        dist = open_checked(tmp, files)
    except UsageError as exc:  # a decoder without a head (or the like): nothing answers, nothing to prove
        log(f"no host vectors: {exc}")
        return {}
    path = tmp / HOST_DIR / VECTORS_FILE
    n = write_vectors(dist, path, log)
    log(f"host vectors: {n} requests, each host step, in {HOST_DIR}/{VECTORS_FILE}")
    return {f"{HOST_DIR}/{VECTORS_FILE}": sha256_file(path)}


def _copy_licence(cfg: ReleaseConfig, pins, tmp: Path) -> list[str]:
    """The release's pinned LICENSE / NOTICE files, verified, copied to the top of ``dist/``."""
    import shutil

    from ..sources.fetch import require_verified, resolve_source

    names = tuple(f for f in LICENSE_FILES if f in pins.files)
    if not names:
        return []
    src = resolve_source(cfg.source, pins)
    require_verified(src, pins, names)
    for name in names:
        if not (src / name).is_file():
            raise IntegrityError(f"{src / name}: pinned but missing; run `clef-export fetch` to download it")
        shutil.copyfile(src / name, tmp / name)
    return list(names)
