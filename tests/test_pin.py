"""`clef-export pin`: a Hub commit from the Hub's own metadata (loopback fake Hub), a local release
folder in clef-finetune's layout; then that release end to end (build, verify, lm-head-table,
release) with no hand-written file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app
from clef_flash.digest import sha256_file

from .conftest import ROOT
from .test_fetch import run_cli

MAKE_TINY = {"hidden_size": 64, "width": 32, "routing_layers": 1, "layers": 1, "heads": 2, "feedforward": 64}
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_pin_a_hub_commit_from_its_metadata(tmp_path, hub, tiny_source):
    want = json.loads((tiny_source / "pins.json").read_text())
    out = tmp_path / "pins.json"
    r, _ = run_cli(["pin", want["hf_id"], "--revision", want["revision"], "--out", out, "--json"], hub.endpoint,
                   tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-1500:]
    got = json.loads(out.read_text())
    # the head's three files, the index and every shard it names (the backbone's build reads them all)
    names = ["joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert sorted(got["files"]) == names and all(got["files"][n] == want["files"][n] for n in names)
    assert got["origin"] == "hub" and got["revision"] == want["revision"]
    gets = sorted(p.rsplit("/", 1)[1] for m, p in hub.requests if m == "GET")
    assert gets == ["joint_head_config.json", "joint_schema_model.py", "model.safetensors.index.json"]  # LFS: no download
    # fetch then downloads exactly what is pinned, and verifies it
    r, _ = run_cli(["fetch", "--pins", out], hub.endpoint, tmp_path / "hf2")
    assert r.returncode == 0, r.stderr[-1500:]


def test_pin_refuses_a_tampered_small_file_and_a_branch(tmp_path, hub, tiny_source):
    want = json.loads((tiny_source / "pins.json").read_text())
    out = tmp_path / "pins.json"
    hub.faults["joint_head_config.json"] = "tamper"
    r, _ = run_cli(["pin", want["hf_id"], "--revision", want["revision"], "--out", out], hub.endpoint, tmp_path / "hf")
    assert r.returncode == 3 and "joint_head_config.json: git blob sha1" in r.stderr, r.stderr[-1500:]
    assert not out.exists()
    r, _ = run_cli(["pin", want["hf_id"], "--revision", "main", "--out", out], "http://127.0.0.1:9", tmp_path / "hf")
    assert r.returncode == 2 and "pin a commit" in r.stderr and not out.exists()
    r, _ = run_cli(["pin", want["hf_id"], "--revision", "0" * 40, "--out", out], hub.endpoint, tmp_path / "hf")
    assert r.returncode == 3 and "revision not found on the Hub" in r.stderr and not out.exists()


def _release(tmp_path: Path, author_code: Path, layout: str = "single", name: str = "rel") -> Path:
    from clef_flash.synth.release import write_release

    return write_release(tmp_path / name, config_name=MAKE_TINY, seed=5, author_code=author_code, layout=layout)


def test_unknown_author_code_runs_only_when_trusted_by_its_sha256(tmp_path, author_code):
    rel = _release(tmp_path, author_code)
    code = rel / "joint_schema_model.py"
    code.write_bytes(code.read_bytes() + b"\n# a local edit\n")
    digest = sha256_file(code)
    r = invoke("pin", rel, "--name", "edited")
    assert r.exit_code == 3 and f"sha256 {digest} is not a joint_schema_model.py this tool knows" in r.output
    assert f"--trust-author-code {digest}" in r.output and not (rel / "pins.json").exists()
    r = invoke("pin", rel, "--name", "edited", "--trust-author-code", "0" * 64)
    assert r.exit_code == 3 and not (rel / "pins.json").exists()
    r = invoke("pin", rel, "--name", "edited", "--trust-author-code", digest)
    assert r.exit_code == 3 and "CLEF_FINETUNE.json: says joint_schema_model.py has sha256" in r.output  # its record disagrees
    facts = json.loads((rel / "CLEF_FINETUNE.json").read_text())
    facts["joint_schema_model_sha256"] = digest
    (rel / "CLEF_FINETUNE.json").write_text(json.dumps(facts))
    r = invoke("pin", rel, "--name", "edited", "--trust-author-code", digest)
    assert r.exit_code == 0, r.output
    assert json.loads((rel / "pins.json").read_text())["trusted_author_sha256"] == digest
    r = invoke("build", "--source", rel, "--out", tmp_path / "out", "--dry-run")
    assert r.exit_code == 0, r.output
    # a pins file naming that file without the trust is refused before anything executes
    pins = json.loads((rel / "pins.json").read_text())
    pins["trusted_author_sha256"] = None
    (tmp_path / "untrusted.json").write_text(json.dumps(pins))
    r = invoke("build", "--source", rel, "--pins", tmp_path / "untrusted.json", "--out", tmp_path / "out", "--dry-run")
    assert r.exit_code == 3 and "refusing to execute it" in r.output


def test_local_release_pin_build_verify_table_release(tmp_path, author_code):
    """A release folder in clef-finetune's layout (make-tiny's head configuration, one
    model.safetensors, no index) goes pin -> build -> verify -> lm-head-table -> release."""
    rel = _release(tmp_path, author_code)
    r = invoke("pin", rel, "--name", "my_ft", "--json")
    assert r.exit_code == 0, r.output
    pins = json.loads((rel / "pins.json").read_text())
    assert pins["origin"] == "local" and pins["revision"] is None and pins["hf_id"] == "local/my_ft"
    assert pins["release"]["tiny_random"] and pins["release"]["lm_head_file"] == "model.safetensors"
    assert pins["release"]["clef_finetune"]["joint_schema_model_sha256"] == pins["files"]["joint_schema_model.py"]

    out = tmp_path / "out"
    r = invoke("build", "--source", rel, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    bundle = out / "my_ft_head_bucket_fp16w32"
    manifest = json.loads((bundle / "metadata.json").read_text())
    jsonschema.validate(manifest, json.loads((ROOT / "manifests" / "metadata.schema.json").read_text()))
    src = manifest["head"]["source"]
    assert src["hf_id"] == "local/my_ft" and src["revision"] is None
    assert src["origin"]["kind"] == "local" and src["origin"]["release"]["tiny_random"] is True
    assert manifest["assets"]["main"] == "my_ft_head_bucket_fp16w32.aimodel"
    assert json.loads((bundle / "build-record.json").read_text())["verify"]["ok"]

    r = invoke("verify", bundle, "--source", rel, "--records", "1")
    assert r.exit_code == 0, r.output
    r = invoke("lm-head-table", "--source", rel, "--out", tmp_path / "host", "--json")
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "host" / "lm_head_fp16.json").read_text())
    assert side["source"]["file"] == "model.safetensors" and side["shape"] == [512, 64]
    r = invoke("release", "--source", rel, "--dist", tmp_path / "dist", "--aot", "off")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "dist" / "my_ft_head_bucket_fp16w32" / "metadata.json").is_file()
    assert (tmp_path / "dist" / "SHA256SUMS").is_file()


@pytest.mark.parametrize("layout", ["sharded", "tied"])
def test_lm_head_of_a_sharded_and_a_tied_release(tmp_path, author_code, layout):
    rel = _release(tmp_path, author_code, layout=layout)
    assert invoke("pin", rel).exit_code == 0
    r = invoke("lm-head-table", "--source", rel, "--out", tmp_path / "host")
    if layout == "sharded":
        assert r.exit_code == 0, r.output
        side = json.loads((tmp_path / "host" / "lm_head_fp16.json").read_text())
        assert side["source"]["file"] == "model-00002-of-00002.safetensors" and side["source"]["index_sha256"]
    else:
        assert r.exit_code == 3 and "ties its embeddings" in r.output and len(r.output.strip().splitlines()) == 1
        assert not (tmp_path / "host").exists()


def test_pin_local_refuses_an_incomplete_folder(tmp_path, author_code):
    rel = _release(tmp_path, author_code)
    (rel / "joint_head_config.json").unlink()
    r = invoke("pin", rel)
    assert r.exit_code == 3 and "joint_head_config.json: missing" in r.output and not (rel / "pins.json").exists()
    r = invoke("pin", rel, "--revision", "0" * 40)
    assert r.exit_code == 2
    shutil.rmtree(rel)
    r = invoke("pin", tmp_path / "nowhere", "--revision", "main")
    assert r.exit_code == 2 and "pin a commit" in r.output
