"""Compressed backbones (issue 29): int8 / int4 codes per block with fp16 scales, streamed into
main.mlirb, gated in two parts (the runtime against torch eager on the asset's own dequantized
weights; the quantization against the uncompressed release), a per-layer plan chosen for the
release's own weights, and check-release through the compressed asset.

A tiny release (make-tiny's configuration) goes pin -> int8w32 / int4 / int8-with-a-fp16-layer
builds (the gate runs in each) -> plan-weights -> a build from the plan -> check-release."""

from __future__ import annotations

import hashlib
import os
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _recipe(tmp: Path, weights: str, compute: str, chunk: int = 16, context: int = 128, extra: str = "") -> Path:
    # a name per distinct recipe (str hash() is seeded per process)
    p = tmp / f"backbone_{weights}_{compute}_{chunk}_{context}_{hashlib.sha256(extra.encode()).hexdigest()[:8]}.toml"
    p.write_text(f'model = "backbone"\nname = "{{release}}_decode_{weights}_{compute}_pf{chunk}"\nchunk = {chunk}\n'
                 f'context = {context}\nweights = "{weights}"\ncompute = "{compute}"\n{extra}')
    return p


@pytest.fixture(scope="module")
def release(tmp_path_factory, author_code) -> Path:
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release
    from clef_flash.sources.pinning import pin_local

    rel = write_release(tmp_path_factory.mktemp("compressed-release") / "tiny_release", config_name=MAKE_TINY_HEAD,
                        seed=0, author_code=author_code, backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    return rel


@pytest.fixture(scope="module")
def built(release, tmp_path_factory) -> dict[str, Path]:
    """int8 fp32 compute, int4 fp16 compute, int8 fp16 compute with layer 0 kept fp16: each gated in its build."""
    tmp = tmp_path_factory.mktemp("compressed-builds")
    out = {}
    for key, weights, compute, extra in (("int8w32", "int8", "fp32", ""), ("int4", "int4", "fp16", ""),
                                         ("int8-l0", "int8", "fp16", "fp16_layers = [0]\n")):
        res = runner.invoke(app, ["build", str(_recipe(tmp, weights, compute, extra=extra)), "--source", str(release),
                                  "--out", str(tmp / key), "--json"])
        assert res.exit_code == 0, res.output[-3000:]
        out[key] = tmp / key / json.loads(res.stdout)["name"]
    return out


# ---------------------------------------------------------------- the rule, no Core AI asset


@pytest.mark.parametrize("bits", [8, 4])
def test_the_build_and_gate_quantizers_agree_and_keep_the_rule(bits):
    """torch (the build) and numpy (the gate) give the same codes and scales bit for bit, on blocks
    that test the rule's edges: all zero, too small for a normal fp16 scale, values at half a step;
    each dequantized value is within half a step of the weight."""
    import torch

    from clef_flash.engine.quantize import SCALE_FLOOR, Buffers, Scheme, dequantize, quantize_np, quantize_torch

    sch = Scheme(bits, 32)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 128)) * 0.02).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: the scale floor, codes 0
    w[1, :32] *= 1e-4  # absmax / qmax below 2**-14: floored, never an fp16 subnormal
    w[2, :32] = 0.0
    w[2, :4] = np.array([0.5, 1.5, 2.5, 3.5], dtype=np.float32) * 2.0 ** -8  # values at exactly half a step
    w[2, 31] = sch.qmax * 2.0 ** -8  # so the block's scale is exactly 2**-8
    codes_t, scales_t = quantize_torch(torch.from_numpy(w), sch)
    codes_n, scales_n = quantize_np(w, sch)
    assert np.array_equal(codes_t.numpy(), codes_n) and np.array_equal(scales_t.numpy().view(np.uint16), scales_n.view(np.uint16))
    # the buffers the build and the gate reuse from block to block, dirty from an earlier call, change nothing
    work, ring = torch.full((w.size + 64,), 7.0), torch.full((w.size + 64,), 5, dtype=torch.int8)
    quantize_torch(torch.from_numpy(w[:8] * 3), sch, work, ring)
    codes_r, scales_r = quantize_torch(torch.from_numpy(w), sch, work, ring)
    assert np.array_equal(codes_r.numpy(), codes_n) and np.array_equal(scales_r.numpy().view(np.uint16), scales_n.view(np.uint16))
    buffers = Buffers(w.size + 64, sch)
    quantize_np(w[:8] * 3, sch, buffers)
    codes_b, scales_b = quantize_np(w, sch, buffers)
    assert codes_b.base is not None and np.array_equal(codes_b, codes_n) and np.array_equal(scales_b.view(np.uint16), scales_n.view(np.uint16))
    assert scales_n.dtype == np.float16 and float(scales_n.min()) >= SCALE_FLOOR
    assert not codes_n[0, :32].any() and np.abs(codes_n).max() <= sch.qmax
    deq = dequantize(codes_n, scales_n, sch).astype(np.float32)
    step = np.repeat(scales_n.astype(np.float32), 32, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 + np.abs(w) * 2.0 ** -11 + 1e-12)
    # rounding half to even on exact halves
    assert float(scales_n[2, 0]) == 2.0 ** -8
    assert list(codes_n[2, :4]) == [0, 2, 2, 4]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_planners_dequantized_weights_are_the_numpy_rules(release, monkeypatch, bits):
    """plan-weights dequantizes with the build's torch rule in row tiles (``dequantized_release``):
    every value must be the gate's numpy rule over the whole matrix (``quantize_np`` + ``dequantize``),
    scaled by ``2**k`` (fp32 compute) and not, with tiles that end inside a read block."""
    from clef_flash.engine import streamed_weights as W
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.engine.quantize import Scheme, dequantize, quantize_np
    from clef_flash.backbone.contract import compressed_names
    from clef_flash.backbone import sensitivity
    from clef_flash.backbone.sensitivity import dequantized_release

    sch = Scheme(bits, 32)
    infos = W.locate(release, weight_names(read_text_config(release)))
    names = compressed_names({n: t.shape for n, t in infos.items()}, sch)
    assert len(names) >= 4
    monkeypatch.setattr(W, "TILE_VALUES", 3 * 64)  # a few rows a tile, the last one short
    # read blocks of a few rows too: tiles restart at each block, the last of a block short
    monkeypatch.setattr(sensitivity, "raw_blocks", lambda folder, t: W.raw_blocks(folder, t, block_bytes=1000))
    for name in names[:4]:
        t = infos[name]
        w = np.concatenate([W.as_f32(raw, t.dtype) for _, _, raw in W.raw_blocks(release, t, block_bytes=1000)]).reshape(t.shape)
        for scaled in (False, True):
            k = W.scale_exponent(float(np.abs(w).max())) if scaled else 0
            assert not scaled or k != 0  # the scaled path is exercised
            want = dequantize(*quantize_np(w * np.float32(2.0 ** k), sch), sch).astype(np.float32) / np.float32(2.0 ** k)
            got = dequantized_release(release, t, sch, scaled)
            assert got.dtype == np.float32 and got.shape == w.shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, scaled)


