"""The Core ML package (recipe format ``mlpackage``) at the tiny configuration: built, read back,
checked against the author's weights, byte-reproducible; the gate's macOS path through a stand-in
predictor (Core ML cannot run on Linux)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from clef_flash.head import mlpackage
from clef_flash.cli import app
from clef_flash.errors import IntegrityError, NumericError
from clef_flash.gate.head import VerifyConfig, verify_bundle
from clef_flash.head.backends import load_manifest
from clef_flash.head.mlpackage import Manifest as MlpackageManifest

from .conftest import ROOT, build_bundle, rerecord

RECIPE = ROOT / "conversion" / "head_bucket_fp16w32_mlpackage.toml"
SCHEMA = ROOT / "manifests" / "metadata-mlpackage.schema.json"


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory, tiny_source) -> Path:
    return build_bundle(tiny_source, tmp_path_factory.mktemp("tiny-mlpackage"), recipe=RECIPE, verify=True)


@pytest.fixture()
def package_copy(tmp_path, tiny_package) -> Path:
    dst = tmp_path / "out" / tiny_package.name
    shutil.copytree(tiny_package, dst)
    return dst


def _asset(bundle: Path) -> Path:
    return bundle / json.loads((bundle / "metadata.json").read_text())["assets"]["main"]


def test_manifest_names_the_format_and_keeps_the_head_shape(tiny_package, tiny_bundle):
    data = json.loads((tiny_package / "metadata.json").read_text())
    jsonschema.validate(data, json.loads(SCHEMA.read_text()))
    manifest = load_manifest((tiny_package / "metadata.json").read_bytes())
    assert isinstance(manifest, MlpackageManifest) and manifest.format == "mlpackage"
    assert manifest.assets == {"main": "clef_flash_head_bucket_fp16w32_mlpackage.mlpackage"}
    # the same decision-head description as the .aimodel bundle built from the same source
    aimodel = json.loads((tiny_bundle / "metadata.json").read_text())
    assert data["head"] == aimodel["head"] and data["kind"] == aimodel["kind"] == "decision-head"
    assert data["export"]["weight_storage"] == "fp16" and data["export"]["compute_precision"] == "fp32"
    assert "cannot run Core ML predictions on Linux" in data["export"]["predictions"]
    record = json.loads((tiny_package / "build-record.json").read_text())
    assert record["verify"]["ok"] and all(record["verify"]["checks"].values()) and record["verify"]["notes"]


def test_package_read_back_functions_inputs_outputs(tiny_package):
    info = mlpackage.read_package(_asset(tiny_package))
    assert [f.name for f in info.functions] == ["t512", "t1024", "t2048", "t4096"]
    assert info.default_function == "t512" and info.specification_version >= 9
    for fn in info.functions:
        t = int(fn.name[1:])
        assert [i[0] for i in fn.inputs] == ["hidden", "key_valid", "q_avg", "o_avg", "g_avg", "lexical",
                                             "member", "type_ids", "q_valid", "o_valid"]
        shapes = {n: s for n, s, _ in fn.inputs}
        dtypes = {n: d for n, _, d in fn.inputs}
        assert shapes["hidden"] == (t, 64) and shapes["q_avg"] == (16, t) and shapes["member"] == (16, 128)
        assert dtypes["type_ids"] == "i32" and {d for n, d in dtypes.items() if n != "type_ids"} == {"f32"}
        assert fn.outputs == [("logits", (128,), "f32")]
        assert fn.opset == "CoreML8" and fn.ops["constexpr_cast"] > 0 and not fn.fp16_outputs


def test_weights_stored_fp16_once_for_all_functions(tiny_package, tiny_source):
    from safetensors import safe_open

    with safe_open(str(tiny_source / "joint_head.safetensors"), "pt") as f:
        params = sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                     else int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    info = mlpackage.read_package(_asset(tiny_package))
    # fp16: 2 bytes a parameter, once for four functions (plus 64-byte blob headers); fp32 would be 4
    assert 2 * params <= info.weight_bytes < 2.3 * params
    shared = [b for b in info.blobs.values() if b.dtype == "FLOAT16"]
    assert shared and all(b.functions == {"t512", "t1024", "t2048", "t4096"} for b in shared)


def test_fp16_pass_keeps_inexact_constants_fp32():
    ct = mlpackage.import_toolchain()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    exact = np.arange(64, dtype=np.float32).reshape(8, 8)
    inexact = np.full((8, 8), 0.1, dtype=np.float32)  # 0.1 is not an fp16 value

    @mb.program(input_specs=[mb.TensorSpec(shape=(8, 8))], opset_version=ct.target.macOS15)
    def prog(x):
        return mb.add(x=mb.matmul(x=x, y=exact), y=inexact)

    PASS_REGISTRY[mlpackage.register_fp16_pass()](prog)
    ops = {op.op_type: op for op in prog.functions["main"].operations}
    assert "constexpr_cast" in ops and ops["constexpr_cast"].source_val.val.dtype == np.float16
    consts = [op.outputs[0].val for op in prog.functions["main"].operations if op.op_type == "const"]
    assert any(isinstance(v, np.ndarray) and v.dtype == np.float32 and np.allclose(v, 0.1) for v in consts)


def test_weight_check_fails_on_a_changed_author_weight(tiny_package, tiny_source):
    from clef_flash.sources.author import load_head
    from clef_flash.sources.pins import load_pins

    _, config, head = load_head(tiny_source, load_pins(tiny_source / "pins.json"), torch.float32)
    params = {k: v.numpy() for k, v in head.state_dict().items()}
    info = mlpackage.read_package(_asset(tiny_package))
    assert all(ok for _, ok, _ in mlpackage.check_weights(info, "fp16w32", params))
    # a matrix large enough (>= 1024 values) that the stored copy is a large constant nobody owns
    name = next(k for k, v in params.items() if v.ndim == 2 and "in_proj" not in k and v.size >= 1024)
    params[name] = params[name].copy()
    params[name].flat[0] += 0.5
    rows = {n: (ok, d) for n, ok, d in mlpackage.check_weights(info, "fp16w32", params)}
    assert rows["every author weight stored"] == (False, f"missing: ['{name}']")
    ok, detail = rows["no unknown large constants"]
    assert ok is False and detail.startswith("1: FLOAT16 "), detail
    # a wrong hidden size is seen in every function's inputs
    bad = mlpackage.check_package(info, [("t512", 512)], config.hidden_size * 2, "fp16w32", params)
    assert ("t512 inputs", False) in [(n, ok) for n, ok, _ in bad]


def test_verify_exits_3_on_a_tampered_weight_byte(package_copy, tiny_source):
    weight = _asset(package_copy) / mlpackage.WEIGHT_FILE
    data = bytearray(weight.read_bytes())
    data[len(data) // 2] ^= 0x01
    weight.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["verify", str(package_copy), "--source", str(tiny_source),
                                 "--pins", str(tiny_source / "pins.json")])
    assert r.exit_code == 3, r.output
    assert "weight.bin: sha256" in r.output and "differs from the manifest" in r.output
    r = CliRunner().invoke(app, ["verify-artifact", str(package_copy)])
    assert r.exit_code == 3 and "weight.bin" in r.output


def test_verify_exits_4_when_a_stored_weight_differs_from_the_author(package_copy, tiny_source):
    """A weight changed and the manifest re-hashed to match: only the weight check can see it."""
    from clef_flash.digest import sha256_file

    asset = _asset(package_copy)
    info = mlpackage.read_package(asset)
    blob = max(info.blobs.values(), key=lambda b: int(np.prod(b.shape)))
    weight = asset / mlpackage.WEIGHT_FILE
    data = bytearray(weight.read_bytes())
    data[blob.offset + 64 + 2] ^= 0x04  # inside the blob's data, after its 64-byte header
    weight.write_bytes(bytes(data))
    meta = json.loads((package_copy / "metadata.json").read_text())
    meta["export"]["weight_bin"]["sha256"] = sha256_file(weight)
    (package_copy / "metadata.json").write_text(json.dumps(meta))
    r = CliRunner().invoke(app, ["verify", str(package_copy), "--source", str(tiny_source),
                                 "--pins", str(tiny_source / "pins.json")])
    assert r.exit_code == 3 and "metadata.json: sha256 differs from build-record.json" in r.output, r.output
    rerecord(package_copy)
    r = CliRunner().invoke(app, ["verify", str(package_copy), "--source", str(tiny_source),
                                 "--pins", str(tiny_source / "pins.json")])
    assert r.exit_code == 4, r.output
    assert "every author weight stored" in r.output and "FAIL" in r.output


def _graph_predictor(source: Path, shift: float = 0.0):
    """Stands in for Core ML on Linux: the same ClefHeadGraph, fp16 weights, fp32 math."""
    from clef_flash.sources.author import load_head
    from clef_flash.head.contract import INPUT_ORDER
    from clef_flash.head.graph import ClefHeadGraph, cast_weights
    from clef_flash.sources.pins import load_pins

    _, _, head = load_head(source, load_pins(source / "pins.json"), torch.float16)
    graph = ClefHeadGraph(cast_weights(head, "fp16w32")).eval()
    calls = []

    def predictor(package, function):
        def run(arrays):
            calls.append(function)
            with torch.inference_mode():
                out = graph(*[torch.from_numpy(np.ascontiguousarray(arrays[k])) for k in INPUT_ORDER]).numpy()
            out = out.copy()
            out[0] += shift
            return out
        return run

    return predictor, calls


def test_macos_path_runs_every_function_against_the_author(monkeypatch, tiny_package, tiny_source):
    predictor, calls = _graph_predictor(tiny_source)
    monkeypatch.setattr(mlpackage, "cannot_run", lambda: None)
    monkeypatch.setattr(mlpackage, "predictor", predictor)
    cfg = VerifyConfig(bundle=tiny_package, source=tiny_source, pins_path=tiny_source / "pins.json", records=2)
    report = verify_bundle(cfg)
    assert report.ok, report.failures
    assert not report.notes and [r.function for r in report.results] == ["t512", "t1024", "t2048", "t4096"]
    assert sorted(set(calls)) == ["t1024", "t2048", "t4096", "t512"]
    assert max(r.max_abs_dp for r in report.results) < 1e-5


def test_macos_path_fails_on_a_wrong_logit(monkeypatch, tiny_package, tiny_source):
    predictor, _ = _graph_predictor(tiny_source, shift=1e-2)
    monkeypatch.setattr(mlpackage, "cannot_run", lambda: None)
    monkeypatch.setattr(mlpackage, "predictor", predictor)
    cfg = VerifyConfig(bundle=tiny_package, source=tiny_source, pins_path=tiny_source / "pins.json", records=1)
    report = verify_bundle(cfg)
    assert not report.ok and any("max |d logit|" in f for f in report.failures)
    with pytest.raises(NumericError):
        report.raise_for_failures()


def test_inspect_reads_the_spec_and_leaves_the_package_untouched(tiny_package):
    from clef_flash.digest import tree_hash

    before = tree_hash(tiny_package)
    r = CliRunner().invoke(app, ["inspect", str(tiny_package), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["format"] == "mlpackage" and [f["name"] for f in info["functions"]] == ["t512", "t1024", "t2048", "t4096"]
    assert info["functions"][0]["outputs"] == [{"name": "logits", "shape": [128], "dtype": "f32"}]
    assert tree_hash(tiny_package) == before  # reading a package must not rewrite its Manifest.json
    assert CliRunner().invoke(app, ["verify-artifact", str(tiny_package)]).exit_code == 0


def test_cli_refuses_what_does_not_apply_to_a_package(tmp_path, tiny_package, tiny_source):
    src = ["--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"), "--out", str(tmp_path)]
    r = CliRunner().invoke(app, ["build", "--format", "mlpackage", "--aot", *src])
    assert r.exit_code == 2 and "--aot compiles .aimodel" in r.output
    r = CliRunner().invoke(app, ["build", str(ROOT / "conversion" / "head_bucket_fp16w32.toml"), "--format", "mlpackage", *src])
    assert r.exit_code == 2 and "format is aimodel" in r.output
    r = CliRunner().invoke(app, ["aot", str(tiny_package)])
    assert r.exit_code == 2 and "mlpackage bundle" in r.output
    r = CliRunner().invoke(app, ["build", "--format", "coreml", *src])
    assert r.exit_code == 2
    assert not any(tmp_path.iterdir())


def test_second_build_is_byte_identical(tmp_path, tiny_package, tiny_source):
    """Built again in a process of its own with an unlimited stack, through another interpreter
    path, from another working directory: every file of the package is the same."""
    import resource

    from clef_flash.digest import tree_files

    from .test_repro import cli_build, other_interpreter

    again = cli_build(other_interpreter(tmp_path), tiny_source, tmp_path / "again", tmp_path, {"PYTHONHASHSEED": "7"},
                      resource.RLIM_INFINITY, recipe=RECIPE, name=tiny_package.name)
    ours = {k: v for k, v in tree_files(tiny_package).items() if k not in ("build-record.json", "metadata.json")}
    theirs = {k: v for k, v in tree_files(again).items() if k not in ("build-record.json", "metadata.json")}
    assert ours == theirs and any(k.endswith("weight.bin") for k in ours)


def test_one_aten_trace_is_the_two_public_passes_file_for_file(tmp_path, tiny_package, tiny_source, monkeypatch):
    """Each bucket is traced to the ATen dialect once (``engine.lowered.export_aten``, torch's private
    aot-dispatch export) instead of ``torch.export.export`` + ``run_decompositions({})``: the package
    the worker's job writes through the two public passes must be the build's, the weights and the
    manifest byte for byte, the program op for op (the converter's name counters aside: the two
    passes' graph holds torch.export's metadata checks, which take numbers and convert to nothing)."""
    import re

    from coremltools.proto import Model_pb2

    from clef_flash.build.head import export_job
    from clef_flash.digest import tree_files
    from clef_flash.engine import lowered as tracing
    from clef_flash.recipe import load_recipe

    asked: list[int] = []
    monkeypatch.setattr(tracing, "_one_pass_api", lambda: asked.append(1))  # None: the two public passes
    recipe = load_recipe(RECIPE)
    asset = tmp_path / _asset(tiny_package).name
    export_job({"source": str(tiny_source), "pins": str(tiny_source / "pins.json"), "recipe": recipe.model_dump(mode="json"),
                "asset_dir": str(asset)}, lambda m: None)
    assert len(asked) == len(recipe.buckets)  # every bucket's trace went the other way
    ours, theirs = tree_files(_asset(tiny_package)), tree_files(asset)
    program = "Data/com.apple.CoreML/model.mlmodel"
    assert ours.keys() == theirs.keys() and any(k.endswith("weight.bin") for k in ours)
    assert {k: v for k, v in ours.items() if k != program} == {k: v for k, v in theirs.items() if k != program}

    def ops(bundle_asset: Path) -> list[str]:
        spec = Model_pb2.Model()
        spec.ParseFromString((bundle_asset / program).read_bytes())
        return re.sub(r"_\d+(?=_fp16\b|_fp32\b|_int32\b|\b)", "_N", str(spec)).splitlines()

    mine, two = ops(_asset(tiny_package)), ops(asset)
    assert len(mine) > 10_000 and mine == two


def test_missing_model_file_is_an_integrity_error(package_copy):
    (_asset(package_copy) / mlpackage.MODEL_FILE).unlink()
    with pytest.raises(IntegrityError, match="model.mlmodel: missing"):
        mlpackage.read_package(_asset(package_copy))


@pytest.mark.skipif(sys.platform == "darwin", reason="Core ML runs packages on macOS")
def test_check_release_says_it_cannot_run_a_package_here(tmp_path, tiny_package):
    from typer.testing import CliRunner

    from clef_flash.cli import app

    r = CliRunner().invoke(app, ["check-release", str(tmp_path), "--bundle", str(tiny_package)])
    assert r.exit_code == 5 and "cannot run its mlpackage asset on this machine" in r.output, r.output
    assert len(r.stderr.strip().splitlines()) == 1


def _tiny_graph(tiny_source):
    from clef_flash.sources.author import load_head
    from clef_flash.head.graph import ClefHeadGraph, cast_weights
    from clef_flash.sources.pins import load_pins
    from clef_flash.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    _, config, head = load_head(tiny_source, load_pins(tiny_source / "pins.json"), torch.float16)
    return recipe, config, ClefHeadGraph(cast_weights(head, recipe.weights)).eval()


def test_weights_are_shared_as_coremltools_shares_them(tiny_source):
    """The in-memory join's ``share_weights`` groups the functions' constants exactly as
    coremltools' own cross-function deduplication (what ``save_multifunction`` runs) does, and the
    interned fp16 weights are one array in memory for all functions."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    recipe, config, graph = _tiny_graph(tiny_source)
    joined = mlpackage.convert(graph, recipe, config.hidden_size, Path("unused"))
    def groups(prog) -> set[frozenset[tuple[str, str]]]:
        by_id: dict[str, set] = {}
        for fname, fn in prog.functions.items():
            for op in fn.operations:
                if op.op_type == "const" and op.weight_id is not None:
                    by_id.setdefault(op.weight_id, set()).add((fname, op.name))
        return {frozenset(g) for g in by_id.values()}

    prog = joined.program
    shared = mlpackage.share_weights(prog)
    ours = groups(prog)
    for fn in prog.functions.values():  # the same program again, shared by coremltools itself
        for op in fn.operations:
            if op.op_type == "const":
                op._weight_id = None
    PASS_REGISTRY["common::const_deduplication"]._deduplicate_const_across_functions(prog)
    assert shared == len(ours) > 0 and ours == groups(prog)
    # one array per weight across the four functions (interning), e.g. the first decoder layer's
    sources = [op.source_val.val for fn in joined.program.functions.values() for op in fn.operations
               if op.op_type == "constexpr_cast" and op.source_val.val.size >= 1024]
    assert len(sources) >= 4 * 8 and len({id(a) for a in sources}) * 4 == len(sources)
    # and a weight stored as the parameter is the parameter's own memory, not a copy
    views = mlpackage._parameter_views(graph)
    unique = list({id(a): a for a in sources}.values())
    assert sum(any(np.shares_memory(a, v) for v in views) for a in unique) * 2 >= len(unique)


