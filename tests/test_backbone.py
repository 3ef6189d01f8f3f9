"""The backbone: a release's Qwen3.5 text decoder as one chunked function with Core AI states.

Tiny releases in clef-finetune's layout (make-tiny's configuration, and another: other widths,
layer pattern, conv kernel, sharded with an index) go pin -> build (both compute precisions) ->
verify. The gate's red arms (state not carried, positions one token late) must fail; a tampered
asset, shard or unpinned file must be refused with the file named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _release(root: Path, author_code: Path, variant: str, seed: int, name: str) -> Path:
    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, OTHER_HEAD, write_release

    rel = write_release(root / name, config_name=MAKE_TINY_HEAD if variant == "tiny" else OTHER_HEAD, seed=seed,
                        author_code=author_code, backbone="qwen3_5", variant=variant)
    pin_local(rel, name=name)
    return rel


@pytest.fixture(scope="module")
def releases(tmp_path_factory, author_code) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backbone-releases")
    return {"tiny": _release(root, author_code, "tiny", 0, "tiny_release"),
            "other": _release(root, author_code, "other", 1, "other_release")}


def _recipe(tmp: Path, compute: str, chunk: int = 16, context: int = 128) -> Path:
    p = tmp / f"backbone_{compute}_{chunk}_{context}.toml"
    p.write_text(f'model = "backbone"\nname = "{{release}}_decode_{compute}_pf{chunk}"\nchunk = {chunk}\n'
                 f'context = {context}\ncompute = "{compute}"\n')
    return p


@pytest.fixture(scope="module")
def built(releases, tmp_path_factory) -> dict[str, Path]:
    """fp32 compute on both releases, fp16 compute on the sharded one (the gate runs in each build)."""
    tmp = tmp_path_factory.mktemp("backbone-builds")
    out = {}
    for key, rel, compute in (("tiny32", "tiny", "fp32"), ("other32", "other", "fp32"), ("other16", "other", "fp16")):
        res = runner.invoke(app, ["build", str(_recipe(tmp, compute)), "--source", str(releases[rel]),
                                  "--out", str(tmp / key), "--json"])
        assert res.exit_code == 0, res.output
        out[key] = tmp / key / json.loads(res.stdout)["name"]
        BUILD_LOGS[key] = res.output
    return out


BUILD_LOGS: dict[str, str] = {}  # the ``built`` fixture's output (progress included), by key


# ---------------------------------------------------------------- graph and host, no Core AI


def _reference_rows(release: Path, ids: np.ndarray) -> np.ndarray:
    """transformers' text model of the release, loaded whole with ``from_pretrained`` in fp32."""
    import warnings

    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model.language_model(input_ids=torch.from_numpy(ids[None])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("variant", ["tiny", "other"])
def test_the_gates_streamed_reference_is_from_pretrained_bit_for_bit(releases, variant):
    """The gate's reference holds one decoder layer at a time and reads the embedding rows from the
    shard; its rows must be transformers' own, bit for bit."""
    from clef_flash.backbone.reference import StreamedTextModel

    ref = StreamedTextModel(releases[variant])
    rng = np.random.default_rng(5)
    for n in (1, 17, 150):
        ids = rng.integers(0, 256, size=n)
        assert np.array_equal(ref.rows(ids), _reference_rows(releases[variant], ids)), n
    assert all(p.device.type == "meta" for layer in ref.model.layers for p in layer.parameters())  # dropped after use


@pytest.mark.parametrize("variant", ["tiny", "other"])
def test_eager_chunks_match_transformers_full_forward(releases, tmp_path, variant):
    """DecoderChunk run chunk by chunk (states carried, last chunk padded) = one full forward."""
    import asyncio

    import torch

    from clef_flash.backbone import host
    from clef_flash.backbone.source import release_config
    from clef_flash.backbone.contract import Chunking, DecoderFunction
    from clef_flash.backbone.graph import DecoderChunk, weight_names, zero_states
    from clef_flash.engine.streamed_weights import load_weights

    rel = releases[variant]
    cfg = release_config(rel)
    ch = Chunking(8, 64)
    w = load_weights(rel, weight_names(cfg), tmp_path)
    assert not list(tmp_path.iterdir()), "the scratch file is unlinked at once"
    m = DecoderChunk(cfg, ch, w.tensors(), "fp32")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=29)

    async def call(inputs, states):
        with torch.no_grad():
            return m(*(torch.from_numpy(inputs[k]) for k in ("input_ids", "position_ids")), **states.arrays)[0].numpy()

    fn = DecoderFunction("main", 64)

    def states(_tokens):
        return host.RecordStates(fn, zero_states(cfg, ch))

    got = asyncio.run(host.run_record(call, states, ids, 8, cfg.pad_token_id))
    want = _reference_rows(rel, ids)
    assert got.shape == want.shape == (29, cfg.hidden_size)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    late = asyncio.run(host.run_record(call, states, ids, 8, cfg.pad_token_id, "positions_late"))
    assert np.abs(late - want).max() / np.abs(want).max() > 1e-2


def test_host_chunks_pad_and_ramp():
    from clef_flash.backbone.host import chunk_inputs

    calls = chunk_inputs(np.arange(10), chunk=4, context=16, pad_id=99)
    assert len(calls) == 3
    assert calls[2]["input_ids"].tolist() == [[8, 9, 99, 99]]
    assert calls[2]["position_ids"].tolist() == [list(range(12))]
    assert all(c["input_ids"].dtype == np.int32 and c["position_ids"].dtype == np.int32 for c in calls)
    with pytest.raises(ValueError, match="more than the context"):
        chunk_inputs(np.arange(17), chunk=4, context=16, pad_id=0)


def test_text_config_errors_name_the_file(releases, tmp_path):
    from clef_flash.backbone.contract import read_text_config
    from clef_flash.errors import IntegrityError

    raw = json.loads((releases["tiny"] / "config.json").read_text())
    cfg = read_text_config(releases["tiny"])
    assert cfg.layer_types.count("full_attention") == 1 and cfg.rotary_dim == 4 and cfg.pad_token_id == 256
    other = read_text_config(releases["other"])
    assert other.layer_types[0] == "full_attention" and other.conv_kernel == 3 and other.rotary_dim == 16
    for change, words in ((lambda t: t.pop("layer_types"), "missing 'layer_types'"),
                          (lambda t: t.update(layer_types=["sliding"] * 4), "layer_types must be"),
                          (lambda t: t.update(num_key_value_heads=3), "multiple of num_key_value_heads")):
        bad = json.loads(json.dumps(raw))
        change(bad["text_config"])
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(IntegrityError, match=words) as exc:
            read_text_config(tmp_path)
        assert str(tmp_path / "config.json") in str(exc.value)


def test_recipe_checks_whole_chunks(tmp_path):
    from clef_flash.errors import UsageError
    from clef_flash.recipe import BackboneRecipe, load_recipe

    r = load_recipe(ROOT / "conversion" / "backbone_pf64_fp16.toml")
    assert isinstance(r, BackboneRecipe) and (r.chunk, r.context, r.compute) == (64, 4096, "fp16")
    assert load_recipe(ROOT / "conversion" / "backbone_pf64_fp16w32.toml").compute == "fp32"
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "backbone"\nname = "x"\nchunk = 64\ncontext = 100\n')
    with pytest.raises(UsageError, match="multiple of the chunk"):
        load_recipe(bad)


