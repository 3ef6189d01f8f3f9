"""The vision tower (issue 30): the host's preprocessing (numpy + Pillow) bit for bit against
transformers' image processor, the grid-derived tensors against transformers' own helpers, the
tower graph against ``Qwen3_5VisionModel``, and the tiny release's tower built (one static
function per bucket) and gated through the Core AI runtime, with the gate shown to fail on a broken
patch order, broken positions, a blind red arm and a changed weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "conversion" / "vision_fp16w32.toml"
runner = CliRunner()


@pytest.fixture(scope="module")
def release(tmp_path_factory, author_code) -> Path:
    from clef_flash.head.synth import MAKE_TINY_HEAD, write_release
    from clef_flash.sources.pinning import pin_local

    rel = write_release(tmp_path_factory.mktemp("vision-release") / "tiny_release", config_name=MAKE_TINY_HEAD,
                        seed=0, author_code=author_code, backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    return rel


@pytest.fixture(scope="module")
def pre(release):
    from clef_flash.vision.contract import read_preprocessing, read_vision_config

    return read_preprocessing(release, read_vision_config(release))


@pytest.fixture(scope="module")
def built(release, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vision-builds")
    res = runner.invoke(app, ["build", str(RECIPE), "--source", str(release), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    return out / json.loads(res.stdout)["name"]


def _image(w: int, h: int, seed: int = 0, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng([seed, w, h])
    # smooth gradients plus noise: a resize of pure noise would hide an off-by-one in the grid
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 127 // max(w + h, 1))], -1)
    arr = np.clip(base + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr)
    if mode == "RGBA":
        im = im.convert("RGBA")
        im.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
    return im


# ---------------------------------------------------------------- host, no asset


@pytest.mark.parametrize("w,h", [(640, 480), (333, 97), (256, 256), (1280, 720), (100, 700), (5000, 40), (31, 29)])
def test_preprocessing_equals_transformers_bit_for_bit(release, pre, w, h):
    from clef_flash.gate.vision import processor_patches
    from clef_flash.vision.preprocess import pixel_patches

    im = _image(w, h)
    got, grid = pixel_patches(im, pre)
    want = processor_patches(release, im)
    assert got.dtype == want.dtype == np.float32
    assert got.shape == want.shape == (grid.patches, 1536)
    assert np.array_equal(got, want)
    assert grid.tokens * 4 == grid.patches and grid.tokens >= pre.min_tokens


def test_image_files_open_as_transformers_loads_them(release, pre, tmp_path):
    """A PNG with alpha and a JPEG with an EXIF rotation: opened, oriented and made RGB as
    transformers' load_image does, then the same patches."""
    from PIL import Image
    from transformers.image_utils import load_image

    from clef_flash.gate.vision import processor_patches
    from clef_flash.vision.preprocess import open_image, pixel_patches

    png = tmp_path / "a.png"
    _image(300, 200, mode="RGBA").save(png)
    jpg = tmp_path / "b.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the upright image is 200 wide, 300 high
    _image(300, 200, seed=1).save(jpg, exif=exif.tobytes(), quality=90)
    for path in (png, jpg):
        ours, theirs = open_image(path), load_image(str(path))
        assert ours.size == theirs.size and np.array_equal(np.asarray(ours), np.asarray(theirs))
        assert np.array_equal(pixel_patches(ours, pre)[0], processor_patches(release, theirs))
    assert open_image(jpg).size == (200, 300)


def test_bad_image_files_are_refused_naming_the_file(tmp_path):
    from clef_flash.errors import UsageError
    from clef_flash.vision.preprocess import open_image

    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"hello")
    with pytest.raises(UsageError, match="not-an-image.png: not an image"):
        open_image(bad)
    with pytest.raises(UsageError, match="missing.png: image not found"):
        open_image(tmp_path / "missing.png")


def test_smart_resize_bounds_and_caps(pre):
    from clef_flash.vision.preprocess import smart_resize, target_grid

    assert target_grid(640, 480, pre).tokens == 300  # the processor's own figures
    assert target_grid(1920, 1080, pre).tokens == 2040
    assert target_grid(448, 448, pre).tokens == 196
    assert target_grid(10, 10, pre).tokens == 64  # scaled up to min_pixels
    assert target_grid(1920, 1080, pre, max_pixels=1024 * 32 * 32).tokens <= 1024  # media_kwargs' bound
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 32, 1, 1 << 30)


