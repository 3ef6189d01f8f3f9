"""Killed builds leave the previous bundle as it was; two builds are byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from clef_flash.bundle import tree_hash

NAME = "clef_flash_head_bucket_fp16w32"
EXE = Path(sys.executable).parent / "clef-export"


def start_build(source: Path, out: Path, cwd: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.Popen(
        [str(EXE), "build", "--source", str(source), "--pins", str(source / "pins.json"), "--out", str(out),
         "--overwrite", "--no-verify"],
        cwd=cwd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )


def wait_for(proc: subprocess.Popen, marker: str, limit: float = 120) -> None:
    t0 = time.monotonic()
    assert proc.stderr is not None
    for line in proc.stderr:
        if marker in line:
            return
        assert time.monotonic() - t0 < limit
    raise AssertionError(f"build ended before {marker!r}")


def strays(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_killed_and_interrupted_builds_then_reproducible_rebuild(tmp_path, tiny_source, tiny_bundle):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(tiny_bundle, out / NAME)
    before = tree_hash(out / NAME)

    # SIGKILL mid-conversion: the previous bundle is untouched; a stale temp folder may remain
    p = start_build(tiny_source, out, tmp_path)
    wait_for(p, "tracing t4096")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert tree_hash(out / NAME) == before

    # SIGINT (Ctrl-C) mid-conversion: exit 130, its temp removed, the stale one swept
    p = start_build(tiny_source, out, tmp_path)
    wait_for(p, "tracing t4096")
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-1000:]
    assert "interrupted" in err
    assert tree_hash(out / NAME) == before
    assert strays(out) == []

    # A full rebuild elsewhere (other cwd, TZ, PYTHONHASHSEED, temp path) is byte-identical
    other = tmp_path / "other cwd"
    other.mkdir()
    out2 = tmp_path / "out2"
    env = {"TZ": "Pacific/Chatham", "PYTHONHASHSEED": "4242", "TMPDIR": str(other), "SOURCE_DATE_EPOCH": "1767225600"}
    p = start_build(tiny_source, out2, other, env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    a, b = tiny_bundle / f"{NAME}.aimodel", out2 / NAME / f"{NAME}.aimodel"
    for f in ("main.mlirb", "main.hash"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    m1 = json.loads((tiny_bundle / "metadata.json").read_text())
    m2 = json.loads((out2 / NAME / "metadata.json").read_text())
    for m in (m1, m2):
        m["export"]["seconds"] = m["export"]["export_attempts"][0]["seconds"] = None
        m["compilation"]["date"] = None
    assert m1 == m2
    assert json.loads((out2 / NAME / "metadata.json").read_text())["compilation"]["date"] == "2026-01-01T00:00:00+00:00"
    asset_meta = json.loads((b / "metadata.json").read_text())
    assert asset_meta["creationDate"].startswith("20260101T000000")
    record = json.loads((out2 / NAME / "build-record.json").read_text())
    assert record["source_date_epoch"] == 1767225600 and record["parameters"]["aslr_disabled_for_naming"] is True