def test_fp16_frontend_writes_the_package_fp32_constants_give(tmp_path, monkeypatch, tiny_source):
    """Weights folded into fp16 storage by the frontend (no fp32 copy) give the same package,
    byte for byte, as the fp32 constants coremltools' own frontend folds them into."""
    import contextlib

    recipe, config, graph = _tiny_graph(tiny_source)
    description = {"author": "test", "version": "0"}
    files = {}
    for arm in ("fp16 storage", "fp32 copies"):
        if arm == "fp32 copies":
            monkeypatch.setattr(mlpackage, "fp16_frontend", contextlib.nullcontext)
        out = tmp_path / arm.replace(" ", "-") / "head.mlpackage"
        out.parent.mkdir()
        mlpackage.save(mlpackage.convert(graph, recipe, config.hidden_size, out), out, description)
        files[arm] = {rel: (out / rel).read_bytes() for rel in (mlpackage.MODEL_FILE, mlpackage.WEIGHT_FILE)}
    assert files["fp16 storage"] == files["fp32 copies"]


def test_fp16_frontend_keeps_every_weight_in_the_parameters_memory(tiny_source):
    """After the frontend (no pass run yet) every weight constant is the parameter's own fp16
    memory seen as fp32, not a 4-byte copy: were the frontend's ``to`` not replaced (an op renamed,
    its arguments spelled differently), the package would stay the same and only memory would grow."""
    from clef_flash.head import contract
    from clef_flash.head.tracing import export_graph

    recipe, config, graph = _tiny_graph(tiny_source)
    ct = mlpackage.import_toolchain()
    ep = export_graph(graph, (recipe.buckets[0],), config.hidden_size, recipe.q_pad, recipe.o_pad).run_decompositions({})
    with mlpackage.fp16_frontend():
        prog = ct.convert(ep, convert_to="milinternal", minimum_deployment_target=ct.target.macOS15,
                          compute_precision=ct.precision.FLOAT32, pass_pipeline=ct.PassPipeline.EMPTY,
                          outputs=[ct.TensorType(name=n) for n in contract.OUTPUT_NAMES])
    views = mlpackage._parameter_views(graph)
    weights = [op.outputs[0].val for op in prog.functions["main"].operations if op.op_type == "const"
               and isinstance(op.outputs[0].val, np.ndarray) and op.outputs[0].val.size >= 1024
               and op.outputs[0].val.dtype == np.float32]
    assert len(weights) >= 8
    assert all(isinstance(w, mlpackage.Fp16AsFp32) and any(np.shares_memory(w, v) for v in views) for w in weights)