def test_grid_tensors_equal_transformers_helpers(release):
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    from clef_flash.vision.contract import read_vision_config
    from clef_flash.vision.host import block_order, position_taps
    from clef_flash.vision.preprocess import Grid

    cfg = read_vision_config(release)
    for rows, cols, side in ((10, 30, cfg.side), (44, 6, 48), (2, 2, 48), (68, 120, 48)):
        g = Grid(rows, cols, 2)
        thw = torch.tensor([[1, rows, cols]])
        idx, w = get_vision_interpolation_indices_and_weights(thw, side, mode="bilinear", align_corners=True,
                                                              spatial_merge_size=2)
        ours_idx, ours_w = position_taps(g, side)
        assert np.array_equal(ours_idx, idx.numpy()) and np.array_equal(ours_w, w.numpy())
        r, c = block_order(g)
        assert np.array_equal(np.stack([r, c], -1), get_vision_position_ids(thw, 2).numpy())


def test_tower_graph_equals_transformers_with_padding(release, pre):
    """The graph on padded buckets gives transformers' rows, whatever the padding holds (the mask)."""
    import torch

    from clef_flash.gate.vision import reference_tower
    from clef_flash.backbone.weights import locate
    from clef_flash.vision.contract import INPUT_ORDER, read_vision_config, weight_names
    from clef_flash.vision.graph import VisionTower
    from clef_flash.vision.host import image_rows, tower_inputs
    from clef_flash.vision.preprocess import pixel_patches

    cfg = read_vision_config(release)
    infos = locate(release, weight_names(cfg))
    ref = reference_tower(release, infos)
    tower = VisionTower(cfg, {n: p.detach().clone() for n, p in
                              ((f"model.visual.{k}", v) for k, v in ref.state_dict().items())
                              if n in infos}, "fp32")
    for w, h, bucket in ((333, 97, 256), (100, 700, 256), (640, 480, 1024)):
        px, grid = pixel_patches(_image(w, h), pre)
        call = tower_inputs(px, grid, cfg, bucket)
        with torch.no_grad():
            want = ref(torch.from_numpy(px), torch.tensor([[1, grid.rows, grid.cols]])).pooler_output.numpy()
            got = image_rows(tower(*[torch.from_numpy(call.inputs[k]) for k in INPUT_ORDER]).numpy(), call)
            call.inputs["patches"][grid.patches:] = 7.0  # the padding changes nothing the image reads
            again = image_rows(tower(*[torch.from_numpy(call.inputs[k]) for k in INPUT_ORDER]).numpy(), call)
        assert got.shape == want.shape == (grid.tokens, cfg.out_hidden_size)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
        assert np.array_equal(got, again)


def test_bucket_choice_and_cap():
    from clef_flash.vision.host import choose_bucket

    assert choose_bucket(64, (64, 256, 1024)) == 64
    assert choose_bucket(65, (64, 256, 1024)) == 256
    assert choose_bucket(1025, (64, 256, 1024)) is None


# ---------------------------------------------------------------- the asset


def test_build_writes_one_function_per_bucket_and_passes_its_gate(built):
    import jsonschema

    meta = json.loads((built / "metadata.json").read_text())
    schema = json.loads((ROOT / "manifests" / "metadata-vision.schema.json").read_text())
    jsonschema.validate(meta, schema)
    assert meta["kind"] == "vision-tower"
    assert [f["name"] for f in meta["interface"]["functions"]] == ["n64", "n256", "n1024"]
    assert meta["interface"]["cap_tokens"] == 1024
    assert meta["interface"]["functions"][1]["inputs"]["patches"]["shape"] == [1024, 1536]
    assert meta["preprocess"]["min_pixels"] == 65536 and meta["preprocess"]["resample"] == "bicubic"
    assert {"config.json", "preprocessor_config.json", "model.safetensors"} <= set(meta["source"]["files"])
    record = json.loads((built / "build-record.json").read_text())
    v = record["verify"]
    assert v["ok"] and set(v["images"]) and v["red"]["raster_order"] > 0.1
    assert max(i["rel_max_abs_d"] for i in v["images"].values()) < 1e-4
    assert {i["function"] for i in v["images"].values()} == {"n64", "n256", "n1024"}


