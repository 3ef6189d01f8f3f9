"""A release in one command: build -> verify -> AOT (where the toolchain exists) -> ``dist/``.

``dist/`` holds the bundle(s), their build records, and ``SHA256SUMS`` for every file (sorted,
``sha256sum -c`` format). The folder is staged and renamed into place like a bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bundle import check_output_path, output_lock, staged_dir, tree_files
from .errors import ToolchainError
from .recipe import Recipe

SUMS = "SHA256SUMS"


@dataclass(frozen=True)
class ReleaseConfig:
    recipe: Recipe
    recipe_path: Path
    source: Path | None
    pins_path: Path
    dist: Path
    overwrite: bool = False
    verify_records: int | None = None
    aot: str = "auto"  # auto: when `xcrun -f coreai-build` finds one; on: required; off


def release(cfg: ReleaseConfig, log=lambda msg: None) -> dict[str, Any]:
    from .aot import AotConfig, aot_compile, find_coreai_build
    from .bundle import atomic_write_bytes
    from .export import BuildConfig, build

    dist = Path(cfg.dist)
    check_output_path(dist, cfg.overwrite)
    do_aot = cfg.aot == "on"
    if cfg.aot == "auto":
        try:
            find_coreai_build()
            do_aot = True
        except ToolchainError as exc:
            log(f"no AOT compile: {exc}")
    elif do_aot:
        find_coreai_build()
    with output_lock(dist), staged_dir(dist, cfg.overwrite) as tmp:
        result = build(BuildConfig(recipe=cfg.recipe, recipe_path=cfg.recipe_path, source=cfg.source,
                                   pins_path=cfg.pins_path, out=tmp, verify=True,
                                   verify_records=cfg.verify_records), log=log)
        if not result.record.get("verify", {}).get("ok"):
            raise ToolchainError(f"{result.bundle}: the gate did not run; a release needs it")
        if do_aot:
            aot_compile(AotConfig(bundle=result.bundle), log=log)
        files = tree_files(tmp)
        lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(files.items()))
        atomic_write_bytes(tmp / SUMS, lines.encode())
    log(f"release in {dist}: {len(files)} files, {SUMS}")
    return {"dist": str(dist), "files": sorted(files), "aot": do_aot, "bundle": result.bundle.name}
