"""The lm_head host table: layout, pins, fp16 range, and the loop table -> lexical -> asset."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clef_flash.cli import app
from clef_flash.sources.lm_head import INDEX_FILE, open_table
from clef_flash.digest import sha256_file

runner = CliRunner()
SHARD = "model-00002-of-00002.safetensors"


def table_cmd(source: Path, out: Path, pins: Path | None = None):
    return runner.invoke(app, ["lm-head-table", "--source", str(source), "--pins", str(pins or source / "pins.json"),
                               "--out", str(out), "--json"])


def test_table_layout_sidecar_and_hash(tmp_path, tiny_source):
    r = table_cmd(tiny_source, tmp_path / "host")
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "host" / "lm_head_fp16.json").read_text())
    raw = (tmp_path / "host" / "lm_head_fp16.bin").read_bytes()
    weight = load_file(str(tiny_source / SHARD))["lm_head.weight"]
    assert side["shape"] == list(weight.shape) == [512, 64] and len(raw) == 512 * 64 * 2 == side["bytes"]
    assert side["sha256"] == sha256_file(tmp_path / "host" / "lm_head_fp16.bin")
    assert side["source"]["tensor"] == "lm_head.weight" and side["source"]["file"] == SHARD
    assert side["source"]["sha256"] == sha256_file(tiny_source / SHARD) and side["read_back"]["ok"]
    row = 300  # row t at byte offset t x (2 x hidden)
    got = np.frombuffer(raw[row * 128 : (row + 1) * 128], dtype=np.float16)
    assert np.array_equal(got, weight[row].to(torch.float16).numpy())
    assert (tmp_path / "host" / "lm_head_fp16.bin").stat().st_size == 65536


def _tampered_source(tmp_path: Path, tiny_source: Path, weight: torch.Tensor) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    save_file({"lm_head.weight": weight}, str(src / SHARD))
    pins = json.loads((src / "pins.json").read_text())
    pins["files"][SHARD] = sha256_file(src / SHARD)
    (src / "pins.json").write_text(json.dumps(pins))
    return src


def test_value_outside_fp16_names_the_row(tmp_path, tiny_source):
    w = load_file(str(tiny_source / SHARD))["lm_head.weight"].clone()
    w[77, 5] = 1.0e6  # fits bf16, not fp16
    src = _tampered_source(tmp_path, tiny_source, w)
    r = table_cmd(src, tmp_path / "host")
    assert r.exit_code == 4 and "row 77 does not fit fp16" in r.output
    assert not (tmp_path / "host").exists()  # the folder is staged: a failure leaves none
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock") and p.name != "src"] == []


def test_unpinned_or_tampered_inputs_refused(tmp_path, tiny_source):
    pins = json.loads((tiny_source / "pins.json").read_text())
    del pins["files"][INDEX_FILE]
    p = tmp_path / "pins.json"
    p.write_text(json.dumps(pins))
    r = table_cmd(tiny_source, tmp_path / "a", p)
    assert r.exit_code == 3 and f"{INDEX_FILE} is not pinned" in r.output
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    data = bytearray((src / SHARD).read_bytes())
    data[-3] ^= 1
    (src / SHARD).write_bytes(bytes(data))
    r = table_cmd(src, tmp_path / "b")
    assert r.exit_code == 3 and f"{SHARD}: sha256 mismatch" in r.output


def test_table_lexical_asset_closes_the_loop(tmp_path, tiny_source, tiny_bundle, author_module):
    """table -> lexical rows -> the head asset == the author's head reading lm_head.weight directly."""
    from coreai.authoring.asset import AIModelAsset
    from coreai.runtime import NDArray

    from clef_flash.sources.author import load_head
    from clef_flash.head.records import author_logits, random_records
    from clef_flash.head.host import head_inputs, question_probs
    from clef_flash.sources.pins import load_pins

    assert table_cmd(tiny_source, tmp_path / "host").exit_code == 0
    table = open_table(tmp_path / "host" / "lm_head_fp16.bin")
    weight = load_file(str(tiny_source / SHARD))["lm_head.weight"].float()
    module, _, head = load_head(tiny_source, load_pins(tiny_source / "pins.json"), torch.float32)
    rec = random_records(3, 1024, 512, 64, 512, seed=3)[2]
    hi = head_inputs(rec.hidden, rec.ids, rec.questions, table, 1024)

    async def run():
        async with AIModelAsset.load(tiny_bundle / "clef_flash_head_bucket_fp16w32.aimodel").executable() as model:
            out = await model.load_function("t1024")({k: NDArray(v) for k, v in hi.arrays.items()})
            return np.array(out["logits"].numpy(), copy=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = asyncio.run(run())
    ref = author_logits(module, head, rec, weight)
    p_got = question_probs(got, hi.layout)
    p_ref = [torch.from_numpy(x).softmax(-1).numpy() for x in ref]
    assert max(float(np.abs(a - b).max()) for a, b in zip(p_got, p_ref)) <= 1e-5
    assert all(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(p_got, p_ref))