def test_int4_packing_is_coreai_torchs_and_the_op_is_our_dequantize():
    """Our int4 packing equals coreai-torch's own (the bytes its converter writes), unpacking
    returns the codes, and coreai-torch's blockwise op computes our dequantize bit for bit."""
    import torch

    import coreai_torch._compression.custom_layers  # noqa: F401
    from coreai_torch._compression._intx import pack_intx

    from clef_flash.engine.quantize import Scheme, dequantize, pack_int4, pack_int4_torch, quantize_np, unpack_int4

    rng = np.random.default_rng(1)
    codes = rng.integers(-7, 8, size=(16, 64)).astype(np.int8)
    theirs = pack_intx(torch.from_numpy(codes), 4).numpy()
    assert np.array_equal(pack_int4(codes), theirs) and np.array_equal(pack_int4_torch(torch.from_numpy(codes)).numpy(), theirs)
    assert np.array_equal(unpack_int4(theirs, codes.size).reshape(codes.shape), codes)
    for bits in (8, 4):
        sch = Scheme(bits, 32)
        q, s = quantize_np((rng.standard_normal((16, 64)) * 0.05).astype(np.float32), sch)
        op = torch.ops.coreai.constexpr_blockwise_shift_scale(torch.from_numpy(q), torch.from_numpy(s), None, None,
                                                              torch.int4 if bits == 4 else torch.int8)
        assert op.dtype == torch.float16
        assert np.array_equal(op.numpy().view(np.uint16), dequantize(q, s, sch).view(np.uint16))


def test_recipes_check_the_scheme(tmp_path):
    bad = {'weights = "int8"\nblock = 31\n': "block 31 must be even",
           'weights = "fp16"\nfp16_layers = [1]\n': "fp16_layers and plan are for compressed weights",
           'weights = "int8"\nfp16_layers = [-1]\n': "layer indices",
           'weights = "int8"\nfp16_layers = [0]\nplan = "p.json"\n': "not both",
           'weights = "int3"\n': "weights"}
    for body, why in bad.items():
        p = tmp_path / "r.toml"
        p.write_text(f'model = "backbone"\nname = "x"\nchunk = 16\ncontext = 128\n{body}')
        res = runner.invoke(app, ["build", str(p), "--dry-run", "--source", str(tmp_path)])
        assert res.exit_code == 2 and why in res.output, (body, res.output)
    for name in ("backbone_pf64_int8.toml", "backbone_pf64_int8w32.toml", "backbone_pf64_int4.toml"):
        from clef_flash.recipe import load_recipe

        r = load_recipe(ROOT / "conversion" / name)
        assert r.scheme is not None and r.scheme.block == 32 and r.experimental == (r.weights == "int4")


# ---------------------------------------------------------------- built and gated


def test_compressed_builds_say_what_was_compressed(built, release):
    from clef_flash.backbone.manifest import BackboneManifest

    for key, bundle in built.items():
        m = BackboneManifest.model_validate_json((bundle / "metadata.json").read_text())
        c = m.export.compression
        assert c is not None and m.export.weights == ("int4" if key == "int4" else "int8") and c.block == 32
        assert c.experimental == (key == "int4")
        assert c.fp16_layers == ([0] if key == "int8-l0" else [])
        kinds = {entry.layer: entry.weights for entry in c.layers}
        assert kinds == {i: ("fp16" if key == "int8-l0" and i == 0 else m.export.weights) for i in range(4)}
        assert c.compressed_tensors == (23 if key == "int8-l0" else 31)  # 8 linears in each linear layer, 7 in the full one
        assert c.other["tensors"] == 4  # the embedding and three conv1d weights stay fp16
        assert c.implied_bytes == sum(entry.bytes for entry in c.layers) + c.other["bytes"]
        assert c.implied_bytes < m.export.weight_fp16_bytes
        s = json.loads((bundle / "build-record.json").read_text())["verify"]
        assert s["ok"] and s["quantization"]["rel_max_abs_d"] > 0
        assert set(s["red"]) == {"state_reset", "positions_late", "scales_shifted", "codes_transposed"}
        bars = s["bars"]["rel_max_abs_d"]
        assert all(v > bars for v in s["red"].values()) and all(r["rel_max_abs_d"] <= bars for r in s["records"].values())
    # gate (a) at fp32 compute: the runtime is exact to fp32 rounding on the asset's own weights, while
    # the quantization's own cost is orders larger (what the split is for)
    s = json.loads((built["int8w32"] / "build-record.json").read_text())["verify"]
    worst = max(r["rel_max_abs_d"] for r in s["records"].values())
    assert worst < 1e-5 < s["quantization"]["rel_max_abs_d"]


