"""End to end at the real head configuration (hidden 4096, width 1024, 16 heads, 2 + 4 layers):
the CLI builds the bundle from a synthetic snapshot, the Core AI runtime runs every function."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from clef_flash.head.contract import INPUT_ORDER, INPUT_SPECS, REAL_PARAMETERS
from clef_flash.head.aimodel import Manifest
from clef_flash.manifest import HEAD_DESCRIPTIVE_KEYS

from .conftest import PUBLISHED

pytestmark = pytest.mark.real
NAME = "clef_flash_head_bucket_fp16w32"
PUBLISHED_MLIRB = json.loads(PUBLISHED.read_text())["export"]["main_mlirb"]["bytes"]


def cli(*args, env=None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "clef-export"
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory, real_source) -> Path:
    out = tmp_path_factory.mktemp("real-build")
    r = cli("build", "--source", real_source, "--pins", real_source / "pins.json", "--out", out, "--no-verify", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads(r.stdout)  # stdout is exactly the manifest
    assert manifest["name"] == NAME
    return out / NAME


def test_real_source_has_the_published_parameter_count(real_source, author_module):
    from clef_flash.sources.author import load_head
    from clef_flash.sources.pins import load_pins

    _, config, head = load_head(real_source, load_pins(real_source / "pins.json"), torch.float16)
    assert sum(p.numel() for p in head.parameters()) == REAL_PARAMETERS
    assert config.hidden_size == 4096 and config.width == 1024 and config.heads == 16


def test_real_manifest_matches_published(real_bundle):
    pub = json.loads(PUBLISHED.read_text())
    ours = json.loads((real_bundle / "metadata.json").read_text())
    Manifest.model_validate(ours)

    def shape(x):  # keys and nesting and value types, recursively
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape(v) for v in x[:1]]
        return type(x).__name__ if not isinstance(x, (int, float)) or isinstance(x, bool) else "number"

    pub_shape, our_shape = shape(pub), shape(ours)
    # no AOT compile has run here: aot is null and compilation.targets empty until one does
    pub_shape["aot"] = "NoneType"
    pub_shape["compilation"]["targets"] = []
    assert our_shape == pub_shape
    for key in HEAD_DESCRIPTIVE_KEYS:
        assert ours["head"][key] == pub["head"][key], key
    assert ours["kind"] == pub["kind"] and ours["metadata_version"] == pub["metadata_version"]
    assert ours["assets"] == pub["assets"] and ours["aot"] is None and ours["compilation"]["targets"] == []
    from coreai.authoring.asset import AIModelAsset

    # fp16w32: the weights are stored fp16, once for all four functions (four copies would be 4x);
    # the optimizer folds only the small 1-D tensors' casts into fp32 constants
    storage = dict(AIModelAsset.load(real_bundle / f"{NAME}.aimodel").summary(include_statistics=True).storage_types)
    assert 0.998 * REAL_PARAMETERS <= storage["Float16"] <= REAL_PARAMETERS, storage
    size = ours["export"]["main_mlirb"]["bytes"]
    assert abs(size - PUBLISHED_MLIRB) / PUBLISHED_MLIRB <= 0.005, size
    assert (real_bundle / f"{NAME}.aimodel" / "main.mlirb").stat().st_size == size


async def _run_each(asset: Path, arrays_by_fn: dict[str, dict[str, np.ndarray]]):
    from coreai.authoring.asset import AIModelAsset
    from coreai.runtime import NDArray

    results, descs = {}, {}
    async with AIModelAsset.load(asset).executable() as model:
        assert sorted(model.function_names) == sorted(arrays_by_fn)
        fns = {name: model.load_function(name) for name in arrays_by_fn}
        for name, fn in fns.items():
            d = fn.desc
            descs[name] = {n: (tuple(d.input_descriptor(n).shape), str(d.input_descriptor(n).dtype)) for n in d.input_names}
            descs[name]["logits"] = (tuple(d.output_descriptor("logits").shape), str(d.output_descriptor("logits").dtype))
            assert list(d.input_names) == list(INPUT_ORDER) and list(d.output_names) == ["logits"]

        async def one(name):
            out = await fns[name]({k: NDArray(v) for k, v in arrays_by_fn[name].items()})
            return name, np.array(out["logits"].numpy(), copy=True)

        for name, logits in await asyncio.gather(*[one(n) for n in arrays_by_fn]):
            results[name] = logits
    return descs, results


def test_real_asset_functions_shapes_and_eager_parity(real_bundle, real_source):
    """Each of the four functions, loaded by the Core AI runtime, against the eager graph."""
    from clef_flash.sources.author import load_head
    from clef_flash.head.records import random_records
    from clef_flash.head.graph import ClefHeadGraph
    from clef_flash.head.host import head_inputs
    from clef_flash.sources.pins import load_pins

    manifest = json.loads((real_bundle / "metadata.json").read_text())
    _, _, head = load_head(real_source, load_pins(real_source / "pins.json"), torch.float16)
    graph = ClefHeadGraph(head)
    table = np.random.default_rng(9).standard_normal((512, 4096), dtype=np.float32)
    arrays_by_fn, expected, n_opts = {}, {}, {}
    lower = 0
    for name, bucket in manifest["head"]["buckets"]:
        rec = random_records(3, bucket, lower, 4096, 512, seed=21)[2]
        hi = head_inputs(rec.hidden, rec.ids, rec.questions, table, bucket)
        arrays_by_fn[name] = hi.arrays
        n_opts[name] = hi.options
        with torch.inference_mode():
            expected[name] = graph(*[torch.from_numpy(hi.arrays[k]) for k in INPUT_ORDER]).numpy()
        lower = bucket
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        descs, got = asyncio.run(_run_each(real_bundle / f"{NAME}.aimodel", arrays_by_fn))
    dims = {"O": 128, "Q": 16, "1": 1}
    for name, bucket in manifest["head"]["buckets"]:
        for inp in INPUT_ORDER:
            sym, dtype = INPUT_SPECS[inp]
            want = tuple(bucket if s == "T" else 4096 if s == "H" else dims[s] for s in sym)
            assert descs[name][inp][0] == want, (name, inp)
            assert descs[name][inp][1].lower().startswith({"f32": "float32", "i32": "int32"}[dtype]), descs[name][inp]
        assert descs[name]["logits"][0] == (128,) and descs[name]["logits"][1].lower().startswith("float32")
        d = float(np.abs(got[name] - expected[name]).max())
        assert d <= 1e-4, (name, d)
        assert np.all(got[name][n_opts[name]:] == 0.0)


def test_real_verify_every_function(real_bundle, real_source, tmp_path):
    """`clef-export verify` on the real-configuration bundle: every function against the author."""
    transcript = tmp_path / "verify.json"
    r = cli("verify", real_bundle, "--source", real_source, "--pins", real_source / "pins.json", "--records", "1",
            "--transcript", transcript)
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads(transcript.read_text())
    assert [f["function"] for f in t["functions"]] == ["t512", "t1024", "t2048", "t4096"]
    for f in t["functions"]:
        assert f["max_abs_dp"] <= 1e-5 and f["argmax_agree"] == f["questions"] == 16
        assert f["rerun_identical"] and f["padding_max_abs"] == 0.0
    print("\nreal verify:", {f["function"]: (f["max_abs_dlogit"], f["max_abs_dp"]) for f in t["functions"]})


def test_real_rebuild_is_byte_identical(real_bundle, real_source, tmp_path):
    """A second real-configuration build with an unlimited stack (the address layout moves with it),
    through another interpreter path, from another cwd, TZ, PYTHONHASHSEED and TMPDIR: same bytes."""
    import resource

    from .test_repro import cli_build, other_interpreter

    env = {"TZ": "America/St_Johns", "PYTHONHASHSEED": "77", "TMPDIR": str(tmp_path)}
    again = cli_build(other_interpreter(tmp_path), real_source, tmp_path / "again", tmp_path, env, resource.RLIM_INFINITY)
    for name in ("main.mlirb", "main.hash"):
        a = (real_bundle / f"{NAME}.aimodel" / name).read_bytes()
        b = (again / f"{NAME}.aimodel" / name).read_bytes()
        assert a == b, name
    print(f"\nreal rebuild (stack 8 MB vs unlimited): main.hash {b.hex()} in both")


def test_real_mlpackage_stores_every_weight_fp16_once(tmp_path, real_source):
    """The Core ML package at the real size: the build's gate (structure and every weight against
    the author's) passes, and the weights take 2 bytes a parameter for all four functions."""
    r = cli("build", "--format", "mlpackage", "--source", real_source, "--pins", real_source / "pins.json",
            "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads(r.stdout)
    assert manifest["format"] == "mlpackage" and manifest["head"]["functions"] == ["t512", "t1024", "t2048", "t4096"]
    weight_bytes = manifest["export"]["weight_bin"]["bytes"]
    assert 2 * REAL_PARAMETERS <= weight_bytes < 2 * REAL_PARAMETERS * 1.001
    record = json.loads((tmp_path / manifest["name"] / "build-record.json").read_text())
    assert record["verify"]["ok"] and len(record["verify"]["checks"]) >= 20 and all(record["verify"]["checks"].values())
    print(f"\nreal mlpackage: weight.bin {weight_bytes:,} bytes, seconds {manifest['export']['seconds']}")