def test_backbone_schema_is_in_sync():
    from clef_flash.backbone.manifest import json_schema

    checked_in = json.loads((ROOT / "manifests" / "metadata-backbone.schema.json").read_text())
    assert checked_in == json_schema(), "run `clef-export schema --kind backbone > manifests/metadata-backbone.schema.json`"


def test_streamed_save_writes_what_save_asset_writes(tmp_path):
    """aimodel.save_streamed (private coreai API) = save_asset, file for file, creation date aside."""
    import torch
    from coreai.runtime import AIModelAssetMetadata

    from coreai_torch import TorchConverter, get_decomp_table

    from clef_flash.formats.aimodel import save_streamed

    lin = torch.nn.Linear(300, 600, bias=False).half()
    ep = torch.export.export(lambda_module(lin), (torch.zeros(2, 300),), strict=False).run_decompositions(get_decomp_table())
    converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
    converter.add_exported_program(ep, input_names=["x"], output_names=["y"], entrypoint_name="main")
    program = converter.to_coreai()
    a, b = tmp_path / "a.aimodel", tmp_path / "b.aimodel"
    program.save_asset(a, metadata=AIModelAssetMetadata())
    save_streamed(program, b, AIModelAssetMetadata())
    assert (a / "main.mlirb").read_bytes() == (b / "main.mlirb").read_bytes()
    assert (a / "main.hash").read_bytes() == (b / "main.hash").read_bytes()
    meta_a, meta_b = (json.loads((p / "metadata.json").read_text()) for p in (a, b))
    meta_a.pop("creationDate", None), meta_b.pop("creationDate", None)
    assert {k for k in meta_a if "date" not in k.lower()} == {k for k in meta_b if "date" not in k.lower()}

    # the rename pass reads the file once: each blob's name and the renamed file's sha256 from it
    from clef_flash.digest import sha256_file
    from clef_flash.formats.mlirb import digests, resource_names, stable_resource_names

    before = resource_names(b / "main.mlirb")
    written = stable_resource_names(b / "main.mlirb")
    assert written.renamed == len(before) >= 1 and resource_names(b / "main.mlirb") != before
    assert written.sha256 == sha256_file(b / "main.mlirb")
    assert list(written.blobs) == [h for _, h in digests(b / "main.mlirb")[1]]  # each resource's, in file order
    assert all(n.startswith("w_") for n in resource_names(b / "main.mlirb"))


def lambda_module(lin):
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.nn.functional.linear(x, self.lin.weight.float())

    return M()


# ---------------------------------------------------------------- built bundles (the gate ran in build)


def test_builds_land_with_manifest_states_and_tokenizer(built, releases):
    from clef_flash.backbone.manifest import BackboneManifest

    for key, bundle in built.items():
        m = BackboneManifest.model_validate_json((bundle / "metadata.json").read_bytes())
        rec = json.loads((bundle / "build-record.json").read_text())
        assert m.kind == "decision-backbone" and m.interface.function == "main" and m.interface.vision is None
        assert m.interface.state_order == ["keyCache", "valueCache", "convState", "recState"]
        assert rec["verify"]["ok"] and set(rec["verify"]["red"]) == {"state_reset", "positions_late"}
        assert len(rec["verify"]["records"]) == 6
        # the gate's compiled copy went to a folder in the staged bundle and left with the gate
        assert sorted(p.name for p in bundle.iterdir()) == sorted([f"{bundle.name}.aimodel", "build-record.json",
                                                                   "metadata.json", "tokenizer", "weight-map.safetensors"])
        rel = releases["tiny" if key.startswith("tiny") else "other"]
        for f, digest in m.tokenizer.items():
            assert (bundle / "tokenizer" / f).read_bytes() == (rel / f).read_bytes()
        pins = json.loads((rel / "pins.json").read_text())["files"]
        assert m.source.files == {k: pins[k] for k in m.source.files} and "config.json" in m.source.files
    other = BackboneManifest.model_validate_json((built["other16"] / "metadata.json").read_bytes())
    assert other.interface.states["convState"].shape == [3, 1, 2 * 2 * 8 + 6 * 12, 2]
    assert other.interface.states["keyCache"].shape == [2, 1, 2, 128, 32] and other.export.compute == "fp16"
    assert len([f for f in other.source.files if f.startswith("model-")]) >= 2  # every shard pinned and read


