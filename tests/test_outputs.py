"""Outputs that cannot be written: a full disk and a read-only folder (real mounts, as root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXE = Path(sys.executable).parent / "clef-export"


@contextlib.contextmanager
def mounted(target: Path, *args: str):
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip()[:80]})")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), "build", "--source", str(source), "--pins", str(source / "pins.json"),
                           "--out", str(out), "--no-verify"], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_disk_full_leaves_nothing(tmp_path, tiny_source):
    # 256k passes the free-space pre-check (weights 127k) but not the save (the asset is ~375k)
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=256k", "tmpfs") as small:
        r = build(tiny_source, small)
        assert r.returncode == 1, r.stderr[-1500:]
        assert "No space left on device" in r.stderr and "Traceback" not in r.stderr
        assert str(small) in r.stderr and "saving" in r.stderr
        assert [p.name for p in small.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_too_little_space_refused_before_work(tmp_path, tiny_source):
    with mounted(tmp_path / "tiny", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as small:
        r = build(tiny_source, small)
        assert r.returncode == 1, r.stderr[-1500:]
        assert "not enough free space" in r.stderr and str(small) in r.stderr
        assert "tracing" not in r.stderr
        assert [p.name for p in small.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_read_only_output_refused_before_work(tmp_path, tiny_source):
    ro = tmp_path / "ro"
    ro.mkdir()
    with mounted(ro, "--bind", str(ro)):
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip("cannot remount read-only here")
        r = build(tiny_source, ro)
        assert r.returncode == 2, r.stderr[-1500:]
        assert "not writable" in r.stderr and str(ro) in r.stderr
        assert "tracing" not in r.stderr  # refused before the expensive work
