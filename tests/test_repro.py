"""Killed builds leave the previous bundle as it was; builds on differently set up machines are
byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from clef_flash.digest import tree_hash

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


def test_killed_and_interrupted_builds_leave_the_previous_bundle(tmp_path, tiny_source, tiny_bundle):
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



def _stack(limit: int):
    """preexec_fn: this stack limit (soft and hard) for the build process and its worker."""
    import resource

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_STACK, (limit, limit))

    return set_limit


def other_interpreter(tmp_path: Path) -> Path:
    """The same environment reached through another path: a symlink to the venv's folder."""
    venv = Path(sys.prefix)
    link = tmp_path / "elsewhere" / "venv-link"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(venv, target_is_directory=True)
    return link / "bin" / "python"


def cli_build(python: Path, source: Path, out: Path, cwd: Path, env_extra: dict, stack: int, recipe: Path | None = None,
              name: str = NAME) -> Path:
    """``clef-export build --no-verify`` in its own process; returns the bundle."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "TZ", "TMPDIR", "SOURCE_DATE_EPOCH")}
    env.update(env_extra)
    args = [str(python), "-m", "clef_flash.cli", "build", *([str(recipe)] if recipe else []), "--source", str(source),
            "--pins", str(source / "pins.json"), "--out", str(out), "--no-verify"]
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, preexec_fn=_stack(stack))
    assert r.returncode == 0, r.stderr[-2000:]
    return out / name


def test_aimodel_bytes_do_not_depend_on_the_machine(tmp_path, tiny_source):
    """Two builds, address randomisation on (the tool never switches it off): stack limit 8 MB
    against unlimited (the address layout moves with it), and the second also from another
    working directory, temp folder, hash seed, time zone and interpreter path. The bytes agree,
    and the blobs carry the names of their own bytes."""
    from clef_flash.formats.mlirb import resource_names

    assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"
    a = cli_build(Path(sys.executable), tiny_source, tmp_path / "a", tmp_path, {}, 8 << 20)
    other = tmp_path / "other cwd"
    other.mkdir()
    env = {"TZ": "Pacific/Chatham", "PYTHONHASHSEED": "4242", "TMPDIR": str(other), "SOURCE_DATE_EPOCH": "1767225600"}
    import resource

    b = cli_build(other_interpreter(tmp_path), tiny_source, tmp_path / "b", other, env, resource.RLIM_INFINITY)
    asset_a, asset_b = a / f"{NAME}.aimodel", b / f"{NAME}.aimodel"
    for f in ("main.mlirb", "main.hash"):
        assert (asset_a / f).read_bytes() == (asset_b / f).read_bytes(), f
    names = resource_names(asset_a / "main.mlirb")
    assert names and all(n.startswith("w_") for n in names)
    m1 = json.loads((a / "metadata.json").read_text())
    m2 = json.loads((b / "metadata.json").read_text())
    for m in (m1, m2):
        m["export"]["seconds"] = m["export"]["export_attempts"][0]["seconds"] = None
        m["compilation"]["date"] = None
    assert m1 == m2
    assert json.loads((b / "metadata.json").read_text())["compilation"]["date"] == "2026-01-01T00:00:00+00:00"
    assert json.loads((asset_b / "metadata.json").read_text())["creationDate"].startswith("20260101T000000")
    record = json.loads((b / "build-record.json").read_text())
    assert record["source_date_epoch"] == 1767225600
    assert record["parameters"]["resource_names"].startswith("w_<sha256")
    assert "coreai-core" in record["environment"] and "platform" in record["environment"]