def test_fp16_storage_reads_as_fp32_values():
    """What coremltools may do with a weight's value gives what it gives on the fp32 array:
    dtype, arithmetic, comparisons (zeros of both signs, NaNs, infinities), bytes, scalars, dot;
    layout operations stay views of the fp16 storage."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 6e-8, 65504.0], dtype=np.float16)
    a16 = np.concatenate([special, rng.standard_normal(247).astype(np.float16)]).reshape(16, 16)
    b16 = a16.copy()
    b16[rng.integers(0, 16, 40), rng.integers(0, 16, 40)] = rng.standard_normal(40).astype(np.float16)
    b16[0, 1] = 0.0  # -0.0 against +0.0
    a, b = a16.view(mlpackage.Fp16AsFp32), b16.view(mlpackage.Fp16AsFp32)
    a32, b32 = a16.astype(np.float32), b16.astype(np.float32)
    assert a.dtype == np.float32
    for x, y, x32, y32 in ((a, b, a32, b32), (a, a, a32, a32), (a[::2], a[1::2], a32[::2], a32[1::2])):
        assert np.array_equal(x != y, x32 != y32) and np.array_equal(x == y, x32 == y32)
    with np.errstate(all="ignore"):
        assert np.array_equal(a + b, a32 + b32, equal_nan=True) and (a * 3).dtype == np.float32
        assert np.array_equal(np.dot(a, b), np.dot(a32, b32), equal_nan=True)
        assert np.array_equal(a.dot(b), a32.dot(b32), equal_nan=True)
        assert np.allclose(a, a, equal_nan=True) and a.sum().dtype == np.float32
    assert a.tobytes() == a32.tobytes() and type(a[0, 5]) is np.float32
    for view in (np.transpose(a), a.T, a[2:5], np.reshape(a, (-1,)), np.expand_dims(a, 0)):
        assert isinstance(view, mlpackage.Fp16AsFp32) and np.shares_memory(view, a16)
