"""AOT compile on macOS: ``xcrun coreai-build compile`` on a finished bundle.

Runs the Xcode 27 compiler (found with ``xcrun -f coreai-build``, which honours ``DEVELOPER_DIR``),
times it, puts the compiled folder beside the asset, and fills the manifest's ``aot`` and
``compilation`` exactly as the published manifest shapes them. The bundle is updated as a whole:
a staged copy is changed and swapped in, so a failure leaves it as it was.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from ..gate import check_artifact
from ..gate.artifact import check_bundle
from ..bundle import atomic_write_json, output_lock, staged_dir
from ..digest import tree_files, tree_hash
from ..errors import ToolchainError, UsageError
from ..layout import MANIFEST_FILE, RECORD_FILE
from ..manifest import Aot, Compilation
from ..provenance import build_date

NOTE = ("compiled for the gates with: xcrun coreai-build compile <this .aimodel> --output <dir> {flags} "
        "(not shipped; the Swift host specializes the .aimodel)")


@dataclass(frozen=True)
class AotConfig:
    bundle: Path
    platform: str = "macOS"
    preferred_compute: str = "gpu"
    architecture: str = "h16c"

    @property
    def flags(self) -> list[str]:
        return ["--platform", self.platform, "--preferred-compute", self.preferred_compute,
                "--architecture", self.architecture]


def find_coreai_build() -> str:
    """The compiler's path, or a one-line ToolchainError saying what is needed."""
    xcrun = shutil.which("xcrun")
    if xcrun is None:
        raise ToolchainError("AOT compile needs Xcode 27's `xcrun coreai-build` (macOS); xcrun is not on PATH")
    r = subprocess.run([xcrun, "-f", "coreai-build"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise ToolchainError("AOT compile needs Xcode 27's coreai-build; `xcrun -f coreai-build` found none"
                             " (set DEVELOPER_DIR to an Xcode 27 toolchain)")
    return r.stdout.strip()


def aot_compile(cfg: AotConfig, log=lambda msg: None) -> BaseModel:
    bundle = Path(cfg.bundle)
    check_artifact(bundle)  # compile only what the build record vouches for
    manifest, fmt, _asset, _checks = check_bundle(bundle)
    if not fmt.AOT:
        raise UsageError(f"{bundle}: a {fmt.FORMAT} bundle; coreai-build compiles .aimodel assets")
    tool = find_coreai_build()
    xcrun = shutil.which("xcrun")
    assert xcrun is not None
    asset_name = manifest.assets["main"]
    compiled_name = f"{Path(asset_name).stem}.{cfg.architecture}.aimodelc"
    with output_lock(bundle), staged_dir(bundle, overwrite=True) as tmp:
        shutil.copytree(bundle, tmp, dirs_exist_ok=True, copy_function=shutil.copy2)
        shutil.rmtree(tmp / compiled_name, ignore_errors=True)
        cmd = [xcrun, "coreai-build", "compile", str(tmp / asset_name), "--output", str(tmp / compiled_name), *cfg.flags]
        log(f"{' '.join(cmd[:3])} … {' '.join(cfg.flags)}")
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            last = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
            raise ToolchainError(f"{bundle / asset_name}: coreai-build compile failed: {last[0]}")
        if not (tmp / compiled_name).is_dir() or not any((tmp / compiled_name).iterdir()):
            raise ToolchainError(f"{bundle / asset_name}: coreai-build compile wrote no output folder")
        updated = manifest.model_copy(update={
            "aot": Aot(note=NOTE.format(flags=" ".join(cfg.flags)), flags=cfg.flags, seconds=seconds),
            "compilation": Compilation(date=build_date(), targets=[cfg.architecture]),
        })
        atomic_write_json(tmp / MANIFEST_FILE, updated.model_dump(mode="json"))
        record = json.loads((tmp / RECORD_FILE).read_text())
        record["aot"] = {"tool": tool, "flags": cfg.flags, "seconds": seconds, "output": compiled_name,
                         "output_tree_sha256": tree_hash(tmp / compiled_name)}
        outputs = tree_files(tmp)
        outputs.pop(RECORD_FILE, None)
        record["outputs"] = outputs
        atomic_write_json(tmp / RECORD_FILE, record)
    log(f"compiled in {seconds:.2f} s -> {bundle / compiled_name}")
    return updated
