"""AOT compile through a fake `xcrun` on PATH: flags, manifest, atomic failure, missing toolchain."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clef_flash.digest import tree_hash
from clef_flash.cli import app

from .conftest import PUBLISHED

FAKE = r'''#!{python}
import json, os, pathlib, sys
with open(os.environ["FAKE_XCRUN_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
args = sys.argv[1:]
if args[:2] == ["-f", "coreai-build"]:
    if os.environ.get("FAKE_XCRUN_NO_TOOL"):
        print("xcrun: error: unable to find utility \"coreai-build\"", file=sys.stderr)
        sys.exit(72)
    print("/Applications/Xcode.app/Contents/Developer/usr/bin/coreai-build")
    sys.exit(0)
if args[:2] == ["coreai-build", "compile"]:
    if os.environ.get("FAKE_XCRUN_FAIL"):
        print("error: architecture h99z is not supported", file=sys.stderr)
        sys.exit(1)
    out = pathlib.Path(args[args.index("--output") + 1])
    out.mkdir(parents=True)
    (out / "model.h16c.bin").write_bytes(b"compiled " + pathlib.Path(args[2]).name.encode())
    sys.exit(0)
sys.exit(2)
'''

runner = CliRunner()


@pytest.fixture()
def fake_xcrun(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    xcrun = bindir / "xcrun"
    xcrun.write_text(FAKE.replace("{python}", sys.executable))
    xcrun.chmod(xcrun.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    return log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_aot_fills_manifest_like_published(tiny_bundle_copy, fake_xcrun):
    r = runner.invoke(app, ["aot", str(tiny_bundle_copy)])
    assert r.exit_code == 0, r.output
    compile_call = [c for c in calls(fake_xcrun) if c[:2] == ["coreai-build", "compile"]][0]
    assert compile_call[2].endswith("clef_flash_head_bucket_fp16w32.aimodel")
    assert compile_call[3] == "--output"
    assert compile_call[5:] == ["--platform", "macOS", "--preferred-compute", "gpu", "--architecture", "h16c"]
    m = json.loads((tiny_bundle_copy / "metadata.json").read_text())
    pub = json.loads(PUBLISHED.read_text())
    assert m["aot"]["note"] == pub["aot"]["note"] and m["aot"]["flags"] == pub["aot"]["flags"]
    assert isinstance(m["aot"]["seconds"], float) and m["compilation"]["targets"] == ["h16c"]
    compiled = tiny_bundle_copy / "clef_flash_head_bucket_fp16w32.h16c.aimodelc"
    assert (compiled / "model.h16c.bin").is_file()
    record = json.loads((tiny_bundle_copy / "build-record.json").read_text())
    assert record["aot"]["output_tree_sha256"] == tree_hash(compiled)
    assert runner.invoke(app, ["verify-artifact", str(tiny_bundle_copy)]).exit_code == 0


def test_aot_failure_leaves_bundle_as_it_was(tiny_bundle_copy, fake_xcrun, monkeypatch):
    before = tree_hash(tiny_bundle_copy)
    monkeypatch.setenv("FAKE_XCRUN_FAIL", "1")
    r = runner.invoke(app, ["aot", str(tiny_bundle_copy), "--architecture", "h99z"])
    assert r.exit_code == 5 and "coreai-build compile failed: error: architecture h99z is not supported" in r.output
    assert tree_hash(tiny_bundle_copy) == before
    assert [p.name for p in tiny_bundle_copy.parent.iterdir() if ".tmp-" in p.name] == []


def test_aot_missing_toolchain_exit_5(tiny_bundle_copy, fake_xcrun, monkeypatch):
    before = tree_hash(tiny_bundle_copy)
    monkeypatch.setenv("FAKE_XCRUN_NO_TOOL", "1")
    r = runner.invoke(app, ["aot", str(tiny_bundle_copy)])
    assert r.exit_code == 5 and "xcrun -f coreai-build" in r.output
    monkeypatch.setenv("PATH", "/nonexistent")
    r = runner.invoke(app, ["aot", str(tiny_bundle_copy)])
    assert r.exit_code == 5 and "xcrun is not on PATH" in r.output
    assert tree_hash(tiny_bundle_copy) == before


def test_build_aot_without_toolchain_fails_before_work(tmp_path, tiny_source, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    r = runner.invoke(app, ["build", "--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"),
                            "--out", str(tmp_path / "o"), "--aot"])
    assert r.exit_code == 5 and "xcrun is not on PATH" in r.output
    assert not (tmp_path / "o" / "clef_flash_head_bucket_fp16w32").exists()
