"""Verified bytes only, corrupt inputs named in one line, atomic outputs."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from clef_flash.sources.author import AUTHOR_SHA256, build_head, load_author_module, load_config, load_head, load_state
from clef_flash.bundle import output_lock, staged_dir, remove_stale
from clef_flash.digest import sha256_file, tree_hash
from clef_flash.errors import IntegrityError, UsageError
from clef_flash.sources.pins import load_pins
from clef_flash.sources.fetch import check_source, require_verified


def test_tampered_author_code_never_runs(tmp_path, author_code):
    sentinel = tmp_path / "SENTINEL"
    evil = tmp_path / "joint_schema_model.py"
    evil.write_bytes(author_code.read_bytes() + f"\nopen({str(sentinel)!r}, 'w').write('ran')\n".encode())
    with pytest.raises(IntegrityError, match="sha256 mismatch, refusing to execute") as exc:
        load_author_module(evil, AUTHOR_SHA256)
    assert str(evil) in str(exc.value)
    assert not sentinel.exists()
    # the same payload, pinned by its own hash, does run: the sentinel proves the test can see it
    load_author_module(evil, sha256_file(evil))
    assert sentinel.read_text() == "ran"


def test_no_pycache_next_to_author_code(tmp_path, author_code):
    copy = tmp_path / "joint_schema_model.py"
    shutil.copy(author_code, copy)
    load_author_module(copy, AUTHOR_SHA256)
    assert not (tmp_path / "__pycache__").exists()


def _source_copy(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def test_tampered_byte_and_missing_file_fail_verification(tmp_path, tiny_source):
    src = _source_copy(tmp_path, tiny_source)
    pins = load_pins(src / "pins.json")
    assert all(c.ok for c in check_source(src, pins))
    w = src / "joint_head.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="joint_head.safetensors: sha256 mismatch"):
        require_verified(src, pins)
    (src / "joint_head_config.json").unlink()
    causes = {c.name: c.cause for c in check_source(src, pins)}
    assert causes["joint_head_config.json"] == "missing" and causes["joint_head.safetensors"] == "sha256 mismatch"
    # the loader re-checks the bytes it uses, too
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        load_state(w, pins.files["joint_head.safetensors"])


def _weights(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "joint_head.safetensors"
    p.write_bytes(data)
    return p


def test_corrupt_safetensors_named(tmp_path, tiny_source):
    good = (tiny_source / "joint_head.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    cases = {
        "truncated header": good[: 8 + n // 2],
        "bloated header length": struct.pack("<Q", 10**12) + good[8:],
        "truncated body": good[:-100],
        "not safetensors": b"\x80\x04pickle!",
    }
    for label, data in cases.items():
        p = _weights(tmp_path, data)
        with pytest.raises(IntegrityError, match="corrupt safetensors") as exc:
            load_state(p)
        assert str(p) in str(exc.value), label
    with pytest.raises(IntegrityError, match="only .safetensors"):
        load_state(tmp_path / "weights.bin")


@pytest.mark.parametrize(
    "text, cause",
    [
        ("{not json", "malformed JSON"),
        ('{"hidden_size": "64", "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64}', "hidden_size"),
        ('{"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4}', "feedforward"),
        ('{"hidden_size": 64, "width": 30, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64}', "divisible"),
        ('{"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64, "x": 1}', "x"),
        ("[1, 2]", "top level|model_type|dict"),
    ],
)
def test_malformed_config_named(tmp_path, text, cause):
    p = tmp_path / "joint_head_config.json"
    p.write_text(text)
    with pytest.raises(IntegrityError, match=cause) as exc:
        load_config(p)
    assert str(p) in str(exc.value)


def test_state_dict_key_problems_named(tiny_source, author_module):
    pins = load_pins(tiny_source / "pins.json")
    config = load_config(tiny_source / "joint_head_config.json")
    state = load_state(tiny_source / "joint_head.safetensors", pins.files["joint_head.safetensors"])
    w = Path("joint_head.safetensors")
    missing = dict(state)
    missing.pop("residual_gate")
    with pytest.raises(IntegrityError, match="missing 1 key.*residual_gate"):
        build_head(author_module, config, missing, torch.float32, w)
    extra = dict(state, surprise=torch.zeros(3))
    with pytest.raises(IntegrityError, match="unexpected key.*surprise"):
        build_head(author_module, config, extra, torch.float32, w)
    shaped = dict(state, **{"hidden_norm.weight": torch.zeros(65)})
    with pytest.raises(IntegrityError, match=r"hidden_norm.weight has shape \[65\]"):
        build_head(author_module, config, shaped, torch.float32, w)
    _, _, head = load_head(tiny_source, pins, torch.float32)
    assert not head.training


# ------------------------------------------------------------------ atomic outputs


def _make_bundle(final: Path, content: str) -> None:
    with staged_dir(final, overwrite=True) as tmp:
        (tmp / "a.txt").write_text(content)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(content.encode() * 10)


def _strays(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_failure_mid_build_leaves_previous_bundle(tmp_path):
    final = tmp_path / "out" / "bundle"
    _make_bundle(final, "one")
    before = tree_hash(final)
    with pytest.raises(RuntimeError):
        with staged_dir(final, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("converter died")
    assert tree_hash(final) == before and not _strays(final.parent)
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(final, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("half")
            raise KeyboardInterrupt
    assert tree_hash(final) == before and not _strays(final.parent)
    _make_bundle(final, "two")
    assert (final / "a.txt").read_text() == "two" and not _strays(final.parent)


def test_stale_temp_from_killed_run_is_swept(tmp_path):
    final = tmp_path / "bundle"
    stale = tmp_path / ".bundle.tmp-999999-deadbeef"
    stale.mkdir()
    (stale / "partial").write_text("x")
    assert remove_stale(final) == [stale] and not stale.exists()
    live = tmp_path / f".bundle.tmp-{os.getpid()}-cafe"
    live.mkdir()
    assert remove_stale(final) == [] and live.exists()  # a live run's folder is left alone


def test_concurrent_writer_gets_clear_error(tmp_path, tiny_source):
    """While one writer holds an output, a second writer, in this process or a `clef-export build`
    of its own, is refused at once with exit 2; once the first is done, the output is free."""
    final = tmp_path / "clef_flash_head_bucket_fp16w32"
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first():
        try:
            with output_lock(final):
                entered.set()
                release.wait(60)
        except BaseException as exc:  # the first writer must get the lock: anything else fails the test
            errors.append(exc)
            entered.set()

    t = threading.Thread(target=first)
    t.start()
    try:
        assert entered.wait(10) and not errors, errors
        with pytest.raises(UsageError, match="another build is writing"):
            with output_lock(final):
                pass
        exe = Path(sys.executable).parent / "clef-export"
        r = subprocess.run([str(exe), "build", "--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"),
                            "--out", str(tmp_path), "--no-verify"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "another build is writing this output" in r.stderr, r.stderr[-1000:]
        assert not final.exists()
    finally:
        release.set()
        t.join()
    assert not errors, errors
    with output_lock(final):
        pass