def test_verify_reruns_the_gate(built, release):
    res = runner.invoke(app, ["verify", str(built), "--source", str(release), "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    out = json.loads(res.stdout)  # the transcript
    arms = {i["arm"]: i["rel_max_abs_d"] for i in out["images"]}
    assert out["ok"] and arms["raster_order"] > 0.1 and arms["main"] < 1e-4


def _verify(built, release, **kw):
    from clef_flash.gate.vision import VisionVerifyConfig, verify_vision

    return verify_vision(VisionVerifyConfig(bundle=built, source=release, pins_path=release / "pins.json", **kw))


def test_gate_fails_on_swapped_positions(built, release, monkeypatch):
    """The host's rotary positions with row and column swapped: the images fail their bar."""
    import clef_flash.vision.host as host

    real = host.block_order
    monkeypatch.setattr(host, "block_order", lambda g: real(g)[::-1])
    report = _verify(built, release, red=False)
    assert not report.ok and any(f.startswith("image ") for f in report.failures), report.failures


def test_gate_fails_on_broken_position_table(built, release, monkeypatch):
    """The bilinear taps one row off: the images fail their bar."""
    import clef_flash.vision.host as host

    real = host.position_taps
    monkeypatch.setattr(host, "position_taps", lambda g, side: (np.clip(real(g, side)[0] + side, 0, side * side - 1),
                                                                real(g, side)[1]))
    report = _verify(built, release, red=False)
    assert not report.ok and any(f.startswith("image ") for f in report.failures), report.failures


def test_gate_fails_when_its_red_arm_is_blind(built, release, monkeypatch):
    import clef_flash.gate.vision as gate

    monkeypatch.setattr(gate, "raster_order", lambda patches, grid: patches)
    report = _verify(built, release)
    assert any("red arm raster_order" in f and "passes the bar" in f for f in report.failures), report.failures


def test_a_changed_weight_fails_naming_main_mlirb(built, release, tmp_path):
    copy = tmp_path / built.name
    shutil.copytree(built, copy)
    mlirb = next(copy.glob("*.aimodel")) / "main.mlirb"
    data = bytearray(mlirb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    mlirb.write_bytes(bytes(data))
    res = runner.invoke(app, ["verify", str(copy), "--source", str(release)])
    assert res.exit_code == 3 and "main.mlirb" in res.output


@pytest.mark.parametrize("breakage,match", [
    ("no-preprocessor", "preprocessor_config.json: missing"),
    ("no-vision-config", "no vision_config"),
    ("patch-mismatch", "differ from the tower's"),
])
def test_bad_releases_are_refused_before_work(release, tmp_path, breakage, match):
    from clef_flash.sources.pinning import pin_local

    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    if breakage == "no-preprocessor":
        (rel / "preprocessor_config.json").unlink()
    elif breakage == "no-vision-config":
        conf = json.loads((rel / "config.json").read_text())
        conf.pop("vision_config")
        (rel / "config.json").write_text(json.dumps(conf))
    else:
        pp = json.loads((rel / "preprocessor_config.json").read_text())
        pp["patch_size"] = 14
        (rel / "preprocessor_config.json").write_text(json.dumps(pp))
    pin_local(rel, name="tiny_release", overwrite=True)
    res = runner.invoke(app, ["build", str(RECIPE), "--source", str(rel), "--out", str(tmp_path / "out")])
    assert res.exit_code == 3, res.output
    assert match in res.output
    assert not (tmp_path / "out" / "tiny_release_vision_fp16w32").exists()


def test_vision_schema_is_checked_in():
    from clef_flash.vision.manifest import json_schema

    checked_in = json.loads((ROOT / "manifests" / "metadata-vision.schema.json").read_text())
    assert checked_in == json_schema(), "run `clef-export schema --kind vision > manifests/metadata-vision.schema.json`"
