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


def _fill_when(folder: Path, pattern: str, stop) -> list[str]:
    """Another process's file takes all but 8 KiB of ``folder``'s disk once ``pattern`` appears under it."""
    import glob
    import time

    while not stop.is_set():
        hits = glob.glob(str(folder / "**" / pattern), recursive=True, include_hidden=True)
        if hits:
            for n in range(20):  # the command writes too: take what is left until under 64 KiB is
                free = shutil.disk_usage(folder).free
                if free < 65536:
                    break
                subprocess.run(["fallocate", "-l", str(free - 8192), str(folder / f"another-writer-{n}")], capture_output=True)
            return hits
        time.sleep(0.01)
    return []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_disk_that_fills_during_the_gate_is_a_full_disk_and_nothing_lands(tmp_path, author_code):
    """A tmpfs that another writer fills while the int8 gate's runtime compiles the asset: the
    runtime writes its compiled copy through a memory map, and on a full tmpfs that write is a
    SIGBUS. It killed the build (exit -7, no message, the staged folder and the lock left); the
    compile now runs in a child, so the build says the disk is full, naming the bundle, exit 1,
    and nothing lands. Issue 48 item 6."""
    import threading

    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    rel = write_release(tmp_path / "tiny_release", config_name=MAKE_TINY_HEAD, seed=0, author_code=author_code,
                        backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    recipe = tmp_path / "int8.toml"
    recipe.write_text('model = "backbone"\nname = "{release}_decode_int8_fp32_pf16"\nchunk = 16\ncontext = 128\n'
                      'weights = "int8"\ncompute = "fp32"\n')
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=200m", "tmpfs") as small:
        stop, hits = threading.Event(), []
        filler = threading.Thread(target=lambda: hits.extend(_fill_when(small, ".clef-tmp-*", stop)))
        filler.start()
        try:
            r = subprocess.run([str(EXE), "build", str(recipe), "--source", str(rel), "--out", str(small)],
                               capture_output=True, text=True, timeout=600)
        finally:
            stop.set()
            filler.join()
        assert hits and all(".tmp-" in h for h in hits), hits  # filled while the gate's compile folder was there
        assert r.returncode == 1, (r.returncode, r.stderr[-1500:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {small / 'tiny_release_decode_int8_fp32_pf16'}: cannot write the runtime's "
                               "compiled copy (No space left on device"), last
        assert "gate:" in r.stderr  # the export and the gate's reference ran first
        assert all(n.startswith("another-writer") for n in os.listdir(small)), os.listdir(small)  # no bundle, no staged folder, no lock


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_disk_that_fills_while_plan_weights_writes_its_gradients_is_a_full_disk(tmp_path, author_code):
    """plan-weights keeps each layer's output and the options' gradients in files of its temp
    folder, the gradients written through a memory map: on a tmpfs that another writer filled, a
    write into the map's unreserved pages was a SIGBUS (exit -7, no message, the folder left). The
    files' blocks are now reserved before the map is written: exit 1, one line naming the folder,
    no plan written, nothing of the planner's left. Issue 48 item 6."""
    import threading

    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    rel = write_release(tmp_path / "tiny_release", config_name=MAKE_TINY_HEAD, seed=0, author_code=author_code,
                        backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    plan = tmp_path / "plan.json"
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=60m", "tmpfs") as small:
        stop, hits = threading.Event(), []
        filler = threading.Thread(target=lambda: hits.extend(_fill_when(small, "grad-*", stop)))
        filler.start()
        try:
            r = subprocess.run([str(EXE), "plan-weights", str(rel), "--recipe", str(Path(__file__).resolve().parents[1] / "conversion" / "backbone_pf64_int8.toml"),
                                "--out", str(plan), "--estimate", "first-order", "--budget-dp", "1e-3"],
                               capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(small)})
        finally:
            stop.set()
            filler.join()
        assert hits, r.stderr[-1500:]  # filled once the first gradients' file was there
        assert r.returncode == 1, (r.returncode, r.stderr[-1500:])
        last = r.stderr.strip().splitlines()[-1]
        assert last == f"error: {small}: cannot write plan-weights' layer outputs (No space left on device)", last
        assert not plan.exists()
        assert not [n for n in os.listdir(small) if n.startswith(".clef-tmp-")]


def test_a_child_killed_by_a_mapped_write_on_a_full_disk_is_a_full_disk(tmp_path):
    """An export worker (or a runtime compile) that dies of SIGBUS: a full disk where it writes is
    the output's error naming the folder (exit 1); with room there, it is the toolchain's (exit 5),
    not called a full disk. Issue 48 item 6."""
    from clef_flash.build.process import _run_worker
    from clef_flash.errors import OutputError, ToolchainError

    cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGBUS)"]
    with pytest.raises(ToolchainError, match=r"export worker died of SIGBUS, [\d,]+ bytes free at "):
        _run_worker(cmd, dict(os.environ), tmp_path / "b" / "x.aimodel", lambda m: None)
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    with mounted(tmp_path / "full", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as full:
        subprocess.run(["fallocate", "-l", str(shutil.disk_usage(full).free), str(full / "another-writer")], check=True)
        with pytest.raises(OutputError, match=r"cannot write the asset \(No space left on device: 0 bytes free") as err:
            _run_worker(cmd, dict(os.environ), full / "x.aimodel", lambda m: None)
        assert str(err.value).startswith(f"{full}: ")


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
