"""Installed like any Python CLI: the wheel carries the recipes, pins and schemas, and its
`clef-export` works from a folder outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from .conftest import ROOT


def test_wheel_installs_and_works_outside_the_checkout(tmp_path, author_code):
    from clef_flash import __version__
    from clef_flash.synth.release import write_release

    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("clef_export-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for data in ("clef_flash/_data/conversion/head_bucket_fp16w32.toml", "clef_flash/_data/manifests/clef-flash.source.json",
                 "clef_flash/_data/manifests/metadata.schema.json", "clef_flash/_data/manifests/metadata-mlpackage.schema.json",
                 "clef_flash/_data/conversion/requests.jsonl"):
        assert data in names, data
    assert not [n for n in names if n.endswith("joint_schema_model.py")]  # the author's code never ships
    modules = {str(f.relative_to(ROOT)) for f in (ROOT / "clef_flash").rglob("*.py") if "_data" not in f.parts}
    assert modules <= set(names), sorted(modules - set(names))  # every folder of the package ships (pyproject's list)
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size:,} bytes, {len(names)} files")

    # a fresh environment: the wheel installed on its own, the heavy dependencies reused from ours
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "reuse-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    exe = venv / "bin" / "clef-export"

    def run(*args):
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, cwd=elsewhere, env=env,
                              timeout=300)

    where = subprocess.run([str(py), "-c", "import clef_flash; print(clef_flash.__file__)"], capture_output=True,
                           text=True, cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"clef-export {__version__}"
    r = run("schema")
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads((ROOT / "manifests" / "metadata.schema.json").read_text())
    rel = write_release(tmp_path / "release", config_name={"hidden_size": 64, "width": 32, "routing_layers": 1,
                        "layers": 1, "heads": 2, "feedforward": 64}, seed=1, author_code=author_code)
    r = run("pin", rel, "--name", "from_wheel")
    assert r.returncode == 0, r.stderr[-1500:]
    r = run("build", "--source", rel, "--out", elsewhere / "out", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    plan = json.loads(r.stdout)
    assert plan["name"] == "from_wheel_head_bucket_fp16w32" and plan["recipe"].endswith("head_bucket_fp16w32.toml")
    assert "_data" in plan["recipe"]  # the wheel's own recipe, not the checkout's
