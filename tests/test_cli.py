"""The CLI (CliRunner), end to end on the tiny configuration; exit codes and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .conftest import ROOT

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_help_is_instant_and_imports_no_torch():
    code = "import sys; from clef_flash.cli import app; assert 'torch' not in sys.modules and 'coreai' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("fetch", "verify-hashes", "synth", "build", "verify", "verify-artifact", "schema", "inspect"):
        assert cmd in r.output


def test_verify_hashes_ok_then_tampered_then_missing(tmp_path, tiny_source):
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    pins = src / "pins.json"
    r = invoke("verify-hashes", "--source", src, "--pins", pins, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
    # pinned files beyond the head's (the lm_head shard) are checked when present, optional when absent
    shard = src / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    r = invoke("verify-hashes", "--source", src, "--pins", pins)
    assert r.exit_code == 3 and "model-00002-of-00002.safetensors: sha256 mismatch" in r.output
    shard.unlink()
    r = invoke("verify-hashes", "--source", src, "--pins", pins, "--json")
    assert r.exit_code == 0, r.output
    causes = {f["file"]: f["cause"] for f in json.loads(r.stdout)["files"]}
    assert causes["model-00002-of-00002.safetensors"] == "absent (optional)" and causes["joint_head.safetensors"] == "ok"
    w = src / "joint_head_config.json"
    w.write_bytes(w.read_bytes().replace(b"64", b"65", 1))
    r = invoke("verify-hashes", "--source", src, "--pins", pins)
    assert r.exit_code == 3 and "joint_head_config.json: sha256 mismatch" in r.output
    w.unlink()
    r = invoke("verify-hashes", "--source", src, "--pins", pins)
    assert r.exit_code == 3 and "joint_head_config.json: missing" in r.output


def test_malformed_pins_exit_2_before_anything(tmp_path, tiny_source):
    bad = tmp_path / "pins.json"
    bad.write_text(json.dumps({"hf_id": "a/b", "revision": "abc", "files": {}}))
    for cmd in (["verify-hashes", "--source", tiny_source], ["build", "--source", tiny_source, "--out", tmp_path / "o"],
                ["fetch"]):
        r = invoke(*cmd, "--pins", bad)
        assert r.exit_code == 2, (cmd, r.output)
        assert "invalid pins at revision" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_build_dry_run_and_existing_output(tmp_path, tiny_source, tiny_bundle):
    r = invoke("build", "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tmp_path, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["functions"] == ["t512", "t1024", "t2048", "t4096"] and plan["synthetic"] is True
    assert not any(tmp_path.iterdir())
    r = invoke("build", "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tiny_bundle.parent)
    assert r.exit_code == 2 and "already exists; pass --overwrite" in r.output


def test_build_refuses_symlinked_output(tmp_path, tiny_source):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "clef_flash_head_bucket_fp16w32").symlink_to(target)
    r = invoke("build", "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tmp_path, "--overwrite")
    assert r.exit_code == 2 and "symlink" in r.output
    assert not any(target.iterdir())


def test_bad_recipe_is_usage_error(tmp_path, tiny_source):
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "../escape"\n')
    r = invoke("build", recipe, "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tmp_path)
    assert r.exit_code == 2 and "invalid recipe at name" in r.output
    recipe.write_text('name = "x"\nweights = "int3"\n')
    r = invoke("build", recipe, "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tmp_path)
    assert r.exit_code == 2 and "weights" in r.output


def test_schema_command_prints_checked_in_schema():
    r = invoke("schema")
    assert r.exit_code == 0
    assert json.loads(r.stdout) == json.loads((ROOT / "manifests" / "metadata.schema.json").read_text())


def test_tiny_bundle_layout_and_manifest(tiny_bundle, tiny_source):
    name = "clef_flash_head_bucket_fp16w32"
    assert sorted(p.name for p in tiny_bundle.iterdir()) == ["build-record.json", f"{name}.aimodel", "metadata.json"]
    assert sorted(p.name for p in (tiny_bundle / f"{name}.aimodel").iterdir()) == ["main.hash", "main.mlirb", "metadata.json"]
    m = json.loads((tiny_bundle / "metadata.json").read_text())
    pins = json.loads((tiny_source / "pins.json").read_text())
    assert m["head"]["source"]["hf_id"] == "synthetic/clef-flash-head" and m["aot"] is None
    assert m["head"]["source"]["joint_head_safetensors_sha256"] == pins["files"]["joint_head.safetensors"]
    assert m["compilation"]["targets"] == []
    record = json.loads((tiny_bundle / "build-record.json").read_text())
    assert record["synthetic"] is True and record["verify"]["ok"] is True
    asset_meta = json.loads((tiny_bundle / f"{name}.aimodel" / "metadata.json").read_text())
    assert "SYNTHETIC" in json.dumps(asset_meta)


def test_inspect_reads_functions_from_the_asset(tiny_bundle):
    r = invoke("inspect", tiny_bundle, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert [f["name"] for f in info["functions"]] == ["t512", "t1024", "t2048", "t4096"]
    t1024 = info["functions"][1]
    assert [i["name"] for i in t1024["inputs"]] == ["hidden", "key_valid", "q_avg", "o_avg", "g_avg", "lexical",
                                                   "member", "type_ids", "q_valid", "o_valid"]
    assert t1024["inputs"][0]["shape"] == [1024, 64] and t1024["outputs"][0]["shape"] == [128]


def test_verify_artifact_detects_added_missing_altered(tiny_bundle_copy):
    b = tiny_bundle_copy
    assert invoke("verify-artifact", b).exit_code == 0
    (b / "extra.txt").write_text("x")
    r = invoke("verify-artifact", b)
    assert r.exit_code == 3 and "extra.txt: not part of the build" in r.output
    (b / "extra.txt").unlink()
    meta = b / "clef_flash_head_bucket_fp16w32.aimodel" / "metadata.json"
    meta.write_text(meta.read_text() + " ")
    r = invoke("verify-artifact", b)
    assert r.exit_code == 3 and "metadata.json: sha256 differs" in r.output
    mlirb = b / "clef_flash_head_bucket_fp16w32.aimodel" / "main.mlirb"
    data = bytearray(mlirb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    mlirb.write_bytes(bytes(data))
    r = invoke("verify-artifact", b)
    assert r.exit_code == 3 and "main.mlirb: sha256" in r.output
    mlirb.unlink()
    r = invoke("verify-artifact", b)
    assert r.exit_code == 3 and "main.mlirb: missing" in r.output


def test_verify_passes_with_red_arms_and_transcript(tmp_path, tiny_bundle, tiny_source):
    transcript = tmp_path / "t.json"
    r = invoke("verify", tiny_bundle, "--source", tiny_source, "--pins", tiny_source / "pins.json",
               "--records", 3, "--red", "--transcript", transcript)
    assert r.exit_code == 0, r.output
    t = json.loads(transcript.read_text())
    assert t["ok"] is True and len(t["functions"]) == 4
    for f in t["functions"]:
        assert f["records"] == 3 and f["max_abs_dp"] <= t["bars"]["max_abs_dp"]["bar"]
        assert f["padding_max_abs"] == 0.0 and f["rerun_identical"] is True
        assert f["argmax_agree"] == f["questions"]
        for arm in ("spans_late", "lexical_zero", "member_rotated"):
            assert f["red"][arm] > t["bars"]["max_abs_dp"]["bar"]
    assert all(t["bars"][k]["reason"] for k in t["bars"])
    assert {"python", "torch", "coreai-core", "coreai-torch", "clef-export"} <= set(t["versions"])


def test_verify_refuses_a_bundle_of_other_weights_at_once(tiny_bundle, tiny_source_other, monkeypatch):
    """A bundle and a release that can never agree: exit 3 naming both, before anything is loaded
    or run (was: every record through the runtime, then exit 4)."""
    from clef_flash.sources import author

    monkeypatch.setattr(author, "load_head", lambda *a, **k: pytest.fail("the head was loaded"))
    r = invoke("verify", tiny_bundle, "--source", tiny_source_other, "--pins", tiny_source_other / "pins.json", "--records", 1)
    assert r.exit_code == 3, r.output
    assert "built from synthetic/clef-flash-head@" in r.output and "pass the release it was built from" in r.output


def test_verify_exits_3_on_tampered_bundle(tiny_bundle_copy, tiny_source):
    mlirb = tiny_bundle_copy / "clef_flash_head_bucket_fp16w32.aimodel" / "main.mlirb"
    data = bytearray(mlirb.read_bytes())
    data[-10] ^= 0x01
    mlirb.write_bytes(bytes(data))
    r = invoke("verify", tiny_bundle_copy, "--source", tiny_source, "--pins", tiny_source / "pins.json", "--records", 1)
    assert r.exit_code == 3 and "main.mlirb: sha256" in r.output


def test_fp32_recipe_builds_through_the_same_code(tmp_path, tiny_source, tiny_bundle):
    from .conftest import build_bundle

    bundle = build_bundle(tiny_source, tmp_path, recipe=ROOT / "conversion" / "head_bucket_fp32.toml", verify=True)
    m = json.loads((bundle / "metadata.json").read_text())
    assert bundle.name == "clef_flash_head_bucket_fp32" and m["head"]["weights"] == "fp32"
    assert m["assets"]["main"] == "clef_flash_head_bucket_fp32.aimodel"
    assert json.loads((bundle / "build-record.json").read_text())["verify"]["ok"] is True
    from coreai.authoring.asset import AIModelAsset

    storage = dict(AIModelAsset.load(bundle / m["assets"]["main"]).summary(include_statistics=True).storage_types)
    from safetensors.torch import load_file

    params = sum(t.numel() for t in load_file(str(tiny_source / "joint_head.safetensors")).values())
    assert "Float16" not in storage and storage["Float32"] >= params  # every weight stored fp32


def test_failed_gate_in_build_lands_nothing(tmp_path, tiny_source, monkeypatch):
    """`build --verify` with a bar no asset can meet: exit 4, no bundle, no stray folders."""
    import clef_flash.gate.head as gate

    monkeypatch.setitem(gate.TOLERANCES, "max_abs_dp", (1e-12, "a bar for this test only"))
    r = invoke("build", "--source", tiny_source, "--pins", tiny_source / "pins.json", "--out", tmp_path)
    assert r.exit_code == 4, r.output
    assert "verification failed" in r.output and "max |d p|" in r.output
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
