"""The torch engine (issue 61): the export's own graph run by torch on the weights read back from a
backbone asset's main.mlirb through its weight map, held to the Core AI runtime.

A tiny release's backbone in int8 codes with fp32 compute (image inputs included) and in fp16
compute: the build's gate holds the engine's rows to the runtime's on every record; a drifted engine
fails it; past the runtime's size the gate's numeric check runs through the engine with a runtime
spot check; a changed weight map or blob is refused before any arithmetic; answer, serve and
check-release run on either engine with the same answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .test_backbone import _recipe, _release

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(scope="module")
def engine_bundles(tmp_path_factory, author_code) -> dict[str, Path]:
    """The tiny release; its int8 backbone with fp32 compute and image inputs (the README's int8w32
    recipe), gated; its fp16-compute backbone (chunk 16, context 128), gated; the head; a dist/ of the
    head and the int8w32 backbone."""
    root = tmp_path_factory.mktemp("engine")
    rel = _release(root, author_code, "tiny", 0, "tiny_release")
    out = {"release": rel}
    for key, recipe in (("int8w32", ROOT / "conversion" / "backbone_pf64_int8w32.toml"), ("fp16", _recipe(root, "fp16")),
                        ("head", ROOT / "conversion" / "head_bucket_fp16w32.toml")):
        res = runner.invoke(app, ["build", str(recipe), "--source", str(rel), "--out", str(root / key), "--json"])
        assert res.exit_code == 0, res.output[-3000:]
        out[key] = root / key / json.loads(res.stdout)["name"]
    dist = root / "dist"
    res = runner.invoke(app, ["release", str(ROOT / "conversion" / "head_bucket_fp16w32.toml"),
                              str(ROOT / "conversion" / "backbone_pf64_int8w32.toml"), "--source", str(rel), "--dist", str(dist)])
    assert res.exit_code == 0, res.output[-3000:]
    out["dist"] = dist
    return out


def _verify(bundle: Path, release: Path, tmp_path: Path, *extra: str):
    res = runner.invoke(app, ["verify", str(bundle), "--source", str(release), "--transcript", str(tmp_path / "t.json"), *extra])
    t = json.loads((tmp_path / "t.json").read_text()) if (tmp_path / "t.json").is_file() else None
    return res, t


# ---------------------------------------------------------------- held to the runtime


def test_the_builds_gate_holds_the_torch_engine_to_the_runtime(engine_bundles):
    """Every gate record (1, S - 1, S, S + 1, three chunks, near the context, an image spanning a chunk
    boundary) through the torch engine and through the runtime: fp32 compute within fp32 rounding
    (measured 9e-8 to 4.8e-7), fp16 compute (the engine in fp32 on this CPU) within the fp16 bound."""
    for key, bar in (("int8w32", 1e-5), ("fp16", 1e-2)):
        record = json.loads((engine_bundles[key] / "build-record.json").read_text())["verify"]
        assert record["ok"], record["failures"]
        engine = record["engine"]
        assert engine is not None and 0 < engine["rel_max_abs_d"] <= bar, (key, engine)
        assert any(line.startswith("torch engine: torch on cpu") for line in record["engines"]), record["engines"]
    m = json.loads((engine_bundles["int8w32"] / "metadata.json").read_text())
    assert m["export"]["weight_map"]["bytes"] == (engine_bundles["int8w32"] / "weight-map.safetensors").stat().st_size
    assert "fp32" in json.loads((engine_bundles["fp16"] / "build-record.json").read_text())["verify"]["engines"][0]


def test_the_engine_equals_the_runtime_on_an_image_record(engine_bundles):
    """The host's own inputs (an image's tokens as V + k, its rows, the shift) through both engines."""
    from clef_flash.backbone.host import ImageSpan
    from clef_flash.backbone.shipped import hidden_rows, read_backbone

    bundle = engine_bundles["int8w32"]
    m = json.loads((bundle / "metadata.json").read_text())
    bb = read_backbone(bundle, m["language"]["hidden_size"])
    rng = np.random.default_rng(3)
    ids = rng.integers(0, m["language"]["vocab_size"], size=150)
    span = ImageSpan(start=40, rows=rng.standard_normal((2 * 50, m["language"]["hidden_size"])).astype(np.float32), grid=(2, 50))
    runtime = hidden_rows(bb, [ids, ids[:70]], images=[span, None], engine="coreai")
    torch_rows = hidden_rows(bb, [ids, ids[:70]], images=[span, None], engine="torch")
    assert bb.ran_on["engine"] == "torch on cpu, fp32 compute"
    for a, b in zip(runtime, torch_rows, strict=True):
        assert a.shape == b.shape
        assert 0 < np.abs(a - b).max() / np.abs(a).max() <= 1e-5
    # the image matters in both: the same ids without it are far away
    assert np.abs(torch_rows[0] - hidden_rows(bb, [ids], images=[None], engine="torch")[0]).max() > 1e-2


def _drift_weight(monkeypatch, suffix: str, change) -> None:
    """The engine reads the weight named ``...suffix`` changed by ``change(rows, first row's index)``
    (in place, on a copy), read whole (a device that holds the weights) or by rows (a CPU's streamed read)."""
    from clef_flash.engine import weight_map

    real, real_blocks = weight_map.ShippedWeights.tensor, weight_map.ShippedWeights.widened_blocks

    def tensor(self, name):
        a = real(self, name).clone()
        if name.endswith(suffix):
            change(a, 0)
        return a

    def widened_blocks(self, name, dtype, *args, **kwargs):
        for r0, r1, rows in real_blocks(self, name, dtype, *args, **kwargs):
            if name.endswith(suffix):
                rows = rows.clone()
                change(rows, r0)
            yield r0, r1, rows
    monkeypatch.setattr(weight_map.ShippedWeights, "tensor", tensor)
    monkeypatch.setattr(weight_map.ShippedWeights, "widened_blocks", widened_blocks)


@pytest.mark.parametrize("drift", ["weight", "positions"])
def test_a_drifted_engine_fails_the_gate(engine_bundles, tmp_path, monkeypatch, drift):
    """The gate's engine rows see an engine that reads one weight wrongly or places every token one
    position late (exit 4, the torch engine's rows named); the runtime's rows still pass."""
    from clef_flash.backbone import graph
    from clef_flash.engine import weight_map

    if drift == "weight":
        _drift_weight(monkeypatch, "layers.0.mlp.down_proj.weight", lambda rows, r0: rows[:1].mul_(2) if r0 == 0 else None)
    else:
        real = graph.DecoderChunk.prelude
        monkeypatch.setattr(graph.DecoderChunk, "prelude",  # one position late (kept inside the context)
                            lambda self, ids, pos, image: real(self, ids, (pos + 1).clamp(max=self.ch.context - 1), image))
    res, t = _verify(engine_bundles["int8w32"], engine_bundles["release"], tmp_path)
    assert res.exit_code == 4, res.output[-2000:]
    assert "(torch engine)" in res.output and all("(torch engine)" in f for f in t["failures"]), t["failures"]


@pytest.mark.parametrize("form, bits", [("fp16", None), ("codes", 8), ("codes", 4)])
def test_widened_blocks_are_the_whole_tensors_rows(form, bits):
    """A matrix read a block of rows at a time (the CPU engine's and the gates' streamed read) has
    the values of the whole one widened, block by block, fp16 and int8 / int4 codes alike."""
    import torch

    from clef_flash.engine.quantize import Scheme, dequantize, pack_int4
    from clef_flash.engine.weight_map import BlockBuffers, widened_blocks

    rng = np.random.default_rng(7)
    rows, cols = 37, 64
    scheme = Scheme(bits, 16) if bits else None
    if form == "codes":
        codes = rng.integers(-scheme.qmax, scheme.qmax + 1, size=(rows, cols)).astype(np.int8)
        scales = rng.uniform(1e-3, 1e-1, size=scheme.scale_shape((rows, cols))).astype(np.float16)
        raw = codes.view(np.uint8).reshape(-1) if bits == 8 else pack_int4(codes)
        want, raw_scales = dequantize(codes, scales, scheme).astype(np.float32), scales.view(np.uint8).reshape(-1)
    else:
        values = rng.standard_normal((rows, cols)).astype(np.float16)
        raw, raw_scales, want = values.view(np.uint8).reshape(-1), None, values.astype(np.float32)
    for buffers in (None, BlockBuffers(torch.float32, block_bytes=cols * 4 * 5)):  # made here, or the engine's reused ones
        got = np.zeros_like(want)
        seen = []
        for r0, r1, block in widened_blocks(form, raw, raw_scales, (rows, cols), scheme, torch.float32,
                                            block_bytes=cols * 4 * 5, buffers=buffers):
            got[r0:r1] = block.numpy()
            seen.append(r1 - r0)
        assert seen == [5] * 7 + [2]
        assert np.array_equal(got, want)


# ---------------------------------------------------------------- past the runtime's size


def test_past_the_runtimes_size_the_gate_proves_numbers_through_the_engine(engine_bundles, tmp_path, monkeypatch):
    """A decoder over numeric_max_parameters (here: every decoder) is not "numeric check not run": two
    records of 512 tokens through the engine against the reference on the asset's own weights (gated)
    and the uncompressed release (reported), and one chunk through the runtime against the engine where
    it computes in fp32; in fp16 compute the spot check is said not run, with its cost, unless asked."""
    from clef_flash.backbone import executor

    monkeypatch.setitem(executor.RUNTIME_MAX_PARAMETERS, "fp32", 0)
    monkeypatch.setitem(executor.RUNTIME_MAX_PARAMETERS, "fp16", 0)
    res, t = _verify(engine_bundles["int8w32"], engine_bundles["release"], tmp_path)
    assert res.exit_code == 0, res.output[-3000:]
    arms = {(r["record"], r["arm"]) for r in t["arms_run"]}
    assert arms == {("record-1", "main"), ("record-2", "main"), ("record-1", "quantization"), ("record-2", "quantization"),
                    ("record-1, chunk 1", "torch engine")}
    assert all(r["tokens"] == 512 for r in t["records"] if r["arm"] != "torch engine")
    assert not t["notes"] and any("numeric check through the torch engine" in line for line in t["engines"])
    spot = next(r for r in t["records"] if r["arm"] == "torch engine")
    assert spot["tokens"] == 64 and 0 < spot["rel_max_abs_d"] <= 1e-5

    res, t = _verify(engine_bundles["fp16"], engine_bundles["release"], tmp_path)
    assert res.exit_code == 0, res.output[-3000:]
    assert any("runtime spot check not run" in n and "--spot-check" in n for n in t["notes"]), t["notes"]
    assert not any(r["arm"] == "torch engine" for r in t["records"])
    res, t = _verify(engine_bundles["fp16"], engine_bundles["release"], tmp_path, "--spot-check")
    assert res.exit_code == 0 and any(r["arm"] == "torch engine" for r in t["records"])

    # a gate that cannot fail proves nothing: an engine reading a weight wrongly fails it at this size too
    _drift_weight(monkeypatch, "layers.1.mlp.up_proj.weight", lambda rows, r0: rows.mul_(1.5))
    res, t = _verify(engine_bundles["int8w32"], engine_bundles["release"], tmp_path)
    assert res.exit_code == 4 and "record-1" in t["failures"][0], res.output[-2000:]


# ---------------------------------------------------------------- bad input


def test_a_changed_weight_map_or_blob_is_refused_before_any_arithmetic(engine_bundles, tmp_path, monkeypatch):
    """The map's sha256 is the manifest's (exit 3, the file named); a blob whose bytes are not the map's
    is named with its tensor; a bundle built before the map is told to build again (exit 2 for
    --engine torch), and the gate says why it ran no engine rows."""
    from clef_flash.backbone.bundle import check_files
    from clef_flash.backbone.executor import open_shipped_weights
    from clef_flash.errors import IntegrityError
    from clef_flash.formats.mlirb import blobs

    from .conftest import rerecord

    copy = tmp_path / engine_bundles["int8w32"].name
    shutil.copytree(engine_bundles["int8w32"], copy)
    f = copy / "weight-map.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    res = runner.invoke(app, ["verify", str(copy), "--source", str(engine_bundles["release"])])
    assert res.exit_code == 3 and "weight-map.safetensors: sha256 differs from build-record.json" in res.output, res.output
    rerecord(copy)  # past the build record: the manifest's digest sees it
    res = runner.invoke(app, ["verify", str(copy), "--source", str(engine_bundles["release"])])
    assert res.exit_code == 3 and "weight-map.safetensors: missing or its sha256 differs from the manifest's" in res.output, res.output
    data[-1] ^= 1
    f.write_bytes(bytes(data))

    m, asset, _ = check_files(copy)
    mapped = {b.name for w in open_shipped_weights(copy, asset, m).map.weights for b in w.blobs}
    mlirb = asset / "main.mlirb"
    blob = next(b for b in blobs(mlirb) if b.name in mapped and b.size > 64)
    raw = bytearray(mlirb.read_bytes())
    raw[blob.start + 7] ^= 0x10
    mlirb.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="main.mlirb: sha256 differs"):
        open_shipped_weights(copy, asset, m)
    import hashlib

    from safetensors import safe_open
    from safetensors.numpy import save_file

    # past the file's digest (a forger who rewrote the manifest and the map's file digest): each blob's
    # own digest in the map names the tensor whose bytes changed
    new_sha = hashlib.sha256(bytes(raw)).hexdigest()
    with safe_open(str(f), framework="np") as fh:
        wmap, tensors = json.loads(fh.metadata()["weight_map"]), {k: fh.get_tensor(k) for k in fh.keys()}
    wmap["main_mlirb_sha256"] = new_sha
    save_file(tensors, str(f), metadata={"weight_map": json.dumps(wmap)})
    meta = json.loads((copy / "metadata.json").read_text())
    meta["export"]["main_mlirb"]["sha256"] = new_sha
    meta["export"]["weight_map"]["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    m2 = type(m).model_validate(meta)
    name = next(w.name for w in open_shipped_weights(copy, asset, m2, check_blobs=False).map.weights
                if any(b.name == blob.name for b in w.blobs))
    with pytest.raises(IntegrityError, match=f"{name}'s blob {blob.name} differs from weight-map.safetensors's sha256"):
        open_shipped_weights(copy, asset, m2)

    old = tmp_path / "old" / engine_bundles["int8w32"].name
    shutil.copytree(engine_bundles["int8w32"], old)
    (old / "weight-map.safetensors").unlink()
    meta = json.loads((old / "metadata.json").read_text())
    meta["export"]["weight_map"] = None
    (old / "metadata.json").write_text(json.dumps(meta))
    rerecord(old)
    m3, asset3, _ = check_files(old)
    from clef_flash.backbone.executor import choose_engine
    from clef_flash.errors import UsageError

    with pytest.raises(UsageError, match="no weight map"):
        choose_engine(old, m3, "torch")
    assert choose_engine(old, m3, "auto").engine == "coreai"
    from clef_flash.backbone import executor

    monkeypatch.setitem(executor.RUNTIME_MAX_PARAMETERS, "fp32", 0)
    res, t = _verify(old, engine_bundles["release"], tmp_path)
    assert res.exit_code == 0 and not t["records"], res.output[-2000:]
    assert "numeric check not run" in t["notes"][0] and "no weight map for the torch engine (build it again)" in t["notes"][0]


def test_engine_and_device_options_are_refused_before_work(engine_bundles, tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text((ROOT / "conversion" / "requests-answer.jsonl").read_text())
    for extra, said in ((["--engine", "fast"], "--engine must be one of auto, coreai, torch"),
                        (["--engine", "torch", "--device", "cuda"], "--device cuda: torch"),
                        (["--device", "tpu"], "--device must be auto, cpu, cuda or mps")):
        res = runner.invoke(app, ["answer", str(engine_bundles["dist"]), "--requests", str(reqs), *extra])
        assert res.exit_code == 2 and said in res.output, res.output
    res = runner.invoke(app, ["verify", str(engine_bundles["int8w32"]), "--source", str(engine_bundles["release"]),
                              "--device", "cuda"])
    assert res.exit_code == 2 and "sees no CUDA device" in res.output
    res = runner.invoke(app, ["verify", str(engine_bundles["head"]), "--source", str(engine_bundles["release"]),
                              "--spot-check"])
    assert res.exit_code == 2 and "--spot-check is not an option for a head bundle" in res.output


# ---------------------------------------------------------------- answering on either engine


def test_answer_and_check_release_on_either_engine_agree(engine_bundles, tmp_path, monkeypatch):
    """The same requests through the runtime and through the torch engine: every answer within 1e-4
    (both rounded to 4 digits); the engine is said on stderr and in check-release's transcript; the
    host vectors pass on the torch engine; auto takes the torch engine past the runtime's size."""
    from clef_flash import progress

    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)  # every progress line (a 9B request takes minutes)
    reqs = ROOT / "conversion" / "requests-answer.jsonl"
    got = {}
    for engine in ("coreai", "torch"):
        res = runner.invoke(app, ["answer", str(engine_bundles["dist"]), "--requests", str(reqs), "--engine", engine])
        assert res.exit_code == 0, res.output[-2000:]
        assert f"decoder: {engine} on cpu" in res.output
        # on the torch engine a request's decoder says how far it is, with an estimate of what is left
        assert ("request on line 1: decoder layer 1/4 (" in res.output and "s left)" in res.output) == (engine == "torch")
        got[engine] = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert len(got["torch"]) == len(got["coreai"]) >= 3
    for a, b in zip(got["coreai"], got["torch"], strict=True):
        for qid, qa in a["answers"].items():
            qb = b["answers"][qid]
            for k in ("noul", "score", "confidence"):
                if k in qa:
                    assert abs(qa[k] - qb[k]) <= 1e-4 + 1e-12, (a["id"], qid, k)
            assert qa.get("choice") == qb.get("choice")
    res = runner.invoke(app, ["answer", str(engine_bundles["dist"]), "--vectors", "--engine", "torch"])
    assert res.exit_code == 0 and "host vectors agree" in res.output, res.output[-2000:]
    vectors = (engine_bundles["dist"] / "host" / "host-vectors.jsonl").read_text().splitlines()
    assert json.loads(vectors[0])["engine"] == "coreai on cpu, fp32 compute"  # tiny: the runtime is the default here

    res = runner.invoke(app, ["check-release", str(engine_bundles["release"]), "--bundle", str(engine_bundles["head"]),
                              "--backbone", str(engine_bundles["int8w32"]), "--requests", str(reqs), "--engine", "torch",
                              "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["backbone"]["engine"] == "torch on cpu, fp32 compute" and s["disagreements"] == 0
    res = runner.invoke(app, ["check-release", str(engine_bundles["release"]), "--bundle", str(engine_bundles["head"]),
                              "--backbone", str(engine_bundles["int8w32"]), "--engine", "torch", "--red", "state"])
    assert res.exit_code == 2 and "--engine coreai" in res.output

    from clef_flash.backbone import executor

    monkeypatch.setitem(executor.RUNTIME_MAX_PARAMETERS, "fp32", 0)
    res = runner.invoke(app, ["answer", str(engine_bundles["dist"]), "--requests", str(reqs)])
    assert res.exit_code == 0 and "decoder: torch on cpu" in res.output and "minutes a chunk" in res.output


def test_serve_on_the_torch_engine_says_so_and_answers_as_answer(engine_bundles):
    import httpx

    from .serving import Served

    body = json.loads((ROOT / "conversion" / "requests-answer.jsonl").read_text().splitlines()[0])
    want = runner.invoke(app, ["answer", str(engine_bundles["dist"]), "--requests",
                               str(ROOT / "conversion" / "requests-answer.jsonl"), "--engine", "torch"])
    first = json.loads(next(x for x in want.stdout.splitlines() if x.startswith("{")))
    s = Served(engine_bundles["dist"], "--engine", "torch")
    try:
        health = httpx.get(s.url + "/health", timeout=10).json()
        assert health["engine"] == "torch on cpu, fp32 compute"
        r = httpx.post(s.url + "/client/v4/accounts/local/ai/run/@cf/cloudflare/clef-flash", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["result"]["answers"] == first["answers"]
    finally:
        code, log = s.stop()
    assert code == 0 and "decoder: torch on cpu" in log, log[-2000:]


# ---------------------------------------------------------------- a stop is prompt


def test_a_stop_during_a_runtime_call_that_does_not_return_is_prompt(tmp_path):
    """Ctrl-C or SIGTERM while a runtime call is in flight (one lasts minutes at 9B and cannot be
    interrupted): the command waits ``STOP_GRACE_S`` for it, then exits 130 with one line and its
    folders in progress removed, not after the call."""
    import signal
    import subprocess
    import sys
    import time

    from clef_flash.interrupts import STOP_GRACE_S

    script = (
        "import asyncio, sys, time\nfrom pathlib import Path\nfrom clef_flash import interrupts\n"
        "interrupts.install()\nfolder = Path(sys.argv[1]); folder.mkdir()\n"
        "interrupts.removed_at_a_forced_stop(folder)\n"
        "async def call():\n    print('in flight', flush=True)\n    await asyncio.to_thread(time.sleep, 120)\n"
        "try:\n    interrupts.run_async(call)\nexcept interrupts.Interrupt:\n    sys.exit(130)\nprint('returned')\n")
    for sig in (signal.SIGINT, signal.SIGTERM):
        folder = tmp_path / f"staged-{int(sig)}"
        p = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "in flight"
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert p.returncode == 130 and "returned" not in out, (p.returncode, out, err)
        assert "interrupted: nothing was written" in err and len(err.strip().splitlines()) == 1, err
        assert STOP_GRACE_S - 0.5 <= took <= STOP_GRACE_S + 5, took
        assert not folder.exists()
