"""`clef-export release` and the CI workflow that runs the same make targets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from clef_flash.cli import app

from .conftest import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "export.yml"


def test_release_writes_dist_with_sums(tmp_path, tiny_source, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin:" + str(Path(sys.executable).parent))  # no xcrun: AOT skipped
    dist = tmp_path / "dist"
    recipes = [str(ROOT / "conversion" / f) for f in ("head_bucket_fp16w32.toml", "head_bucket_fp16w32_mlpackage.toml")]
    r = CliRunner().invoke(app, ["release", *recipes, "--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"),
                                 "--dist", str(dist), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["aot"] is False
    assert summary["bundles"] == ["clef_flash_head_bucket_fp16w32", "clef_flash_head_bucket_fp16w32_mlpackage"]
    sums = (dist / "SHA256SUMS").read_text().splitlines()
    names = [line.split("  ", 1)[1] for line in sums]
    assert names == sorted(names) and "clef_flash_head_bucket_fp16w32/metadata.json" in names
    assert "clef_flash_head_bucket_fp16w32/clef_flash_head_bucket_fp16w32.aimodel/main.mlirb" in names
    pkg = "clef_flash_head_bucket_fp16w32_mlpackage/clef_flash_head_bucket_fp16w32_mlpackage.mlpackage"
    assert f"{pkg}/Data/com.apple.CoreML/weights/weight.bin" in names and f"{pkg}/Manifest.json" in names
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=dist, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    record = json.loads((dist / "clef_flash_head_bucket_fp16w32" / "build-record.json").read_text())
    assert record["verify"]["ok"] is True
    (dist / "clef_flash_head_bucket_fp16w32" / "metadata.json").write_text("{}")
    assert subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=dist, capture_output=True).returncode != 0


def test_release_refuses_duplicate_recipes_and_aot_without_an_aimodel(tmp_path, tiny_source):
    args = ["--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"), "--dist", str(tmp_path / "dist")]
    pkg = str(ROOT / "conversion" / "head_bucket_fp16w32_mlpackage.toml")
    r = CliRunner().invoke(app, ["release", pkg, pkg, *args])
    assert r.exit_code == 2 and "distinct names" in r.output
    r = CliRunner().invoke(app, ["release", pkg, "--aot", "on", *args])
    assert r.exit_code == 2 and "no recipe builds one" in r.output
    assert not (tmp_path / "dist").exists()


def test_workflow_is_valid_and_uses_the_make_targets():
    r = subprocess.run([str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema",
                        "vendor.github-workflows", str(WORKFLOW)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    wf = yaml.safe_load(WORKFLOW.read_text())
    runs = [s["run"] for job in wf["jobs"].values() for s in job["steps"] if "run" in s]
    targets = {t for run in runs for t in re.findall(r"\bmake ([a-z-]+)", run)}
    assert {"setup", "fetch", "artifact"} <= targets
    for t in targets:  # every target exists in the Makefile
        assert subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True).returncode == 0, t
    commands = {m for run in runs for m in re.findall(r"clef-export ([a-z-]+)", run)}
    help_text = CliRunner().invoke(app, ["--help"]).output
    for c in commands:
        assert c in help_text, c
    for job in wf["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                assert re.match(r"^actions/[a-z-]+@v\d+$", step["uses"]), step["uses"]
