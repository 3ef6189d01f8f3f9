"""The real huggingface_hub fetch path, against a loopback fake Hub; offline use of the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest



def run_cli(args, hub_endpoint: str | None, hf_home: Path, offline: bool = False, timeout: int = 120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if hub_endpoint:
        env["HF_ENDPOINT"] = hub_endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    exe = Path(sys.executable).parent / "clef-export"
    t0 = time.monotonic()
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    return r, time.monotonic() - t0


def test_fetch_then_offline_build_inputs(tmp_path, hub, tiny_source):
    pins = tiny_source / "pins.json"
    home = tmp_path / "hf"
    r, _ = run_cli(["fetch", "--pins", pins, "--json"], hub.endpoint, home)
    assert r.returncode == 0, r.stderr
    folder = Path(json.loads(r.stdout)["folder"])
    assert folder.is_relative_to(home / "hub" / "models--synthetic--clef-flash-head")
    gets = [p for m, p in hub.requests if m == "GET"]
    assert len(gets) == 3 and all(f"/resolve/{json.loads(pins.read_text())['revision']}/" in p for p in gets)
    # offline, zero network: the pinned snapshot is found in the cache and verifies
    r, _ = run_cli(["verify-hashes", "--pins", pins, "--json"], None, home, offline=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True and json.loads(r.stdout)["source"] == str(folder)


def test_offline_missing_is_clear_and_fast(tmp_path, tiny_source):
    r, seconds = run_cli(["verify-hashes", "--pins", tiny_source / "pins.json"], None, tmp_path / "empty", offline=True)
    assert r.returncode == 3 and "not in the cache; run `clef-export fetch`" in r.stderr
    assert seconds < 30


def test_fetch_local_dir(tmp_path, hub, tiny_source):
    r, _ = run_cli(["fetch", "--pins", tiny_source / "pins.json", "--local-dir", tmp_path / "snap"], hub.endpoint, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "snap").iterdir() if p.is_file()) == sorted(
        ["joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py"])


@pytest.mark.parametrize(
    "fault, message",
    [
        ("404-entry", "file not found on the Hub"),
        ("404-revision", "revision not found on the Hub"),
        ("500", "download failed"),
        ("corrupt", "sha256 mismatch after download"),
        ("reset", "download failed"),
    ],
)
def test_fetch_faults_are_integrity_errors(tmp_path, hub, tiny_source, fault, message):
    hub.faults["joint_head.safetensors"] = fault
    local = tmp_path / "snap"
    r, seconds = run_cli(["fetch", "--pins", tiny_source / "pins.json", "--local-dir", local], hub.endpoint, tmp_path / "hf")
    assert r.returncode == 3, (fault, r.stderr[-1500:])
    assert "joint_head.safetensors" in r.stderr and message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (local / "joint_head.safetensors").exists()  # nothing unverified is left to be used
    assert seconds < 90


def test_slow_server_still_verifies(tmp_path, hub, tiny_source):
    hub.faults["joint_head_config.json"] = "slow"
    r, _ = run_cli(["fetch", "--pins", tiny_source / "pins.json", "--cache-dir", tmp_path / "cache"], hub.endpoint, tmp_path / "hf")
    assert r.returncode == 0, r.stderr


def test_unpinned_revision_refused_before_network(tmp_path, tiny_source):
    r, _ = run_cli(["fetch", "--pins", tiny_source / "pins.json", "--revision", "main"], "http://127.0.0.1:9", tmp_path / "hf")
    assert r.returncode == 2 and "is not the pinned commit" in r.stderr


def _cache_files(home: Path) -> dict[str, bytes]:
    """Every regular file in the huggingface_hub cache under ``home`` (blobs), by name."""
    return {p.name: p.read_bytes() for p in (home / "hub").rglob("*") if p.is_file() and not p.is_symlink()}


def test_failed_fetch_does_not_poison_the_cache(tmp_path, hub, tiny_source):
    """A corrupt body, then the true one: the first fetch fails and leaves no bad bytes in the cache;
    the second downloads again and verifies; the offline commands then read a clean snapshot."""
    pins = tiny_source / "pins.json"
    home = tmp_path / "hf"
    name = "joint_head_config.json"
    good = (tiny_source / name).read_bytes()
    hub.faults[name] = "corrupt-once"
    r, _ = run_cli(["fetch", "--pins", pins], hub.endpoint, home)
    assert r.returncode == 3 and f"{name}: sha256 mismatch after download" in r.stderr, r.stderr[-1500:]
    assert "nothing unverified is left" in r.stderr and "Traceback" not in r.stderr
    bad = good[:-1] + bytes([good[-1] ^ 0x01])
    assert bad not in _cache_files(home).values()
    assert not list((home / "hub").rglob(f"snapshots/*/{name}"))
    gets = len([1 for m, _ in hub.requests if m == "GET"])
    r, _ = run_cli(["fetch", "--pins", pins], hub.endpoint, home)
    assert r.returncode == 0, r.stderr[-1500:]
    assert len([1 for m, _ in hub.requests if m == "GET"]) == gets + 1  # only the removed file again
    r, _ = run_cli(["verify-hashes", "--pins", pins, "--json"], None, home, offline=True)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, r.stderr[-1500:]


def test_bad_cached_copy_is_named_then_repaired_by_fetch(tmp_path, hub, tiny_source):
    """A cached copy whose bytes changed (a proxy, a disk): verify-hashes names it and the command
    that repairs it; fetch removes it and downloads it again, without the user touching the cache."""
    pins = tiny_source / "pins.json"
    home = tmp_path / "hf"
    r, _ = run_cli(["fetch", "--pins", pins], hub.endpoint, home)
    assert r.returncode == 0, r.stderr[-1500:]
    entry = next((home / "hub").rglob("snapshots/*/joint_head.safetensors"))
    blob = entry.resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    r, _ = run_cli(["verify-hashes", "--pins", pins], None, home, offline=True)
    assert r.returncode == 3, r.stderr[-1500:]
    assert "joint_head.safetensors: cached copy does not match its pin; run `clef-export fetch`" in r.stderr
    r, _ = run_cli(["build", "--pins", pins, "--out", tmp_path / "out", "--dry-run"], None, home, offline=True)
    assert r.returncode == 3 and "cached copy does not match its pin" in r.stderr, r.stderr[-1500:]
    r, _ = run_cli(["fetch", "--pins", pins], hub.endpoint, home)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "does not match its pin; removed" in r.stderr and "downloading it again" in r.stderr
    r, _ = run_cli(["verify-hashes", "--pins", pins], None, home, offline=True)
    assert r.returncode == 0, r.stderr[-1500:]