def test_streamed_codes_are_the_bytes_of_the_unstreamed_route(release, tmp_path, monkeypatch):
    """Codes and scales written into main.mlirb while it is written (streamed) = the same program
    converted with every value in hand, byte for byte; the converter's own route (its copies of
    every value) holds the same blobs (it writes the smallest constants inline). At context 1024 the
    filled file's offsets section grew past the resource section's alignment, which the small
    file's writer had left undeclared: the runtime refused the file until inflate declared it.

    The same bytes where a process of its own makes the codes and scales while the graph is traced
    (``ahead``, a build's default) and the save reads them back.

    How the streamed route gets there without it: each tensor's scales are asked before its codes, and its
    codes' pass divides by the scales that pass kept; every tensor but the first is named to
    ``prefetch`` (inflate's ``upcoming``) before it is asked, and nothing else is."""
    from clef_flash.engine import streamed_weights as W
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.backbone.export import export_job
    from clef_flash.engine.quantize import Scheme
    from clef_flash.backbone.contract import compressed_names
    from clef_flash.formats.mlirb import blob_sha256, blobs

    calls: list[tuple] = []
    stream, prefetch, code_blocks = W.Fp16Weights.stream, W.Fp16Weights.prefetch, W.Fp16Weights._code_blocks
    monkeypatch.setattr(W.Fp16Weights, "stream", lambda self, name, part="fp16", *a, **k: (calls.append(("ask", name, part)), stream(self, name, part, *a, **k))[1])
    monkeypatch.setattr(W.Fp16Weights, "prefetch", lambda self, name: (calls.append(("hint", name, None)), prefetch(self, name))[1])
    monkeypatch.setattr(W.Fp16Weights, "_code_blocks", lambda self, t, k, packed, block_bytes=W._BLOCK_BYTES, scales_only=False, scales_made=None:
                        (calls.append(("codes from kept scales", t.name, None)) if scales_made is not None and not scales_only else None,
                         code_blocks(self, t, k, packed, block_bytes, scales_only, scales_made))[1])
    will_need = W._will_need
    monkeypatch.setattr(W, "_will_need", lambda path, offset, length: (calls.append(("read ahead", offset, length)), will_need(path, offset, length))[1])

    cfg = read_text_config(release)
    said: list[str] = []
    for bits, compute, context in ((8, "fp32", 1024), (4, "fp16", 64)):
        names = compressed_names(weight_names(cfg), Scheme(bits, 32), [1])
        digests = {}
        for route, job_extra in (("own", {"buffers": False}), ("held", {"stream": False}), ("streamed", {"ahead": False}),
                                 ("ahead", {})):
            calls.clear()
            said.clear()
            d = tmp_path / f"{bits}-{route}"
            d.mkdir()
            job = {"source": str(release), "asset_dir": str(d / "a.aimodel"), "text_config": cfg.as_dict(), "chunk": 64 if context > 64 else 16,
                   "context": context, "compute": compute, "description": {"author": "t", "license": "t", "description": "t"},
                   "quantization": {"bits": bits, "block": 32, "tensors": names}, **job_extra}
            export_job(job, said.append)
            path = d / "a.aimodel" / "main.mlirb"
            with open(path, "rb") as fh:
                digests[route] = (hashlib.sha256(path.read_bytes()).hexdigest(), {blob_sha256(fh, b) for b in blobs(path)})
            if route == "streamed":
                asked = [(n, part) for kind, n, part in calls if kind == "ask"]
                order = list(dict.fromkeys(n for n, _ in asked))
                hinted = [n for kind, n, _ in calls if kind == "hint"]
                coded = [n for n, part in asked if part == "codes"]
                assert coded and all(asked[asked.index((n, "codes")) - 1] == (n, "scales") for n in coded), bits
                assert [n for kind, n, _ in calls if kind == "codes from kept scales"] == coded, bits
                assert set(hinted) <= set(order), bits  # nothing else
                ahead = [c[1] for c in calls if c[0] == "read ahead"]  # on a thread: pending ones are dropped at close
                assert ahead and len(ahead) == len(set(ahead)) <= len(set(hinted)), bits  # each tensor read ahead once at most
                first_ask = {n: next(i for i, c in enumerate(calls) if c[:2] == ("ask", n)) for n in order}
                assert all(any(c == ("hint", n, None) for c in calls[:first_ask[n]]) for n in order[1:]), bits
            if route == "ahead":  # every compressed tensor's parts made by the process, none here
                assert any("compressed tensors made ahead when the save began" in m for m in said), bits
                assert not [c for c in calls if c[0] == "codes from kept scales"], bits
                assert {n for kind, n, part in calls if kind == "ask" and part != "fp16"} == set(names), bits
        assert digests["streamed"] == digests["held"] == digests["ahead"], bits
        assert digests["own"][1] <= digests["streamed"][1], bits


def _found(bundle: Path, release: Path):
    from clef_flash.engine.asset_readback import compare
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.backbone.manifest import BackboneManifest
    from clef_flash.engine.streamed_weights import locate
    from clef_flash.gate.backbone import compression_of

    m = BackboneManifest.model_validate_json((bundle / "metadata.json").read_text())
    text = read_text_config(release)
    scheme, names = compression_of(m, text)
    mlirb = next(bundle.glob("*.aimodel")) / "main.mlirb"
    return lambda path: compare(path, release, locate(release, weight_names(text)), m.export.compute == "fp32",
                                scheme=scheme, compressed=names), mlirb