def test_verify_passes_and_reports_red_arms(built, releases, tmp_path):
    res = runner.invoke(app, ["verify", str(built["tiny32"]), "--source", str(releases["tiny"]),
                              "--transcript", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    t = json.loads((tmp_path / "t.json").read_text())
    main = [r for r in t["records"] if r["arm"] == "main"]
    assert {r["tokens"] for r in main} == {1, 15, 16, 17, 40, 113}
    assert all(r["rel_max_abs_d"] <= t["bars"]["rel_max_abs_d"]["bar"] for r in main)
    red = {r["arm"]: r["rel_max_abs_d"] for r in t["records"] if r["arm"] not in ("main", "torch engine")}
    assert set(red) == {"state_reset", "positions_late"} and min(red.values()) > 100 * t["bars"]["rel_max_abs_d"]["bar"]
    engine = [r for r in t["records"] if r["arm"] == "torch engine"]  # the torch engine held to the runtime
    assert {r["tokens"] for r in engine} == {1, 15, 16, 17, 40, 113}
    assert all(r["rel_max_abs_d"] <= t["bars"]["rel_max_abs_d"]["bar"] for r in engine)


def test_gate_fails_when_the_bar_cannot_see_a_red_arm(built, releases, monkeypatch):
    """A gate too loose to see a state reset must itself fail (exit 4), not pass."""
    from clef_flash.gate import backbone as gate

    monkeypatch.setitem(gate.TOLERANCES, "fp32", {"rel_max_abs_d": (10.0, "too loose"), "min_row_cosine": (-1.0, "too loose")})
    res = runner.invoke(app, ["verify", str(built["tiny32"]), "--source", str(releases["tiny"])])
    assert res.exit_code == 4, res.output
    assert "red arm state_reset" in res.output


def test_tampered_asset_is_refused(built, releases, tmp_path):
    import shutil

    copy = tmp_path / built["tiny32"].name
    shutil.copytree(built["tiny32"], copy)
    res = runner.invoke(app, ["verify-artifact", str(copy), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["files"] >= 5, res.output
    tok = next((copy / "tokenizer").iterdir())
    good = tok.read_bytes()
    tok.write_bytes(good + b" ")
    res = runner.invoke(app, ["verify-artifact", str(copy)])
    assert res.exit_code == 3 and tok.name in res.output, res.output
    tok.write_bytes(good)
    mlirb = next(copy.glob("*.aimodel")) / "main.mlirb"
    data = bytearray(mlirb.read_bytes())
    data[-100] ^= 1
    mlirb.write_bytes(bytes(data))
    res = runner.invoke(app, ["verify", str(copy), "--source", str(releases["tiny"])])
    assert res.exit_code == 3 and "main.mlirb" in res.output
    res = runner.invoke(app, ["verify-artifact", str(copy)])
    assert res.exit_code == 3 and "main.mlirb" in res.output


def test_tampered_shard_and_unpinned_file_are_named(releases, tmp_path):
    import shutil

    rel = tmp_path / "rel"
    shutil.copytree(releases["other"], rel)
    shard = sorted(rel.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    recipe = _recipe(tmp_path, "fp32")
    res = runner.invoke(app, ["build", str(recipe), "--source", str(rel), "--out", str(tmp_path / "out")])
    assert res.exit_code == 3 and shard.name in res.output and "sha256 mismatch" in res.output
    # the shards are hashed beside the export: the failure comes after it, and nothing lands
    assert not (tmp_path / "out").exists() or not [p for p in (tmp_path / "out").iterdir() if not p.name.endswith(".lock")]
    shutil.copy2(releases["other"] / shard.name, shard)  # the shard restored; now a file the pins do not name
    pins = json.loads((rel / "pins.json").read_text())
    del pins["files"]["tokenizer.json"]
    (rel / "pins.json").write_text(json.dumps(pins))
    res = runner.invoke(app, ["build", str(recipe), "--source", str(rel), "--out", str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 3 and "tokenizer.json: not pinned" in res.output


# ---------------------------------------------------------------- the gate at any size: weights, bytecode descriptor


def _infos(release: Path):
    from clef_flash.backbone.contract import weight_names
    from clef_flash.backbone.source import release_config
    from clef_flash.engine.streamed_weights import locate

    return locate(release, weight_names(release_config(release)))


def test_every_weight_in_the_asset_is_the_releases_and_a_changed_value_is_named(built, releases, tmp_path):
    """The streamed comparison finds each 2-D+ tensor of the release in a blob of main.mlirb (fp16,
    or folded to fp32), and names the tensor when one value differs on either side."""
    import shutil

    from clef_flash.engine.asset_readback import compare
    from clef_flash.digest import sha256_file
    from clef_flash.formats.mlirb import blobs

    for key, rel, scaled in (("tiny32", "tiny", True), ("other32", "other", True), ("other16", "other", False)):
        mlirb = next(built[key].glob("*.aimodel")) / "main.mlirb"
        infos = _infos(releases[rel])
        r = compare(mlirb, releases[rel], infos, scaled=scaled)
        assert r.ok and len(r.matched) == r.tensors == sum(1 for t in infos.values() if len(t.shape) >= 2), r.checks()
        assert r.file_sha256 == sha256_file(mlirb)  # the file's own hash, from the same read
        assert not compare(mlirb, releases[rel], infos, scaled=not scaled).ok  # the other recipe's bytes are not these

    # the asset side: one byte inside the largest blob
    mlirb = next(built["tiny32"].glob("*.aimodel")) / "main.mlirb"
    infos = _infos(releases["tiny"])
    copy = tmp_path / "main.mlirb"
    shutil.copy2(mlirb, copy)
    big = max(blobs(copy), key=lambda b: b.size)
    data = bytearray(copy.read_bytes())
    data[big.start + big.size // 2] ^= 0x40
    copy.write_bytes(bytes(data))
    r = compare(copy, releases["tiny"], infos, scaled=True)
    assert len(r.missing) == 1 and not r.ok
    assert r.missing[0] in r.checks()[0][2] and r.checks()[0][1] is False

    # the release side: one bf16 value of one projection
    rel = tmp_path / "rel"
    shutil.copytree(releases["tiny"], rel)
    t = infos["model.language_model.layers.3.self_attn.q_proj.weight"]
    shard = rel / t.file
    data = bytearray(shard.read_bytes())
    data[t.offset + 2 * 17] ^= 0x40  # a mantissa bit of the 18th value
    shard.write_bytes(bytes(data))
    r = compare(mlirb, rel, infos, scaled=True)
    assert r.missing == [t.name]


def test_the_builds_gate_reads_main_mlirb_with_one_hash_and_the_saves_digests(built, releases, tmp_path, monkeypatch):
    """In a build, the gate takes each blob's digest from what the save hashed as it wrote
    (``mlirb.Written``) and hashes main.mlirb once, for the file: the same report as hashing every
    blob again; a byte changed after the save fails, named; and the digests are the ones matched."""
    import shutil

    from clef_flash.engine import asset_readback as aw
    from clef_flash.errors import IntegrityError
    from clef_flash.formats.mlirb import Written, blobs, stable_resource_names

    assert "the file hashed once" in BUILD_LOGS["tiny32"]  # the build passed its save's digests
    infos = _infos(releases["tiny"])
    copy = tmp_path / "main.mlirb"
    shutil.copy2(next(built["tiny32"].glob("*.aimodel")) / "main.mlirb", copy)
    before = copy.read_bytes()
    written = stable_resource_names(copy)  # what a writer hashes (the names are stable already: same bytes)
    assert copy.read_bytes() == before
    full = aw.compare(copy, releases["tiny"], infos, scaled=True)
    calls = []
    real = aw.digests
    monkeypatch.setattr(aw, "digests", lambda path, each_blob=True: calls.append(each_blob) or real(path, each_blob))
    once = aw.compare(copy, releases["tiny"], infos, scaled=True, written=Written.from_json(written.as_json()))
    assert calls == [False] and once.ok and full.ok
    assert (once.matched, once.found, once.file_sha256, once.blobs) == (full.matched, full.found, full.file_sha256, full.blobs)

    # the save's digests are what the blobs are matched by: the largest one's wrong, its tensor is not found
    a = max(range(len(written.blobs)), key=lambda i: blobs(copy)[i].size)
    wrong = list(written.blobs)
    wrong[a] = "0" * 64
    r = aw.compare(copy, releases["tiny"], infos, scaled=True, written=Written(written.renamed, written.sha256, tuple(wrong)))
    assert not r.ok and len(r.missing) == 1

    # one byte of the largest blob changed after the save: the file is not what the save hashed
    big = blobs(copy)[a]
    data = bytearray(before)
    data[big.start + big.size // 2] ^= 0x40
    copy.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"{copy}: not the bytes the build's save wrote"):
        aw.compare(copy, releases["tiny"], infos, scaled=True, written=written)
    copy.write_bytes(before[:-1])  # and one short
    with pytest.raises(IntegrityError, match="main.mlirb"):
        aw.compare(copy, releases["tiny"], infos, scaled=True, written=written)


def test_bytecode_descriptor_is_the_runtimes(built, tmp_path):
    """The descriptor read from the bytecode (any size: no compiled copy, a skeleton of main.mlirb
    with every blob's data left out) says what the runtime says."""
    from clef_flash.backbone.bundle import bytecode_descriptor
    from clef_flash.backbone.runtime import describe
    from clef_flash.formats.mlirb import blobs, skeleton

    for key in ("tiny32", "other16"):
        asset = next(built[key].glob("*.aimodel"))
        full = blobs(asset / "main.mlirb")
        n = skeleton(asset / "main.mlirb", tmp_path / f"{key}.mlirb")
        assert n == (tmp_path / f"{key}.mlirb").stat().st_size < (asset / "main.mlirb").stat().st_size - sum(b.size for b in full) + 64 * len(full)
        assert [(b.name, b.size) for b in blobs(tmp_path / f"{key}.mlirb")] == [(b.name, 0) for b in full]
        static, loaded = bytecode_descriptor(asset), describe(asset)
        assert static["functions"] == loaded["functions"] == ["main"]
        for kind in ("inputs", "states", "outputs"):
            assert list(static["signatures"]["main"][kind]) == list(loaded["signatures"]["main"][kind])
            for name, spec in static["signatures"]["main"][kind].items():
                got = loaded["signatures"]["main"][kind][name]
                assert spec["shape"] == [-1 if isinstance(x, str) else x for x in got["shape"]], (name, got)
                assert spec["dtype"] in got["dtype"].replace("float", "fp"), (name, got)


def test_the_expected_digests_started_early_gives_what_compare_computes(built, releases, tmp_path):
    """``ExpectedDigests`` (the build starts it beside the export, at a lower priority) gives each tensor's
    digests as ``expected`` does; compare takes it; one started for another recipe is not used; a
    stopped one or one whose release breaks does not pass for a result."""
    import shutil

    from clef_flash.engine.asset_readback import ExpectedDigests, compare, expected
    from clef_flash.errors import IntegrityError

    infos = _infos(releases["tiny"])
    side = ExpectedDigests(releases["tiny"], infos, True).start(background=True)
    got = side.result()
    assert got == [expected(releases["tiny"], t, True) for t in side.big] and len(got) == sum(len(t.shape) >= 2 for t in infos.values())
    # read past the page cache (beside a compressed export): the same digests
    assert ExpectedDigests(releases["tiny"], infos, True, direct=True).start(background=True).result() == got
    mlirb = next(built["tiny32"].glob("*.aimodel")) / "main.mlirb"
    for early in (ExpectedDigests(releases["tiny"], infos, True).start(background=True), ExpectedDigests(releases["tiny"], infos, False)):
        r = compare(mlirb, releases["tiny"], infos, scaled=True, release=early)  # the unscaled one is replaced
        assert r.ok and len(r.matched) == r.tensors
    stopped = ExpectedDigests(releases["tiny"], infos, True)
    stopped.stop()
    with pytest.raises(IntegrityError, match="stopped"):
        stopped.result()
    broken = tmp_path / "rel"
    shutil.copytree(releases["tiny"], broken)
    shard = broken / side.big[-1].file
    shard.write_bytes(shard.read_bytes()[: side.big[-1].offset + 10])
    for direct in (False, True):
        with pytest.raises(IntegrityError, match="ends inside"):
            ExpectedDigests(broken, infos, True, direct=direct).start(background=True).result()


def test_one_read_gives_the_files_and_every_blobs_sha256(built, tmp_path, monkeypatch):
    """``mlirb.digests`` (the gate's one sequential read) against hashlib on the whole file and on each
    blob read where it lies, with reads small enough that blobs span several of them; a truncated
    file is refused naming the blob."""
    import hashlib

    from clef_flash.formats import mlirb as fmt

    path = next(built["tiny32"].glob("*.aimodel")) / "main.mlirb"
    found = fmt.blobs(path)
    with open(path, "rb") as fh:
        want = [(b, fmt.blob_sha256(fh, b)) for b in found]
    for chunk in (1 << 20, 1000, 256, 7):  # reads of 16x this: whole blobs, and blobs across reads
        monkeypatch.setattr(fmt, "_CHUNK", chunk)  # 256: 4 KB reads, O_DIRECT where the disk takes it
        whole, got = fmt.digests(path)
        assert whole == hashlib.sha256(path.read_bytes()).hexdigest() and got == want
        assert fmt.digests(path, each_blob=False) == (whole, [(b, None) for b in found])
    monkeypatch.delattr(fmt.os, "preadv")  # where Python has no preadv (macOS): the same digests
    assert fmt.digests(path) == (whole, want)
    assert max(b.size for b in found) > 16 * 1000 > min(b.size for b in found)
    cut = tmp_path / "main.mlirb"
    big = max(found, key=lambda b: b.size)
    cut.write_bytes(path.read_bytes()[: big.start + big.size - 1])
    with pytest.raises(fmt.BytecodeError):
        fmt.digests(cut)


def test_verify_without_the_numeric_check_still_gates_the_weights(built, releases, tmp_path, monkeypatch):
    """What runs at 9B size (no numeric check): the bytecode's descriptor and the streamed weights.
    A bundle whose files agree with its manifest but whose weights are not the release's fails (exit 4)."""
    import hashlib
    import shutil

    from clef_flash.gate import backbone as gate
    from clef_flash.formats.mlirb import blobs

    monkeypatch.setitem(gate.NUMERIC_MAX_PARAMETERS, "fp32", 0)
    res = runner.invoke(app, ["verify", str(built["tiny32"]), "--source", str(releases["tiny"]),
                              "--transcript", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    t = json.loads((tmp_path / "t.json").read_text())
    checks = {c["check"]: c for c in t["checks"]}
    assert checks["functions = [main] (bytecode)"]["ok"] and checks["every weight = the release's tensor in fp16 (streamed)"]["ok"]
    # the numbers through the torch engine (tests/test_engine.py), the runtime spot-checked on one chunk
    assert {r["name"] for r in t["records"]} == {"record-1", "record-2", "record-1, chunk 1"} and not t["notes"]
    # main.mlirb's sha256 taken in the weights' one read: still checked, first in the checklist
    assert t["checks"][0]["check"] == "main.mlirb sha256 = manifest" and t["checks"][0]["ok"]

    copy = tmp_path / built["tiny32"].name
    shutil.copytree(built["tiny32"], copy)
    asset = next(copy.glob("*.aimodel"))
    mlirb = asset / "main.mlirb"
    data = bytearray(mlirb.read_bytes())
    big = max(blobs(mlirb), key=lambda b: b.size)
    # a main.mlirb that is not its manifest's is named as such (exit 3, integrity), whether the change is in a
    # blob (seen after the one read) or breaks the bytecode itself (seen before, and named the same)
    for at in (big.start + 5, 4):
        changed = bytearray(data)
        changed[at] ^= 0xFF
        mlirb.write_bytes(bytes(changed))
        res = runner.invoke(app, ["verify", str(copy), "--source", str(releases["tiny"])])
        assert res.exit_code == 3 and "main.mlirb: sha256" in res.output and "differs from the manifest" in res.output, res.output
    data[big.start + 5] ^= 0x40
    mlirb.write_bytes(bytes(data))
    digest = hashlib.sha256(bytes(data)).hexdigest()
    (asset / "main.hash").write_bytes(bytes.fromhex(digest))
    m = json.loads((copy / "metadata.json").read_text())
    m["export"]["main_mlirb"]["sha256"] = digest
    (copy / "metadata.json").write_text(json.dumps(m))
    from .conftest import rerecord

    rerecord(copy)  # past every file check: only the streamed weights can see it
    res = runner.invoke(app, ["verify", str(copy), "--source", str(releases["tiny"])])
    assert res.exit_code == 4 and "is in no blob of main.mlirb" in res.output, res.output


# ---------------------------------------------------------------- weights scaled by powers of two


def test_scaled_weights_hold_no_subnormal_and_compute_the_same_bits(releases, tmp_path):
    """The runtime flushes fp16 subnormals when it widens folded constants (measured: 2e-4 relative on
    the tiny release); stored as W * 2**k none is left, and the fp32 graph's rows are bit for bit the
    unscaled graph's (a power of two commutes with every rounding)."""
    import torch

    from clef_flash.backbone.contract import Chunking, DecoderFunction
    from clef_flash.backbone.graph import DecoderChunk, weight_names, zero_states
    from clef_flash.backbone.source import release_config
    from clef_flash.engine.streamed_weights import load_weights

    rel = releases["tiny"]
    cfg = release_config(rel)
    ch = Chunking(8, 64)
    plain = load_weights(rel, weight_names(cfg), tmp_path)
    scaled = load_weights(rel, weight_names(cfg), tmp_path, scaled=True)

    def subnormal(t):
        a = np.abs(np.asarray(t, dtype=np.float32))
        return int(((a > 0) & (a < 2.0 ** -14)).sum())

    two_d = [n for n, a in plain.arrays.items() if a.ndim >= 2]
    assert sum(subnormal(plain.arrays[n]) for n in two_d) > 0, "the release has fp16 subnormals to begin with"
    assert sum(subnormal(scaled.arrays[n]) for n in two_d) == 0
    assert all(scaled.exponents[n] > 0 for n in two_d) and not any(plain.exponents.values())
    normal = {n: np.abs(plain.arrays[n].astype(np.float32)) >= 2.0 ** -14 for n in two_d}
    for n in two_d:  # where plain fp16 is exact, the stored values are the same numbers times 2**k
        np.testing.assert_array_equal(np.ldexp(scaled.arrays[n].astype(np.float64), -scaled.exponents[n])[normal[n]],
                                      plain.arrays[n].astype(np.float64)[normal[n]])
    # the same weights unscaled in fp32 (exact): the scaled graph computes the same bits
    unscaled = {n: torch.from_numpy(np.ldexp(a.astype(np.float32), -scaled.exponents.get(n, 0)).astype(np.float32))
                for n, a in scaled.arrays.items()}
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, cfg.vocab_size, size=(1, 8)).astype(np.int32))
    pos = torch.arange(8, dtype=torch.int32)[None]
    with torch.no_grad():
        a = DecoderChunk(cfg, ch, unscaled, "fp32")(ids, pos, *zero_states(cfg, ch).values())
        b = DecoderChunk(cfg, ch, scaled.tensors(), "fp32", exponents=scaled.exponents)(ids, pos, *zero_states(cfg, ch).values())
        c = DecoderChunk(cfg, ch, scaled.tensors(), "fp32")(ids, pos, *zero_states(cfg, ch).values())
    assert torch.equal(a, b)
    assert not torch.allclose(a, c), "without the exponents the scaled weights compute something else"


# ---------------------------------------------------------------- check-release with the backbone


@pytest.fixture(scope="module")
def whole_model(releases, tmp_path_factory) -> dict[str, Path]:
    """The tiny release's head bundle, and its fp32-compute backbone at chunk 64, context 1024 (the
    project's requests of more tokens are listed as not fitting); the other release's backbone."""
    from .conftest import build_bundle

    tmp = tmp_path_factory.mktemp("whole-model")
    out = {}
    for key in ("tiny", "other"):
        out[f"{key}-head"] = build_bundle(releases[key], tmp / f"{key}-head")
        res = runner.invoke(app, ["build", str(_recipe(tmp, "fp32", chunk=64, context=1024)), "--source",
                                  str(releases[key]), "--out", str(tmp / key), "--no-verify", "--json"])
        assert res.exit_code == 0, res.output
        out[key] = tmp / key / json.loads(res.stdout)["name"]
        BUILD_LOGS[key] = res.output
    return out


BUILD_LOGS: dict[str, str] = {}  # the ``built`` fixture's output (progress included), by key


@pytest.mark.parametrize("variant", ["tiny", "other"])
def test_check_release_through_the_backbone_asset(whole_model, releases, tmp_path, variant):
    """tokenizer -> backbone asset (chunked, states carried) -> head asset -> answers, against the
    author's systemone: the head's own bar (1e-5) holds with an fp32-compute backbone, on make-tiny's
    configuration and on another (widths, layer pattern, conv kernel, sharded)."""
    rel = releases[variant]
    res = runner.invoke(app, ["check-release", str(rel), "--bundle", str(whole_model[f"{variant}-head"]), "--backbone",
                              str(whole_model[variant]), "--transcript", str(tmp_path / "t.json"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["checked"] >= 3 and s["disagreements"] == 0
    assert s["backbone"]["compute"] == "fp32" and 0 < s["backbone"]["hidden_rel_max_abs_d"] < 1e-5
    assert s["bar"] == 1e-5 and s["max_abs_dp"] <= 1e-5
    t = json.loads((tmp_path / "t.json").read_text())
    assert any("backbone's context of 1024" in e["why"] for e in t["does_not_fit"])
    assert all(e["backbone_rel_max_abs_d"] < 1e-5 for e in t["requests"] if "function" in e)


def test_check_release_red_state_and_a_foreign_backbone_fail(whole_model, releases):
    rel = releases["tiny"]
    args = ["check-release", str(rel), "--bundle", str(whole_model["tiny-head"])]
    res = runner.invoke(app, [*args, "--backbone", str(whole_model["tiny"]), "--red", "state", "--json"])
    assert res.exit_code == 4, res.output[-2000:]
    assert json.loads(res.stdout)["disagreements"] > 0
    res = runner.invoke(app, [*args, "--red", "state"])
    assert res.exit_code == 2 and "--backbone" in res.output
    res = runner.invoke(app, [*args, "--backbone", str(whole_model["other"])])
    assert res.exit_code == 3 and "config.json" in res.output and "another release" in res.output


def test_release_with_a_backbone_is_the_whole_mac_release(whole_dist):
    """head + backbone (each gated) + the lm_head table + the release's LICENSE and NOTICE in one
    dist/ whose SHA256SUMS check; no build lock or other stray file ships."""
    import subprocess

    dist, s = whole_dist["dist"], whole_dist["summary"]
    head, backbone = s["bundles"]
    assert backbone == "licensed_release_decode_fp32_pf64" and s["lm_head_table"] == "host/lm_head_fp16.bin"
    assert s["licence"] == ["LICENSE", "NOTICE"]
    assert (dist / "NOTICE").read_bytes() == (whole_dist["release"] / "NOTICE").read_bytes()
    names = [line.split("  ", 1)[1] for line in (dist / "SHA256SUMS").read_text().splitlines()]
    for want in (f"{backbone}/metadata.json", f"{backbone}/{backbone}.aimodel/main.mlirb", f"{backbone}/tokenizer/tokenizer.json",
                 f"{head}/metadata.json", "host/lm_head_fp16.bin", "host/lm_head_fp16.json", "LICENSE", "NOTICE"):
        assert want in names, want
    assert not [n for n in names if any(part.startswith(".") for part in n.split("/"))], names
    assert sorted(p.relative_to(dist).as_posix() for p in dist.rglob("*") if p.is_file()) == sorted([*names, "SHA256SUMS"])
    assert json.loads((dist / backbone / "build-record.json").read_text())["verify"]["ok"] is True
    assert subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=dist).returncode == 0


def test_hub_pins_fetch_the_backbone_and_build_from_the_cache(releases, tmp_path):
    """pin a Hub commit (loopback fake Hub) -> fetch --backbone (config, index, every shard,
    tokenizer) -> build offline from the cache; without --backbone the shards are not fetched."""
    from .fakehub import FakeHub
    from .test_fetch import run_cli

    rel, revision = releases["other"], "1" * 40
    with FakeHub("someone/other-release", revision, rel) as hub:
        pins = tmp_path / "pins.json"
        r, _ = run_cli(["pin", "someone/other-release", "--revision", revision, "--out", pins], hub.endpoint, tmp_path / "hf")
        assert r.returncode == 0, r.stderr[-1500:]
        pinned = json.loads(pins.read_text())["files"]
        assert "config.json" in pinned and "tokenizer.json" in pinned and sum(f.endswith(".safetensors") for f in pinned) >= 8
        r, _ = run_cli(["fetch", "--pins", pins, "--json"], hub.endpoint, tmp_path / "hf")
        assert r.returncode == 0, r.stderr[-1500:]
        assert not (Path(json.loads(r.stdout)["folder"]) / "config.json").exists()
        r, _ = run_cli(["fetch", "--pins", pins, "--backbone", "--json"], hub.endpoint, tmp_path / "hf")
        assert r.returncode == 0, r.stderr[-1500:]
        folder = Path(json.loads(r.stdout)["folder"])
        assert all((folder / f).is_file() for f in pinned)
    r, _ = run_cli(["build", _recipe(tmp_path, "fp32"), "--pins", pins, "--out", tmp_path / "out", "--json"], None,
                   tmp_path / "hf", offline=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout)
    assert m["source"]["hf_id"] == "someone/other-release" and m["source"]["revision"] == revision
    assert json.loads((tmp_path / "out" / m["name"] / "build-record.json").read_text())["verify"]["ok"] is True


def test_out_of_fp16_range_is_refused_unscaled_and_fits_scaled(tmp_path):
    """A bf16 value beyond 65504: fp16 compute refuses the tensor by name; fp32 compute stores it
    scaled by 2**-k (k negative) and gets the value back exactly."""
    import torch
    from safetensors.torch import save_file

    from clef_flash.engine.streamed_weights import load_weights
    from clef_flash.errors import IntegrityError

    w = torch.full((4, 8), 0.25)
    w[1, 3] = 1.0e5
    w[2, 5] = 3.0e-6  # an fp16 subnormal unscaled
    save_file({"m.weight": w.to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    want = w.to(torch.bfloat16).float().numpy()
    with pytest.raises(IntegrityError, match=r"model.safetensors: m.weight has values beyond fp16's range"):
        load_weights(tmp_path, {"m.weight": (4, 8)}, tmp_path)
    scaled = load_weights(tmp_path, {"m.weight": (4, 8)}, tmp_path, scaled=True)
    k = scaled.exponents["m.weight"]
    assert k < 0
    got = np.ldexp(scaled.arrays["m.weight"].astype(np.float32), -k)
    small = np.zeros_like(got, dtype=bool)
    small[2, 5] = True  # 2**-17 of the tensor's maximum: below fp16's normal range even scaled, rounded
    np.testing.assert_array_equal(got[~small], want[~small])
    assert abs(got[2, 5] - want[2, 5]) < 2.0 ** -24 * 2.0 ** -k


def test_the_wide_writer_writes_readable_shards(tmp_path):
    """The real-width writer's pieces at small shapes: the 9B configuration sliced, shards cut by
    size, a streamed safetensors file that safetensors reads back with the declared shapes."""
    from safetensors import safe_open

    from clef_flash.synth import wide as synth
    from clef_flash.errors import UsageError

    text = synth.text_config("9b", 4)
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and text["num_hidden_layers"] == 4
    assert synth.text_config("9b")["num_hidden_layers"] == 32
    with pytest.raises(UsageError, match="--layers"):
        synth.text_config("9b", 33)
    with pytest.raises(UsageError, match="--size"):
        synth.text_config("27b")
    shapes = {"a.weight": (64, 32), "b.A_log": (8,), "c.conv1d.weight": (16, 1, 4), "d.norm.weight": (32,)}
    shards = synth._plan_shards(shapes)
    assert [n for s in shards for n in s] == list(shapes)
    synth._write_shard(tmp_path / "s.safetensors", list(shapes), shapes, np.random.default_rng(0))
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        for name, shape in shapes.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == shape and str(t.dtype) == "torch.bfloat16"
        assert 0.01 < float(f.get_tensor("a.weight").float().std()) < 0.03
        assert float(f.get_tensor("b.A_log").float().min()) >= 0.0


def test_too_little_disk_is_refused_before_any_work(releases, tmp_path, monkeypatch):
    """The plan needs main.mlirb (the fp16 weights once: the large tensors go straight into it) and,
    where the numeric gate runs, the runtime's compiled fp32 copy, plus a margin; one byte less is
    refused, naming the folder. Without the gate the need is the fp16 bytes and the margin."""
    import shutil

    from clef_flash.build.backbone import MARGIN, disk_need
    from clef_flash.backbone.contract import weight_names
    from clef_flash.backbone.source import release_config
    from clef_flash.engine.streamed_weights import locate, scratch_bytes

    rel = releases["tiny"]
    fp16 = scratch_bytes(locate(rel, weight_names(release_config(rel))))
    assert disk_need(fp16, True) == 3 * fp16 + MARGIN and disk_need(fp16, False) == fp16 + MARGIN
    for extra, need in (([], disk_need(fp16, True)), (["--no-verify"], disk_need(fp16, False))):
        args = ["build", str(_recipe(tmp_path, "fp16")), "--source", str(rel), "--out", str(tmp_path / "out"),
                "--dry-run", *extra]
        monkeypatch.setattr(shutil, "disk_usage", lambda p, n=need: shutil._ntuple_diskusage(1 << 40, 0, n - 1))
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "not enough free space for the backbone build" in res.output and f"{need:,}" in res.output
        assert not (tmp_path / "out").exists()
        monkeypatch.setattr(shutil, "disk_usage", lambda p, n=need: shutil._ntuple_diskusage(1 << 40, 0, n))
        assert runner.invoke(app, args).exit_code == 0


def test_constants_from_buffers_write_the_converters_bytes(tmp_path):
    """The converter's temporary copies are skipped by handing it the mapped arrays as resources
    (private coreai-torch API), and a streamed tensor is declared by a placeholder that
    ``mlirb.inflate`` fills while writing main.mlirb: both must stay byte for byte what the
    converter's own path writes, for large (run-time cast) and small (folded) fp16 constants; an
    fp32 constant keeps its own path. Two streamed tensors must not be merged by the compiler."""
    import torch
    from coreai.runtime import AIModelAssetMetadata
    from coreai_torch import TorchConverter, get_decomp_table

    from clef_flash.formats.aimodel import deterministic_naming, save, save_streamed
    from clef_flash.engine.converter import constants_from_buffers
    from clef_flash.digest import sha256_file
    from clef_flash.formats.mlirb import BytecodeError, Fill, digests, inflate

    gen = torch.Generator().manual_seed(0)
    big, big2 = ((0.02 * torch.randn(512, 1024, generator=gen)).half() for _ in range(2))
    small = (0.02 * torch.randn(64, 512, generator=gen)).half()
    bias = torch.randn(64, generator=gen)

    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.nn.functional.linear(x, big.float()) + torch.nn.functional.linear(x, big2.float())
            return torch.nn.functional.linear(y, small.float()) + bias

    ep = torch.export.export(M(), (torch.randn(1, 8, 1024),)).run_decompositions(get_decomp_table())

    def convert(route: str):
        conv = TorchConverter(mode=TorchConverter.Mode.RELEASE)
        conv.add_exported_program(ep, input_names=["x"], output_names=["y"], entrypoint_name="main")
        streamed = {t.data_ptr(): (n, t.numel() * 2) for n, t in (("big", big), ("big2", big2))} if route == "streamed" else None
        with deterministic_naming(), (constants_from_buffers(streamed) if route != "own" else __import__("contextlib").nullcontext()) as made:
            return conv.to_coreai(), made

    desc = {"author": "t", "license": "t", "description": "t"}
    for route in ("own", "buffers"):
        prog, made = convert(route)
        save(prog, tmp_path / f"{route}.aimodel", desc)
    assert made.count == 3 and not made.streamed
    prog, made = convert("streamed")
    assert sorted(w for w, _ in made.streamed.values()) == ["big", "big2"]
    tensors = {"big": big, "big2": big2}

    def supply(tag):  # in two pieces: each read before the one after the next is asked for
        data = memoryview(tensors[made.streamed[tag][0]].numpy()).cast("B")
        yield data[:1000]
        yield data[1000:]

    sizes = {tag: n for tag, (_, n) in made.streamed.items()}
    written = save(prog, tmp_path / "streamed.aimodel", desc, fill=Fill(sizes, supply))
    want = sha256_file(tmp_path / "own.aimodel" / "main.mlirb")
    assert sha256_file(tmp_path / "buffers.aimodel" / "main.mlirb") == want
    assert sha256_file(tmp_path / "streamed.aimodel" / "main.mlirb") == want
    # what the inflating save hashed as it wrote is the file's (the build's gate relies on it)
    assert written.sha256 == want and list(written.blobs) == [h for _, h in digests(tmp_path / "streamed.aimodel" / "main.mlirb")[1]]
    assert sorted(written.waits) == ["hashes", "supply", "write"] and min(written.waits.values()) >= 0  # the log's timings
    assert (tmp_path / "streamed.aimodel" / "main.hash").read_bytes().hex() == want
    assert not (tmp_path / "streamed.aimodel" / "main.mlirb.part").exists()
    # a placeholder the file does not hold, and a supply one byte short, are errors
    save_streamed(prog, tmp_path / "small.aimodel", AIModelAssetMetadata(), write_hash=False)
    small_file = tmp_path / "small.aimodel" / "main.mlirb"
    with pytest.raises(BytecodeError, match="placeholder"):
        inflate(small_file, tmp_path / "x.mlirb", {**sizes, b"clef-fil" + bytes(8): 2}, supply)
    with pytest.raises(BytecodeError, match="got 1048575 bytes, 1048576 declared"):
        inflate(small_file, tmp_path / "y.mlirb", sizes, lambda tag: [memoryview(big.numpy()).cast("B")[:-1]])


@pytest.mark.parametrize("compute,image_rows", [("fp32", 0), ("fp16", 16)])
def test_one_lowered_trace_is_the_two_public_passes_byte_for_byte(releases, tmp_path, monkeypatch, compute, image_rows):
    """The export traces once with coreai-torch's decompositions (torch's private aot-dispatch export,
    ``engine.lowered.export_aten``) instead of ``torch.export.export`` + ``run_decompositions``: the asset must be
    the two passes' byte for byte, text-only and with image rows, and the one trace must be what ran."""
    import functools

    from torch.export import _trace

    from clef_flash.backbone import export as E
    from clef_flash.backbone.contract import read_text_config
    from clef_flash.digest import sha256_file
    from clef_flash.engine import lowered as tracing

    cfg = read_text_config(releases["tiny"])
    traced: list[bool] = []
    plain_export = _trace._export

    @functools.wraps(plain_export)  # its signature too: export_lowered checks it
    def export(*a, **k):
        traced.append(k.get("pre_dispatch"))
        return plain_export(*a, **k)

    monkeypatch.setattr(_trace, "_export", export)
    digests = {}
    for route in ("one", "two"):
        if route == "two":
            monkeypatch.setattr(tracing, "_one_pass_api", lambda: None)
        traced.clear()
        job = {"source": str(releases["tiny"]), "asset_dir": str(tmp_path / route / "a.aimodel"), "text_config": cfg.as_dict(),
               "chunk": 16, "context": 128, "image_rows": image_rows, "compute": compute,
               "description": {"author": "t", "license": "t", "description": "t"}}
        (tmp_path / route).mkdir()
        E.export_job(job, lambda m: None)
        digests[route] = sha256_file(tmp_path / route / "a.aimodel" / "main.mlirb")
        assert traced == ([False] if route == "one" else [True]), route  # torch.export.export: pre_dispatch=True
    assert digests["one"] == digests["two"]


def test_streamed_weights_are_the_converted_tensors_in_blocks(releases, tmp_path, monkeypatch):
    """``Fp16Weights(streamed=True)`` converts large tensors only when asked, in row blocks from two
    buffers in turn: each block stays intact while the next is converted, and the blocks are the
    tensor's fp16 bytes (scaled by 2**k for fp32 compute), the same as the eager conversion."""
    from clef_flash.engine import streamed_weights as wmod
    from clef_flash.backbone.contract import weight_names
    from clef_flash.backbone.source import release_config

    rel = releases["other"]
    names = weight_names(release_config(rel))
    for scaled in (False, True):
        eager = wmod.load_weights(rel, names, tmp_path, scaled=scaled)
        monkeypatch.setattr(wmod, "FOLD_MAX_VALUES", 100)  # the tiny release's tensors count as large
        lazy = wmod.load_weights(rel, names, tmp_path, scaled=scaled, streamed=True)
        assert lazy.streamed and lazy.exponents == eager.exponents
        for name in lazy.streamed:
            want = eager.arrays[name].tobytes()
            assert not lazy.arrays[name].any(), "a streamed tensor's view is a hole of the scratch file until written"
            got, prev = b"", None
            for block in lazy.stream(name, block_bytes=256):
                if prev is not None:
                    assert bytes(prev[0]) == prev[1], "a block changed while the next one was converted"
                prev = (block, bytes(block))
                got += bytes(block)
            assert got == want, name
        eager.close()
        lazy.close()


def test_a_killed_build_leaves_no_worker_and_the_rerun_lands_clean(releases, tmp_path):
    """SIGKILL of the build command while its export worker runs: the worker dies with it (its
    unlinked scratch file with it), and the next build sweeps the staged folder and lands alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    exe = Path(sys.executable).parent / "clef-export"
    out = tmp_path / "out"
    args = [str(exe), "build", str(_recipe(tmp_path, "fp32")), "--source", str(releases["tiny"]), "--out", str(out),
            "--no-verify"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    deadline = time.monotonic() + 120
    while worker is None and time.monotonic() < deadline:  # the worker's pid, once it has started
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:  # a thread listed a moment ago may have ended since
                kids = Path(f"/proc/{proc.pid}/task/{tid}/children").read_text().split()
            except FileNotFoundError:
                continue
            worker = int(kids[0]) if kids else worker
        time.sleep(0.05)
    assert worker is not None, "the export worker never started"
    time.sleep(3)  # inside its work (imports, weights, trace)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        try:  # a zombie counts as dead; one reaped between the two looks is gone
            if Path(f"/proc/{worker}/status").read_text().find("State:\tZ") >= 0:
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the worker outlived the killed build")
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name], "the killed build's staged folder is there to sweep"
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".lock")) == ["tiny_release_decode_fp32_pf16"]


@pytest.mark.parametrize("child", ["export worker", "bytes made ahead"])
def test_the_worker_dies_with_its_parent_even_when_silent(tmp_path, child):
    """PR_SET_PDEATHSIG: a worker in a long native call writes nothing for minutes, so a broken pipe
    would not stop it; the kernel does when its parent is killed. The same for the process that
    makes a compressed build's bytes ahead of the save (its parent: the export worker)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from clef_flash.engine.codes_ahead import PARENT_ENV as AHEAD_ENV
    from clef_flash.build.process import PARENT_ENV as WORKER_ENV

    env_name = WORKER_ENV if child == "export worker" else AHEAD_ENV
    pid_file = tmp_path / "child.pid"
    (tmp_path / "child.py").write_text(
        "import os, sys, time\n"
        "from clef_flash.interrupts import die_with_parent\n"
        f"die_with_parent({env_name!r})\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n")
    (tmp_path / "middle.py").write_text(
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, {env_name!r}: str(os.getpid())}}\n"
        f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}], env=env)\n"
        "time.sleep(120)\n")
    middle = str(tmp_path / "middle.py")
    proc = subprocess.Popen([sys.executable, middle])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        try:  # a zombie counts as dead; one reaped between the looks is gone
            if "State:\tZ" in Path(f"/proc/{child}/status").read_text():
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the silent worker outlived its killed parent")


def test_a_killed_verify_strands_no_compiled_copy(built, releases, tmp_path):
    """The runtime compiles the asset into a temporary folder before it runs it (7.5 GB at a
    real-width slice). SIGTERM unwinds and removes it (exit 130); after a SIGKILL the next run of
    the runtime sweeps the folder of the process that is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from clef_flash.tmpdirs import PREFIX, owned_tempdir

    exe = Path(sys.executable).parent / "clef-export"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}

    def start_and_wait_for_the_compiled_copy():
        proc = subprocess.Popen([str(exe), "verify", str(built["tiny32"]), "--source", str(releases["tiny"])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 300
        while not list(tmp.glob(f"{PREFIX}*/*.aimodelx")) and time.monotonic() < deadline:
            assert proc.poll() is None, "verify ended before the runtime compiled the asset"
            time.sleep(0.05)
        assert list(tmp.glob(f"{PREFIX}*/*.aimodelx")), "the runtime's folder never appeared"
        return proc

    proc = start_and_wait_for_the_compiled_copy()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert not list(tmp.iterdir())

    proc = start_and_wait_for_the_compiled_copy()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stranded = list(tmp.glob(f"{PREFIX}{proc.pid}-*"))
    assert stranded, "SIGKILL leaves the folder for the next run to sweep"
    with owned_tempdir(tmp) as mine:
        assert not any(p.exists() for p in stranded) and mine.exists()
    assert not list(tmp.iterdir())


def _delta_rule_stepwise(q, k, v, beta, log_decay, state):
    """The gated delta rule token by token, as its definition reads (the reference of the closed form)."""
    import torch

    outs = []
    for t in range(q.shape[1]):
        k_t = k[:, t].unsqueeze(-2)
        state = state * log_decay[:, t, :, None, None].exp()
        delta = (v[:, t] - torch.matmul(k_t, state).squeeze(-2)) * beta[:, t, :, None]
        state = state + k_t.transpose(-1, -2) * delta.unsqueeze(-2)
        outs.append(torch.matmul(q[:, t].unsqueeze(-2), state).squeeze(-2))
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("chunk", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("case", ["random", "correlated keys", "strong decay", "beta near 1"])
def test_the_closed_form_delta_rule_is_the_recurrence(chunk, case):
    """``delta_rule_chunk`` (one triangular inverse for the chunk) computes the token-by-token
    recurrence: in fp64 to rounding, in fp32 within 1e-5 of the outputs' scale; chunks that are not
    a power of two are padded. A non-causal mask (later tokens seen) fails."""
    import torch

    from clef_flash.backbone.graph import delta_rule_chunk, delta_rule_constants

    g = torch.Generator().manual_seed(chunk)
    H, dk, dv = 4, 16, 8
    d = torch.float64
    q = torch.randn(1, chunk, H, dk, generator=g, dtype=d)
    k = torch.randn(1, chunk, H, dk, generator=g, dtype=d)
    if case == "correlated keys":
        k = torch.randn(1, 1, H, dk, generator=g, dtype=d) + 0.05 * k
    k, q = k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True) / dk ** 0.5
    v = torch.randn(1, chunk, H, dv, generator=g, dtype=d)
    beta = torch.full((1, chunk, H), 0.999, dtype=d) if case == "beta near 1" else torch.rand(1, chunk, H, generator=g, dtype=d)
    log_decay = -torch.rand(1, chunk, H, generator=g, dtype=d) * (20.0 if case == "strong decay" else 0.1)
    s0 = torch.randn(1, H, dk, dv, generator=g, dtype=d)
    want_o, want_s = _delta_rule_stepwise(q, k, v, beta, log_decay, s0)
    c64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in delta_rule_constants(chunk).items()}
    o, s = delta_rule_chunk(q, k, v, beta, log_decay, s0, c64)
    assert (o - want_o).abs().max() < 1e-12 and (s - want_s).abs().max() < 1e-12
    o32, s32 = delta_rule_chunk(*(t.float() for t in (q, k, v, beta, log_decay, s0)))
    assert (o32.double() - want_o).abs().max() <= 1e-5 * want_o.abs().max()
    assert (s32.double() - want_s).abs().max() <= 1e-5 * want_s.abs().max()
    if chunk > 1:
        c64["lower"] = torch.ones_like(c64["lower"])  # every token sees the whole chunk: not the recurrence
        bad, _ = delta_rule_chunk(q, k, v, beta, log_decay, s0, c64)
        assert (bad - want_o).abs().max() > 1e-3 * want_o.abs().max()


def test_the_direct_writer_writes_the_bytes_it_is_given(tmp_path):
    """``mlirb.inflate``'s writer: pieces of any size through one aligned buffer, ``O_DIRECT`` where
    the file system takes it (this disk), buffered where it does not (a tmpfs); the file is exactly
    the bytes written, the padded last block cut back."""
    import os

    from clef_flash.formats.mlirb import _DirectWriter

    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 4095, (8 << 20) + 3, 10, 0, 4096)]
    folders = [tmp_path] + ([Path("/dev/shm")] if Path("/dev/shm").is_dir() else [])
    for folder in folders:
        path = folder / f"clef-direct-{os.getpid()}.bin"
        w = _DirectWriter(path)
        try:
            for p in pieces:
                w.write(p)
        finally:
            w.close()
        try:
            assert path.read_bytes() == b"".join(pieces), folder
        finally:
            path.unlink()
        if folder == tmp_path and hasattr(os, "O_DIRECT"):
            assert w.direct, "this disk takes O_DIRECT"
