"""Outputs that cannot be written: a full disk and a read-only folder (real mounts, as root), for a
build and for the lm_head table; a killed table write, then a rerun."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
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


@contextlib.contextmanager
def read_only(tmp_path: Path):
    """A folder bind-mounted onto itself, then remounted read-only."""
    ro = tmp_path / "ro"
    ro.mkdir()
    with mounted(ro, "--bind", str(ro)):
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield ro


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_read_only_output_refused_before_work(tmp_path, tiny_source):
    with read_only(tmp_path) as ro:
        r = build(tiny_source, ro)
        assert r.returncode == 2, r.stderr[-1500:]
        assert "not writable" in r.stderr and str(ro) in r.stderr
        assert "tracing" not in r.stderr  # refused before the expensive work


def table(source: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), "lm-head-table", "--source", str(source), "--pins", str(source / "pins.json"),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=600)


def strays(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_table_too_little_space_refused_before_work(tmp_path, tiny_source):
    """The tiny table is 65,536 bytes: a 64 KiB file system cannot hold it and its sidecar."""
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as small:
        r = table(tiny_source, small / "host")
        assert r.returncode == 1, r.stderr[-1500:]
        assert "not enough free space for the table" in r.stderr and str(small / "host" / "lm_head_fp16.bin") in r.stderr
        assert "->" not in r.stderr  # refused before the first block
        assert strays(small) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_table_disk_full_names_the_file_and_leaves_nothing(tmp_path, tiny_source, monkeypatch):
    """A file system that says it has room and then has none (another writer took it): the error
    names the table file, and neither the folder nor a partial file is left."""
    from typer.testing import CliRunner

    from clef_flash.cli import app

    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=48k", "tmpfs") as small:
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 0, 1 << 30))
        r = CliRunner().invoke(app, ["lm-head-table", "--source", str(tiny_source), "--pins",
                                     str(tiny_source / "pins.json"), "--out", str(small / "host")])
        assert r.exit_code == 1, r.output
        assert f"{small / 'host' / 'lm_head_fp16.bin'}: cannot write the table (No space left on device)" in r.output
        assert "Traceback" not in r.output
        assert strays(small) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_table_read_only_folder_refused_before_work(tmp_path, tiny_source):
    with read_only(tmp_path) as ro:
        r = table(tiny_source, ro)
        assert r.returncode == 2, r.stderr[-1500:]
        assert "not writable" in r.stderr and str(ro) in r.stderr and "->" not in r.stderr


def test_table_killed_mid_write_then_rerun(tmp_path, tiny_source, author_code):
    """SIGKILL while the table is being written into a folder that already holds a table: the old
    files stay as they were; the rerun sweeps the killed run's temp folder and lands both files."""
    from clef_flash.synth.release import write_synth

    src = tmp_path / "src"
    write_synth(src, config_name="tiny", seed=3, author_code=author_code, lm_head_vocab=400_000)  # a 51 MB table
    host = tmp_path / "host"
    host.mkdir()
    (host / "notes.txt").write_text("a user's file, left alone\n")
    shutil.copy(tiny_source / "pins.json", host / "lm_head_fp16.json")  # a stand-in previous sidecar
    (host / "lm_head_fp16.bin").write_bytes(b"previous table")
    before = {name: (host / name).read_bytes() for name in os.listdir(host)}
    p = subprocess.Popen([str(EXE), "lm-head-table", "--source", str(src), "--pins", str(src / "pins.json"),
                          "--out", str(host), "--overwrite"], stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    for line in p.stderr:
        if "-> " in line:  # the table's first block is being written
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert {name: (host / name).read_bytes() for name in before} == before  # the previous files as they were
    left = [n for n in os.listdir(host) if n not in before]
    assert left and all(n.startswith(".lm_head_fp16.bin.tmp-") for n in left), left  # only the killed run's temp
    r = table(src, host, "--overwrite")
    assert r.returncode == 0, r.stderr[-1500:]
    assert sorted(os.listdir(host)) == ["lm_head_fp16.bin", "lm_head_fp16.json", "notes.txt"]  # the temp swept
    assert (host / "lm_head_fp16.bin").stat().st_size == 400_000 * 64 * 2


def test_the_converters_full_disk_is_a_full_disk(tmp_path):
    """The export worker dying of the converter's own words for a full disk ("There isn’t enough
    space", measured on a tmpfs filled during a vision build) is an output error naming the folder
    (exit 1), not a toolchain failure (exit 5). Issue 48 item 6."""
    from clef_flash.build.process import _run_worker
    from clef_flash.errors import OutputError

    said = "RuntimeError: The operation could not be completed. There isn\u2019t enough space."
    cmd = [sys.executable, "-c", f"import sys; print({said!r}, file=sys.stderr); sys.exit(1)"]
    with pytest.raises(OutputError, match=r"cannot write the asset \(No space left on device\)") as err:
        _run_worker(cmd, dict(os.environ), tmp_path / "b" / "x.aimodel", lambda m: None)
    assert str(tmp_path / "b") in str(err.value)