# another machine's CPU, as far as one machine can play it: torch's scalar kernels (no AVX2 / AVX-512)
# and numpy's dispatch to them off, one thread, and another path, temp folder, hash seed, stack limit
OTHER_MACHINE = {"ATEN_CPU_CAPABILITY": "default", "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
                 "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "99", "TZ": "Pacific/Chatham"}


def test_compressed_bytes_are_the_same_on_a_rerun_and_on_another_machine(built, release, tmp_path):
    """The int8 (fp32 compute) and int4 builds again, in another process set up as another machine
    would be (``OTHER_MACHINE``): main.mlirb is the same bytes, and so is what the manifest says was
    compressed. The codes' rule is exact arithmetic (absmax, one division, round half to even), so
    no vector width or thread count may move a byte."""
    import resource
    import subprocess
    import sys

    from .test_repro import cli_build, other_interpreter

    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env={**__import__("os").environ, **OTHER_MACHINE}, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "DEFAULT", probe.stdout  # the scalar kernels really ran
    other = tmp_path / "other cwd"
    other.mkdir()
    python = other_interpreter(tmp_path)
    for key, weights, compute in (("int8w32", "int8", "fp32"), ("int4", "int4", "fp16")):
        recipe = _recipe(tmp_path, weights, compute)
        again = cli_build(python, release, tmp_path / key, other,
                          {**OTHER_MACHINE, "TMPDIR": str(other)}, resource.RLIM_INFINITY, recipe=recipe, name=built[key].name)
        first, second = (b / f"{b.name}.aimodel" for b in (built[key], again))
        for f in ("main.mlirb", "main.hash"):
            assert (first / f).read_bytes() == (second / f).read_bytes(), (key, f)
        c1, c2 = (json.loads((b / "metadata.json").read_text())["export"]["compression"] for b in (built[key], again))
        assert c1 == c2 and c1["compressed_tensors"] > 0


@pytest.mark.parametrize("key", ["int8w32", "int4"])
def test_a_changed_code_or_scale_is_named(built, release, tmp_path, key):
    check, mlirb = _found(built[key], release)
    report = check(mlirb)
    assert report.ok and len(report.found) == 31
    name = sorted(report.found)[5]
    for part in ("codes", "scales"):
        copy = tmp_path / f"{part}.mlirb"
        shutil.copy(mlirb, copy)
        blob = getattr(report.found[name], part)
        with open(copy, "r+b") as fh:
            fh.seek(blob.start + blob.size // 2)
            byte = fh.read(1)
            fh.seek(blob.start + blob.size // 2)
            fh.write(bytes([byte[0] ^ 0x01]))
        bad = check(copy)
        assert not bad.ok and bad.missing == [name], part
        assert name in bad.checks()[0][2]


def test_the_quantization_red_arms_must_fail(built, release, monkeypatch):
    """A gate whose reference could not see a misread layout fails: the red arms read the codes and
    scales correctly here (the arm disabled), so they pass the bar, and the gate must say so."""
    import clef_flash.gate.backbone as gb
    from clef_flash.gate.backbone import BackboneVerifyConfig, verify_backbone

    real = gb._dequantized  # what both reads take, the whole matrix and its row blocks
    monkeypatch.setattr(gb, "_dequantized", lambda mlirb, found, scheme, name, red=None: real(mlirb, found, scheme, name, None))
    report = verify_backbone(BackboneVerifyConfig(bundle=built["int8w32"], source=release,
                                                  pins_path=release / "pins.json", long_record=40))
    assert not report.ok
    assert any("red arm scales_shifted" in f and "passes the bar" in f for f in report.failures)
    assert any("red arm codes_transposed" in f for f in report.failures)


# ---------------------------------------------------------------- the plan


@pytest.fixture(scope="module")
def plan8(release, tmp_path_factory):
    """plan-weights on 8 calibration records, budget 2e-4 (the all-int8 tiny decoder misses it)."""
    tmp = tmp_path_factory.mktemp("plan8")
    recipe = _recipe(tmp, "int8", "fp32")
    plan_file = tmp / "plan.json"
    res = runner.invoke(app, ["plan-weights", str(release), "--recipe", str(recipe), "--out", str(plan_file),
                              "--budget-dp", "2e-4", "--records", "8", "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    return plan_file, res.stdout


def test_plan_weights_chooses_a_minimal_set_and_the_build_takes_it(release, plan8, tmp_path):
    """On a budget the all-int8 model misses, the plan keeps the fewest layers fp16 that meet it, the
    chosen set less its most sensitive layer misses it (the proof), and a build from the plan keeps
    exactly those layers fp16 and names the plan; a plan for another scheme or release is refused."""
    from clef_flash.backbone.plan import WeightPlan

    plan_file = tmp_path / "plan.json"
    shutil.copyfile(plan8[0], plan_file)
    plan = WeightPlan.model_validate_json(plan_file.read_text())
    assert json.loads(plan8[1])["chosen"] == plan.chosen
    assert sorted(plan.ranking) == [0, 1, 2, 3] and len(plan.layers) == 4
    assert not any(t.fp16_layers == [] and t.passes for t in plan.trials)  # all int8 misses 2e-4
    assert 1 <= len(plan.chosen) < 4 and plan.met and plan.minimal
    chosen = next(t for t in plan.trials if t.fp16_layers == plan.chosen)
    assert chosen.passes and chosen.max_abs_dp <= 2e-4
    assert plan.proof is not None and not plan.proof.passes
    assert plan.proof.fp16_layers == sorted(plan.ranking[1:len(plan.chosen)])
    assert plan.bytes["all_compressed"] < plan.bytes["chosen"] < plan.bytes["fp16"]
    # the default ranking is by each layer's first-order estimate (one reverse sweep), on the CPU here
    assert plan.ranked_by == "first-order" and plan.device == "cpu" and plan.kendall_tau is None
    estimated = {entry.layer: entry.estimated_dp for entry in plan.layers}
    assert [estimated[i] for i in plan.ranking] == sorted(estimated.values(), reverse=True)
    assert all(entry.alone_max_abs_dp is None for entry in plan.layers)

    from_plan = _recipe(tmp_path, "int8", "fp32", extra=f'plan = "{plan_file.name}"\n')
    res = runner.invoke(app, ["build", str(from_plan), "--source", str(release), "--out", str(tmp_path / "b"),
                              "--no-verify", "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    c = json.loads(res.stdout)["export"]["compression"]
    assert c["fp16_layers"] == plan.chosen and c["plan"]["chosen"] == plan.chosen
    assert c["plan"]["sha256"] == hashlib.sha256(plan_file.read_bytes()).hexdigest()
    assert {e["layer"] for e in c["layers"] if e["weights"] == "fp16"} == set(plan.chosen)

    other_scheme = _recipe(tmp_path, "int4", "fp32", extra=f'plan = "{plan_file.name}"\n')
    res = runner.invoke(app, ["build", str(other_scheme), "--source", str(release), "--out", str(tmp_path / "c"), "--dry-run"])
    assert res.exit_code == 2 and "a plan for int8 per block of 32" in res.output
    data = json.loads(plan_file.read_text())
    data["release"]["files"]["config.json"] = "0" * 64
    (tmp_path / "foreign.json").write_text(json.dumps(data))
    foreign = _recipe(tmp_path, "int8", "fp32", extra='plan = "foreign.json"\n')
    res = runner.invoke(app, ["build", str(foreign), "--source", str(release), "--out", str(tmp_path / "d"), "--dry-run"])
    assert res.exit_code == 3 and "measured on another release" in res.output
    res = runner.invoke(app, ["plan-weights", str(release), "--recipe", str(ROOT / "conversion" / "backbone_pf64_fp16.toml"),
                              "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "compressed backbone recipe" in res.output
    assert not (tmp_path / "x.json").exists()


def _edit_plan(data: dict, what: str) -> dict:
    """A plan file edited as a hostile tester would (issue 49 item 1, issue 48 item 2)."""
    chosen = data["chosen"]
    unmet = {"fp16_layers": [], "max_abs_dp": 0.5, "mean_abs_dp": 0.1, "passes": False}
    edits = {
        "met false": lambda d: d.update(met=False),
        "chosen -1": lambda d: d.update(chosen=[-1]),
        "chosen twice": lambda d: d.update(chosen=chosen + chosen[:1]),
        "a layer the decoder lacks": lambda d: d.update(chosen=[7]),
        "ranking twice": lambda d: d.update(ranking=d["ranking"][:-1] + d["ranking"][:1]),
        "budget edited": lambda d: d.update(budget_dp=1e-12),
        "budget zero": lambda d: d.update(budget_dp=0),
        "trials removed": lambda d: d.update(trials=[]),
        # an honest plan that did not meet its budget: its chosen set's trial misses
        "unmet": lambda d: d.update(trials=[unmet], chosen=[], met=False, proof=None, minimal=True),
    }
    edits[what](data)
    return data


@pytest.mark.parametrize("what, code, says", [
    ("met false", 3, "met = False disagrees with the trials"),
    ("chosen -1", 2, "invalid weight plan at chosen.0"),
    ("chosen twice", 2, "chosen names a layer twice"),
    ("a layer the decoder lacks", 2, "chosen keeps layer 7, which the ranking lacks"),
    ("ranking twice", 2, "is not the measured layers"),
    ("budget edited", 3, "but passes = True"),
    ("budget zero", 2, "invalid weight plan at budget_dp"),
    ("trials removed", 3, "met = True disagrees with the trials"),
    ("unmet", 4, "did not meet its budget"),
])
def test_a_recipes_plan_is_checked_against_itself_before_any_work(release, plan8, tmp_path, what, code, says):
    """A plan a recipe names is checked as strictly as a shipped one, by ``build --dry-run`` too: its
    layers exist once each, its trials back its choice (an edited file: exit 3), it met its budget
    (exit 4); nothing is written."""
    data = _edit_plan(json.loads(plan8[0].read_text()), what)
    (tmp_path / "edited.json").write_text(json.dumps(data))
    recipe = _recipe(tmp_path, "int8", "fp32", extra='plan = "edited.json"\n')
    for extra in (["--dry-run"], []):
        res = runner.invoke(app, ["build", str(recipe), "--source", str(release), "--out", str(tmp_path / "b"), *extra])
        assert res.exit_code == code and "edited.json: " in res.output and says in res.output, (extra, res.output[-2000:])
        assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


@pytest.mark.parametrize("layers, says", [("[1, 1]", "names a layer twice"), ("[true]", "valid integer"),
                                          ("true", "valid tuple"), ("[1.0]", "valid integer")])
def test_fp16_layers_are_layer_numbers_once_each(tmp_path, layers, says):
    recipe = _recipe(tmp_path, "int8", "fp32", extra=f"fp16_layers = {layers}\n")
    res = runner.invoke(app, ["build", str(recipe), "--source", str(tmp_path), "--dry-run"])
    assert res.exit_code == 2 and recipe.name in res.output and says in res.output, res.output[-2000:]


def test_auto_build_chooses_what_plan_weights_chooses_and_ships_the_plan(release, plan8, tmp_path):
    """fp16_layers = "auto": the build runs the planner (the recipe's budget and records) and keeps the
    layers plan-weights chooses on the same records; the plan ships in the bundle with its sha256 in the
    manifest and the record, the gate passes, and verify fails naming the plan when it is edited or
    removed. An author's file the tool would not run is refused before any work."""
    from clef_flash.backbone.plan import PLAN_FILE, WeightPlan

    want = WeightPlan.model_validate_json(plan8[0].read_text())
    recipe = _recipe(tmp_path, "int8", "fp32", extra='fp16_layers = "auto"\nplan_budget_dp = 2e-4\nplan_records = 8\n')
    res = runner.invoke(app, ["build", str(recipe), "--source", str(release), "--out", str(tmp_path / "d"), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    assert json.loads(res.stdout)["fp16_layers"] == "auto" and "chosen at build time" in json.loads(res.stdout)["plan"]
    res = runner.invoke(app, ["build", str(recipe), "--source", str(release), "--out", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    out = json.loads(res.stdout)
    bundle = tmp_path / "b" / out["name"]
    streamed = list((tmp_path / "b").rglob("main.mlirb"))  # written by the streamed save: data, not a program
    assert streamed and all(f.stat().st_mode & 0o111 == 0 for f in streamed), [oct(f.stat().st_mode) for f in streamed]
    # the planner's progress in the worker reaches the build's log (issue 49 item 4)
    assert "plan: each layer's own error and first-order effect, last to first (layers): 4/4 in" in res.stderr
    shipped = WeightPlan.model_validate_json((bundle / PLAN_FILE).read_text())
    c = out["export"]["compression"]
    assert shipped.chosen == want.chosen and shipped.ranking == want.ranking and len(want.chosen) >= 1
    assert [t.max_abs_dp for t in shipped.trials] == [t.max_abs_dp for t in want.trials]
    assert c["fp16_layers"] == want.chosen and c["plan"]["shipped"] and c["plan"]["file"] == PLAN_FILE
    digest = hashlib.sha256((bundle / PLAN_FILE).read_bytes()).hexdigest()
    assert c["plan"]["sha256"] == digest
    record = json.loads((bundle / "build-record.json").read_text())
    assert record["outputs"][PLAN_FILE] == digest
    assert {e["layer"] for e in c["layers"] if e["weights"] == "fp16"} == set(want.chosen)

    for name, edit in (("edited", lambda f: f.write_text(f.read_text().replace('"chosen": [', '"chosen": [0, ', 1))),
                       ("removed", lambda f: f.unlink())):
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        edit(copy / PLAN_FILE)
        res = runner.invoke(app, ["verify", str(copy), "--source", str(release)])
        assert res.exit_code == 3 and PLAN_FILE in res.output, (name, res.output[-2000:])

    pins = json.loads((release / "pins.json").read_text())
    untrusted = tmp_path / "untrusted-pins.json"
    untrusted.write_text(json.dumps({**pins, "files": {**pins["files"], "joint_schema_model.py": "0" * 64}}))
    res = runner.invoke(app, ["build", str(recipe), "--source", str(release), "--pins", str(untrusted),
                              "--out", str(tmp_path / "h"), "--dry-run"])
    assert res.exit_code == 3 and "refusing to execute it" in res.output, res.output[-2000:]


def test_release_and_check_release_through_a_compressed_backbone(release, tmp_path, monkeypatch):
    """`release` of the head and an int8 backbone (fp32 compute; each gated), then tokenizer -> the
    dist's int8 asset -> its head asset, against the author's systemone: the quantization's cost end
    to end, measured against the published port's bar (0.02); the model card states the precision,
    the layers kept fp16 and both gate figures."""
    import sys

    from clef_flash.release.card import model_card, read_dist

    from .conftest import TINY_RECIPE

    recipe = _recipe(tmp_path, "int8", "fp32", chunk=64, context=1024, extra="fp16_layers = [3]\n")
    monkeypatch.setenv("PATH", "/usr/bin:/bin:" + str(Path(sys.executable).parent))  # no xcrun: AOT skipped
    dist = tmp_path / "dist"
    res = runner.invoke(app, ["release", str(TINY_RECIPE), str(recipe), "--source", str(release), "--dist", str(dist), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    head, bb = json.loads(res.stdout)["bundles"]
    lines = (ROOT / "conversion" / "requests.jsonl").read_text().splitlines()[:6]
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    res = runner.invoke(app, ["check-release", str(release), "--bundle", str(dist / head), "--backbone", str(dist / bb),
                              "--requests", str(tmp_path / "req.jsonl"), "--transcript", str(tmp_path / "t.json"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["bar"] == 0.02 and s["mean_bar"] == 0.002 and s["disagreements"] == 0
    assert s["backbone"]["weights"] == "int8"
    assert 1e-5 < s["max_abs_dp"] < 0.02  # more than the fp16 backbone's exactness: the quantization, measured
    card = model_card(read_dist(dist), json.loads((tmp_path / "t.json").read_text()))
    assert "Precision: weights int8 (symmetric, per block of 32" in card and "kept fp16: layers [3]" in card
    assert "The quantization's own cost, the asset against the uncompressed release: relative max |d|" in card
    assert "| backbone weights | int8 |" in card
    assert "Experimental" not in card


def test_weight_plan_schema_is_in_sync():
    from clef_flash.backbone.plan import json_schema

    checked_in = json.loads((ROOT / "manifests" / "weight-plan.schema.json").read_text())
    assert checked_in == json_schema(), "run `clef-export schema --kind weight-plan > manifests/weight-plan.schema.json`"


def test_plan_problems_names_what_a_plan_does_not_back(plan8):
    """The plan-weights output proves its choice (no problems); each broken field is named: a chosen
    set without its passing trial, a proof trial that met the budget, a verdict that is not its figure."""
    from clef_flash.backbone.plan import WeightPlan, plan_problems

    plan = WeightPlan.model_validate_json(plan8[0].read_text())
    assert plan.chosen and plan_problems(plan) == []
    other = plan.model_copy(update={"chosen": sorted(plan.ranking[1:len(plan.chosen) + 1])})
    assert any("no trial of the chosen set" in p for p in plan_problems(other))
    proof = plan.proof.model_copy(update={"max_abs_dp": plan.budget_dp / 2, "passes": True})
    loose = plan.model_copy(update={"proof": proof})
    assert any(p.startswith("not minimal") for p in plan_problems(loose))
    assert not any(p.startswith("not minimal") for p in plan_problems(loose, minimal=False))
    lying = plan.model_copy(update={"trials": [t.model_copy(update={"passes": True}) for t in plan.trials]})
    assert any("but passes = True" in p for p in plan_problems(lying))
    assert any("without a proof trial" in p for p in plan_problems(plan.model_copy(update={"proof": None, "minimal": True})))


def test_a_trial_from_its_first_compressed_layer_is_the_whole_pass(release, monkeypatch):
    """plan-weights' trials start at their first compressed layer, given the uncompressed pass's
    layer outputs: the rows are the whole pass's bit for bit, and no weight of an earlier layer is
    read. Started one layer late (the stored outputs one layer off) the rows differ."""
    from clef_flash.backbone import reference
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.engine.quantize import Scheme
    from clef_flash.backbone.contract import compressed_names
    from clef_flash.backbone.estimate import forward_pass
    from clef_flash.backbone.sensitivity import Dequantizer, LayerOutputs, rows_with
    from clef_flash.engine.streamed_weights import locate

    text = read_text_config(release)
    scheme = Scheme(8, 32)
    names = compressed_names(weight_names(text), scheme)
    infos = locate(release, weight_names(text))
    rng = np.random.default_rng(0)
    records = [rng.integers(0, text.vocab_size, n) for n in (19, 33)]
    loaded: list[str] = []
    load = reference.StreamedTextModel._load
    monkeypatch.setattr(reference.StreamedTextModel, "_load", lambda self, mod, prefix, *a: (loaded.append(prefix), load(self, mod, prefix, *a))[1])
    ref = reference.StreamedTextModel(release)
    with LayerOutputs() as outputs:
        base = forward_pass(ref, records, outputs)
        assert sorted(p.name for p in outputs.path.iterdir()) == sorted(f"{i}-{r}.npy" for i in range(4) for r in range(2))
        deq = Dequantizer(release, infos, scheme, names, False)
        wholes = {}
        for layers in ({2}, {2, 3}):
            whole = wholes[len(layers)] = rows_with(ref, records, deq, layers)
            loaded.clear()
            started = rows_with(ref, records, deq, layers, outputs=outputs)
            assert all(np.array_equal(a, b) for a, b in zip(whole, started, strict=True)), layers
            assert sorted(set(loaded)) == ["layers.2.", "layers.3."], loaded
            assert not all(np.array_equal(a, b) for a, b in zip(whole, base, strict=True))  # layer 2 compressed moves the rows
        late = outputs.entering
        monkeypatch.setattr(outputs, "entering", lambda layer, record: late(layer + 1, record))
        off = rows_with(ref, records, deq, {2}, outputs=outputs)
        assert not all(np.array_equal(a, b) for a, b in zip(wholes[1], off, strict=True))
    assert not outputs.path.exists()  # the stored outputs go with the block


# ---------------------------------------------------------------- bytes made ahead of the save


def _one_tensor(tmp: Path, rows: int = 96, cols: int = 64, bad: bool = False, names=("m.weight",)) -> tuple[Path, dict]:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    ws = {n: torch.randn(rows, cols, generator=g) * 0.02 for n in names}
    if bad:
        ws[names[0]][rows - 1, 5] = float("inf")
    save_file({n: w.to(torch.bfloat16) for n, w in ws.items()}, str(tmp / "model.safetensors"))
    return tmp, {n: (rows, cols) for n in names}


def _made_here(w, name: str, part: str) -> bytes:
    return b"".join(bytes(c) for c in w._make(name, part, 1 << 20))


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_made_ahead_are_the_bytes_made_at_the_save(tmp_path, bits):
    """The process that makes a compressed tensor's codes and scales while the graph is traced
    (``ahead``) writes the bytes the save would make itself, and the save reads them back from the
    scratch file, in the order it asks (here: another than the process's own), in blocks smaller
    than the process's; each slot is freed once read (a hole: zeros)."""
    from clef_flash.engine.codes_ahead import start
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import load_weights

    folder, wanted = _one_tensor(tmp_path, rows=300, cols=128)
    sch = Scheme(bits, 32)
    here = load_weights(folder, wanted, tmp_path, streamed=True, scheme=sch, compressed=["m.weight"])
    want = {p: _made_here(here, "m.weight", p) for p in ("scales", "codes")}
    here.close()
    w = load_weights(folder, wanted, tmp_path, streamed=True, scheme=sch, compressed=["m.weight"])
    said: list[str] = []
    try:
        assert start(w, said.append)
        w.ahead_order(["m.weight"])
        assert said and "made ahead when the save began" in said[0]
        made_here: list = []
        w._make = lambda *a: (made_here.append(a), iter(()))[1]  # anything made here would be empty
        got = {p: b"".join(bytes(c) for c in w.stream("m.weight", p, block_bytes=1000)) for p in ("scales", "codes")}
        assert got == want and not made_here, bits
        for p in ("scales", "codes"):
            off, size = w._slots[("m.weight", p)]
            assert not os.pread(w._fd, size, off).strip(b"\0"), "a slot read is punched out"
    finally:
        w.close()


def test_a_process_that_stops_leaves_the_rest_to_the_save(tmp_path):
    """Where the process stopped (an error, a kill), the save makes the rest itself from the byte
    it reached: the same bytes. A tensor whose scale fp16 cannot hold stops the process, and the
    save then fails on it by name, as it would without the process."""
    import threading

    from clef_flash.engine.codes_ahead import Ahead, start
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import load_weights
    from clef_flash.errors import IntegrityError

    folder, wanted = _one_tensor(tmp_path, rows=300, cols=128)
    w = load_weights(folder, wanted, tmp_path, streamed=True, scheme=Scheme(8, 32), compressed=["m.weight"])
    try:
        want = _made_here(w, "m.weight", "codes")
        off, size = w._slots[("m.weight", "codes")]
        reached = 5000  # what the process had made and said when it stopped
        os.pwrite(w._fd, want[:reached], off)
        a = Ahead.__new__(Ahead)  # its state after the process stopped, without the process
        a.w, a.made, a.stopped, a.finished, a._cond = w, {("m.weight", "codes"): reached}, "killed", False, threading.Condition()
        got = b"".join(bytes(c) for c in a.read("m.weight", "codes", 3000, lambda: w._make("m.weight", "codes", 1024)))
        assert got == want
        a.made = {("m.weight", "codes"): 0}  # nothing made: all made here
        assert b"".join(bytes(c) for c in a.read("m.weight", "codes", 3000, lambda: w._make("m.weight", "codes", 1024))) == want
    finally:
        w.close()

    bad = tmp_path / "bad"
    bad.mkdir()
    folder, wanted = _one_tensor(bad, rows=300, cols=128, bad=True)
    w = load_weights(folder, wanted, bad, streamed=True, scheme=Scheme(8, 32), compressed=["m.weight"])
    try:
        assert start(w)
        with pytest.raises(IntegrityError, match=r"model.safetensors: m.weight has values a int8 scale cannot hold"):
            for p in ("scales", "codes"):
                for _ in w.stream("m.weight", p):
                    pass
        assert w._ahead.stopped and "IntegrityError" in w._ahead.stopped
    finally:
        w.close()


def test_no_bytes_made_ahead_where_the_disk_cannot_hold_them(tmp_path, monkeypatch):
    """The scratch file keeps what the process made until the save reads it; where the free disk
    could not hold that beside the asset, nothing is started and the save makes every byte."""
    import shutil as sh

    from clef_flash.engine.codes_ahead import start
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import load_weights

    folder, wanted = _one_tensor(tmp_path)
    w = load_weights(folder, wanted, tmp_path, streamed=True, scheme=Scheme(8, 32), compressed=["m.weight"])
    need = sum(size for _, size in w._slots.values())
    real = sh.disk_usage
    said: list[str] = []
    try:
        monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=2 * need + (1 << 30) - 1))
        assert not start(w, said.append) and w._ahead is None
        assert said and "made while the asset is written" in said[0]
        monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=2 * need + (1 << 30)))
        assert start(w, said.append) and w._ahead is not None
    finally:
        w.close()


def test_a_compressed_build_of_a_tampered_shard_fails_on_its_pin(release, tmp_path):
    """A compressed build's shards are hashed by the process that reads them for their codes: a shard
    one bit away from its pin still fails the build, named, after the export, and nothing lands."""
    import shutil

    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    shard = sorted(rel.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    res = runner.invoke(app, ["build", str(_recipe(tmp_path, "int8", "fp16")), "--source", str(rel), "--out", str(out), "--no-verify"])
    assert res.exit_code == 3 and f"{shard.name}: sha256 mismatch" in res.output, res.output[-2000:]
    assert "hashed from the reads that made the codes" in res.output
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.endswith(".lock")]


def test_the_process_reads_the_shards_in_the_saves_order_and_hashes_them(tmp_path):
    """The process reads each shard once, start to end (``sweep``): the shard holding the tensor the
    save asks for first comes first (its order arrives on stdin), a shard's tensors in file order, a
    shard with nothing compressed last. Every shard asked for is hashed from that read, and the
    digests are the files' sha256."""
    import json as js
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    from clef_flash.engine.codes_ahead import job_of
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import load_weights

    g = torch.Generator().manual_seed(5)
    shards = {"s1.safetensors": ("a.weight", "b.weight"), "s2.safetensors": ("c.weight",), "s3.safetensors": ("n.weight",)}
    for shard, names in shards.items():
        save_file({n: (torch.randn(96, 64, generator=g) * 0.02).to(torch.bfloat16) for n in names}, str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(js.dumps({"weight_map": {n: s for s, ns in shards.items() for n in ns}}))
    wanted = {n: (96, 64) for ns in shards.values() for n in ns}
    names = ("a.weight", "b.weight", "c.weight")
    w = load_weights(tmp_path, wanted, tmp_path, streamed=True, scheme=Scheme(8, 32), compressed=list(names))
    try:
        job = job_of(w, ["c.weight", "b.weight", "a.weight"], hashed=list(shards))
        res = subprocess.run([sys.executable, "-m", "clef_flash.engine.codes_ahead", js.dumps(job)], input="[2, 0, 1]\n",
                             capture_output=True, text=True, pass_fds=(w._fd,), timeout=120, check=True)
        lines = [ln for ln in res.stdout.split("\n") if ln]
        events = [("sha", js.loads(ln[4:])[0]) if ln.startswith("sha ") else ("made", int(ln.split()[0]))
                  for ln in lines if ln.startswith("sha ") or ln.split()[0].isdigit()]
        order = list(dict.fromkeys(events))
        # a (task 2) is asked first: its shard s1, a then b (file order), then s2 (c), then s3 (nothing compressed)
        assert order == [("made", 2), ("made", 1), ("sha", "s1.safetensors"), ("made", 0), ("sha", "s2.safetensors"),
                         ("sha", "s3.safetensors")] and lines[-1] == "done", res.stdout
        for ln in lines:
            if ln.startswith("sha "):
                shard, digest = js.loads(ln[4:])
                assert digest == hashlib.sha256((tmp_path / shard).read_bytes()).hexdigest(), shard
        for n in names:
            for p in ("scales", "codes"):
                off, size = w._slots[(n, p)]
                assert os.pread(w._fd, size, off) == _made_here(w, n, p), (n, p)
    finally:
        w.close()


def test_the_stitched_trace_writes_the_full_traces_asset(release, tmp_path):
    """The build's default trace (one layer of each group, copied for the rest: ``stitch``) gives
    the tiny release's int8 asset byte for byte what tracing every layer gives."""
    from clef_flash.backbone.contract import read_text_config, weight_names
    from clef_flash.backbone.export import export_job
    from clef_flash.engine.quantize import Scheme
    from clef_flash.backbone.contract import compressed_names

    cfg = read_text_config(release)
    names = compressed_names(weight_names(cfg), Scheme(8, 32), [1])
    digests, said = {}, {}
    for stitched in (True, False):
        d = tmp_path / str(stitched)
        d.mkdir()
        said[stitched] = []
        job = {"source": str(release), "asset_dir": str(d / "a.aimodel"), "text_config": cfg.as_dict(), "chunk": 16,
               "context": 64, "image_rows": 16, "compute": "fp16", "stitched": stitched,
               "description": {"author": "t", "license": "t", "description": "t"},
               "quantization": {"bits": 8, "block": 32, "tensors": names}}
        export_job(job, said[stitched].append)
        digests[stitched] = hashlib.sha256((d / "a.aimodel" / "main.mlirb").read_bytes()).hexdigest()
    assert any(s.startswith("traced 3 layers of 4") for s in said[True]) and any("copied them to 4 layers" in s for s in said[True])
    assert any(s.startswith("traced 4 layers") for s in said[False])
    assert digests[True] == digests[False]


def _copy_release(release: Path, to: Path, edit) -> Path:
    """The tiny release copied, edited, and pinned again (a release that disagrees with itself)."""
    from clef_flash.sources.pinning import pin_local

    copy = to / "tiny_release"
    shutil.copytree(release, copy)
    edit(copy)
    pin_local(copy, overwrite=True)
    return copy


def _set_layers(folder: Path, n: int) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = n
    (folder / "config.json").write_text(json.dumps(cfg))


def _add_layer(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = folder / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.language_model.layers.4.mlp.gate_proj.weight"] = tensors["model.language_model.layers.3.mlp.gate_proj.weight"].clone()
    save_file(tensors, shard)


@pytest.mark.parametrize("recipe_of, edit, says", [
    ("int8", lambda f: _set_layers(f, 5), "config.json: num_hidden_layers 5 beside 4 layer_types"),
    ("int8", lambda f: _set_layers(f, 3), "config.json: num_hidden_layers 3 beside 4 layer_types"),
    ("vision", lambda f: _set_layers(f, 5), "config.json: num_hidden_layers 5 beside 4 layer_types"),
    ("int8", _add_layer, "config.json: names 4 decoder layers; the shards carry model.language_model.layers.4."),
])
def test_a_release_that_disagrees_with_itself_is_refused_before_work(release, tmp_path, recipe_of, edit, says):
    """config.json's layer count against its layer_types, and against the layers the shards carry
    (issue 49 item 2): refused by the dry run and the build alike (exit 3, naming config.json)."""
    copy = _copy_release(release, tmp_path, edit)
    recipe = ROOT / "conversion" / "vision_fp16w32.toml" if recipe_of == "vision" else _recipe(tmp_path, "int8", "fp32")
    for extra in (["--dry-run"], []):
        res = runner.invoke(app, ["build", str(recipe), "--source", str(copy), "--out", str(tmp_path / "b"), *extra])
        assert res.exit_code == 3 and says in res.output, (extra, res.output[-2000:])
        assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_a_truncated_shard_is_neither_pinned_nor_built(release, tmp_path):
    """A shard short of its header's tensors (issue 49 item 3): `pin` refuses it; a build from pins
    made before the cut refuses it before any work (its hash is checked beside the export, its
    extent first), naming the shard."""
    copy = tmp_path / "tiny_release"
    shutil.copytree(release, copy)
    shard = copy / "model.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 10_000)
    res = runner.invoke(app, ["pin", str(copy), "--overwrite"])
    assert res.exit_code == 3 and "model.safetensors: truncated" in res.output, res.output[-2000:]
    recipe = _recipe(tmp_path, "int8", "fp32")
    res = runner.invoke(app, ["build", str(recipe), "--source", str(copy), "--out", str(tmp_path / "b")])
    assert res.exit_code == 3 and "model.safetensors: truncated" in res.output, res.output[-2000:]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    with open(shard, "ab") as fh:  # padded instead: the same file longer than its tensors
        fh.write(b"\0" * 20_000)
    res = runner.invoke(app, ["pin", str(copy), "--overwrite"])
    assert res.exit_code == 3 and "longer than its tensors" in res.output, res.output[-2000:]


def test_a_plan_written_under_verify_and_a_missing_plan_say_where_a_plan_goes(tmp_path):
    """`plan = ...` appended after `[verify]` is that section's key in TOML: the error says so; a plan
    not found says it is read from the recipe's folder (issue 49 item 4)."""
    recipe = _recipe(tmp_path, "int8", "fp32", extra='[verify]\nenabled = true\nplan = "plan.json"\n')
    res = runner.invoke(app, ["build", str(recipe), "--source", str(tmp_path), "--dry-run"])
    assert res.exit_code == 2 and "verify.plan" in res.output and "move it above [verify]" in res.output, res.output
    from clef_flash.backbone.plan import load_plan
    from clef_flash.errors import UsageError

    with pytest.raises(UsageError, match="read from the recipe's own folder"):
        load_plan(tmp_path / "nowhere.json")


def test_a_release_folder_without_pins_is_told_to_pin_it(release, tmp_path):
    """A release folder with no pins.json is checked against the published pins (a download of
    clef-flash needs none of its own); where they do not fit, the error says the folder has no pins
    and how to make them (issue 48 item 4), before any work."""
    copy = tmp_path / "tiny_release"
    shutil.copytree(release, copy)
    (copy / "pins.json").unlink()
    for cmd in (["plan-weights", str(copy), "--recipe", str(ROOT / "conversion" / "backbone_pf64_int8.toml"),
                 "--out", str(tmp_path / "plan.json")],
                ["build", str(ROOT / "conversion" / "backbone_pf64_int8.toml"), "--source", str(copy), "--dry-run"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 3 and f"{copy} has no pins.json" in res.output and f"clef-export pin {copy}" in res.output, \
            res.output[-2000:]
    assert not (tmp_path / "plan.json").exists()
