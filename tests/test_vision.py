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
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release
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
    from clef_flash.engine.streamed_weights import locate
    from clef_flash.vision.contract import INPUT_ORDER, read_vision_config, weight_names
    from clef_flash.vision.graph import VisionTower
    from clef_flash.vision.host import image_rows, tower_inputs
    from clef_flash.vision.preprocess import pixel_patches

    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    cfg = read_vision_config(release)
    infos = locate(release, weight_names(cfg))
    ref = reference_tower(release, infos)  # one block's weights at a time
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        weights = {n: f.get_tensor(n).float() for n in infos}
    tower = VisionTower(cfg, weights, "fp32")
    whole = Qwen3_5VisionModel._from_config(AutoConfig.from_pretrained(release).vision_config, dtype=torch.float32).eval()
    whole.load_state_dict({n[len("model.visual."):]: t for n, t in weights.items()}, strict=True)
    for w, h, bucket in ((333, 97, 256), (100, 700, 256), (640, 480, 1024)):
        px, grid = pixel_patches(_image(w, h), pre)
        call = tower_inputs(px, grid, cfg, bucket)
        with torch.no_grad():
            thw = torch.tensor([[1, grid.rows, grid.cols]])
            want = ref(torch.from_numpy(px), thw).pooler_output.numpy()
            assert np.array_equal(want, whole(torch.from_numpy(px), thw).pooler_output.numpy())  # streamed = whole
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


def test_a_bucket_no_record_can_hold_is_refused_by_the_dry_run(tmp_path):
    """A bucket of more vision tokens than a record holds can never be called: refused (exit 2,
    naming the recipe) before the release is read, by ``build --dry-run`` too."""
    recipe = tmp_path / "vision_huge.toml"
    recipe.write_text('model = "vision"\nname = "{release}_vision_huge"\nbuckets = [64, 1000000]\n')
    res = runner.invoke(app, ["build", str(recipe), "--source", str(tmp_path / "nowhere"), "--dry-run"])
    assert res.exit_code == 2 and "vision_huge.toml" in res.output and "cannot fit a record" in res.output, res.output


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


# ---------------------------------------------------------------- the decoder's image inputs


def _image_case(cfg, rng, start=6, grid=(3, 5), length=40):
    from clef_flash.backbone.host import ImageSpan

    n = grid[0] * grid[1]
    ids = rng.integers(0, 256, length)
    rows = (0.5 * rng.standard_normal((n, cfg.hidden_size))).astype(np.float32)
    return ids, ImageSpan(start=start, rows=rows, grid=grid)


def _run_chunks(model, cfg, ch, ids, extra):
    import torch

    from clef_flash.backbone.graph import zero_states
    from clef_flash.backbone.host import chunk_inputs
    from clef_flash.backbone.contract import input_order

    states = zero_states(cfg, ch)
    out = []
    for inputs in chunk_inputs(ids, ch.chunk, ch.context, cfg.pad_token_id, extra=extra):
        args = [torch.from_numpy(np.ascontiguousarray(inputs[k])) for k in input_order(ch)]
        with torch.no_grad():
            out.append(model(*args, *states.values())[0].numpy())
    return np.concatenate(out)[: len(ids)]


@pytest.fixture(scope="module")
def decoders(release, tmp_path_factory):
    from clef_flash.backbone.contract import Chunking
    from clef_flash.backbone.source import release_config
    from clef_flash.backbone.graph import DecoderChunk, ImageDecoderChunk, weight_names
    from clef_flash.engine.streamed_weights import load_weights

    cfg = release_config(release)
    w = load_weights(release, weight_names(cfg), tmp_path_factory.mktemp("scratch")).tensors()
    ch = Chunking(16, 128, 32)
    return cfg, ch, DecoderChunk(cfg, Chunking(16, 128), w, "fp32"), ImageDecoderChunk(cfg, ch, w, "fp32")


def test_image_decoder_with_text_values_is_the_text_decoder_bit_for_bit(decoders):
    from clef_flash.backbone.host import image_inputs

    cfg, ch, text, image = decoders
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 40)
    a = _run_chunks(text, cfg, ch.__class__(16, 128), ids, None)
    b = _run_chunks(image, cfg, ch, ids, image_inputs(32, cfg.hidden_size, np.float32))
    assert np.array_equal(a, b)


def test_image_decoder_equals_transformers_multimodal_positions(decoders, release):
    """An image's rows at its tokens, three-axis positions: transformers' text model given the same
    rows as inputs_embeds and the positions of Qwen3_5Model.get_rope_index (the multimodal path)."""
    from clef_flash.backbone.host import image_ids, image_inputs
    from clef_flash.backbone.reference import StreamedTextModel

    cfg, ch, _, image = decoders
    ids, span = _image_case(cfg, np.random.default_rng(4))
    want = StreamedTextModel(release).rows(ids, span)
    got = _run_chunks(image, cfg, ch, image_ids(ids, span, cfg.vocab_size),
                      image_inputs(32, cfg.hidden_size, np.float32, span))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    pos = StreamedTextModel(release).positions(len(ids), span)[:, 0].numpy()
    n, (h, w) = span.tokens, span.grid
    assert pos[:, span.start + n].tolist() == [span.start + max(h, w)] * 3  # text resumes after the image
    assert pos[:, span.start + w].tolist() == [span.start, span.start + 1, span.start]  # token (1, 0)
    for red in ("image_zeroed", "rc_swapped", "shift_dropped"):
        bad = _run_chunks(image, cfg, ch, image_ids(ids, span, cfg.vocab_size),
                          image_inputs(32, cfg.hidden_size, np.float32, span, red))
        assert np.abs(bad - want).max() / np.abs(want).max() > 1e-4, red  # above the fp32 bar


def test_image_inputs_refuse_what_does_not_fit(decoders):
    from clef_flash.backbone.host import ImageSpan, image_ids, image_inputs

    cfg = decoders[0]
    span = ImageSpan(start=30, rows=np.zeros((15, cfg.hidden_size), np.float32), grid=(3, 5))
    with pytest.raises(ValueError, match="more than the decoder's 8 image rows"):
        image_inputs(8, cfg.hidden_size, np.float32, span)
    with pytest.raises(ValueError, match="overrun the record"):
        image_ids(np.zeros(40, np.int64), span, cfg.vocab_size)


def test_backbone_with_image_inputs_builds_and_gates_with_its_image_arms(release, tmp_path):
    recipe = tmp_path / "backbone_img.toml"
    recipe.write_text('model = "backbone"\nname = "{release}_decode_img_pf16"\nchunk = 16\ncontext = 128\n'
                      'weights = "fp16"\ncompute = "fp32"\nimage_rows = 32\n')
    res = runner.invoke(app, ["build", str(recipe), "--source", str(release), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    bundle = tmp_path / "out" / json.loads(res.stdout)["name"]
    meta = json.loads((bundle / "metadata.json").read_text())
    assert meta["interface"]["input_order"] == ["input_ids", "position_ids", "image_embeds", "image_rc",
                                                "rope_shift_start", "rope_shift_amount"]
    assert meta["interface"]["inputs"]["image_embeds"]["shape"] == [32, 64]
    assert meta["interface"]["vision"]["text_values"] == {"rope_shift_start": 1 << 30, "rope_shift_amount": 0}
    v = json.loads((bundle / "build-record.json").read_text())["verify"]
    assert any(n.startswith("image-") for n in v["records"])
    assert {"image_zeroed", "rc_swapped", "shift_dropped"} <= set(v["red"])


def test_image_rows_must_fit_the_context(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('model = "backbone"\nname = "x"\nchunk = 16\ncontext = 32\nimage_rows = 32\n')
    res = runner.invoke(app, ["build", str(recipe), "--dry-run"])
    assert res.exit_code == 2 and "image_rows 32 leave no room" in res.output


# ---------------------------------------------------------------- end to end with images


def _release_with_images(source: Path, tmp_path: Path, monkeypatch):
    """`release` of the head, a backbone with image inputs and the tower: (dist, bundle names)."""
    import sys

    from .conftest import TINY_RECIPE

    backbone = tmp_path / "backbone_img.toml"
    backbone.write_text('model = "backbone"\nname = "{release}_decode_img_pf64"\nchunk = 64\ncontext = 2048\n'
                        'weights = "fp16"\ncompute = "fp32"\nimage_rows = 1024\n')
    monkeypatch.setenv("PATH", "/usr/bin:/bin:" + str(Path(sys.executable).parent))  # no xcrun: AOT skipped
    dist = tmp_path / "dist"
    res = runner.invoke(app, ["release", str(TINY_RECIPE), str(backbone), str(RECIPE), "--source", str(source),
                              "--dist", str(dist), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    return dist, json.loads(res.stdout)["bundles"]


def test_release_and_check_release_with_image_requests(release, tmp_path, monkeypatch):
    """`release` of the head, a backbone with image inputs and the vision tower (each gated), then the
    project's image requests: file -> the host's patches (bit for bit the author's processor's) ->
    the tower asset at the native grid -> the backbone asset's image inputs -> the head asset,
    against the author's systemone with the same images; the image over the cap listed as not
    fitting, the bounded one run; the red arm (the image's rows zeroed) fails."""
    dist, (head, bb, vis) = _release_with_images(release, tmp_path, monkeypatch)
    requests = ROOT / "conversion" / "requests-images.jsonl"
    args = ["check-release", str(release), "--bundle", str(dist / head), "--backbone", str(dist / bb),
            "--vision", str(dist / vis), "--requests", str(requests)]
    res = runner.invoke(app, args + ["--transcript", str(tmp_path / "t.json"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["checked"] == 5 and s["does_not_fit"] == 1 and s["disagreements"] == 0
    assert s["max_abs_dp"] <= 1e-5 and s["bar"] == 1e-5
    im = s["images"]
    assert im["through_vision"] == 5 and im["host_patches_equal"] and im["vision_rel_max_abs_d"] < 1e-4
    assert im["host_prompt_equal"]
    t = json.loads((tmp_path / "t.json").read_text())
    assert [e["id"] for e in t["does_not_fit"]] == ["image-poster-over-cap"]
    assert "exceed the vision asset's cap of 1024" in t["does_not_fit"][0]["why"]
    used = {e["image"]["function"] for e in t["requests"] if "function" in e.get("image", {})}
    assert used == {"n64", "n256", "n1024"}  # several aspect ratios, every bucket
    red = runner.invoke(app, args + ["--red", "image"])
    assert red.exit_code == 4, red.output[-2000:]
    from clef_flash.release.card import model_card, read_dist

    card = model_card(read_dist(dist), t)
    assert f"`{vis}/` (vision-tower)" in card and "patches in raster order" in card
    assert "image requests, max \\|d p\\| at the native grid" in card and "one image of up to 1024 rows" in card


def test_image_requests_are_checked_before_work(tmp_path):
    from clef_flash.errors import UsageError
    from clef_flash.sources.requests import load_requests

    base = {"model": "m", "state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    (tmp_path / "a.png").write_bytes(b"x")
    cases = [({"images": ["a.png", "a.png"]}, "the decoder takes 1 image a request"),
             ({"videos": ["v.mp4"]}, "videos are not supported"),
             ({"images": ["missing.png"]}, "image missing.png not found"),
             ({"images": ["https://example.invalid/a.png"]}, "only local files are read"),
             ({"images": ["a.png"], "media_kwargs": {"fps": 2}}, "media_kwargs may hold")]
    for extra, match in cases:
        f = tmp_path / "r.jsonl"
        f.write_text(json.dumps({**base, **extra}) + "\n")
        with pytest.raises(UsageError, match=match):
            load_requests(f, images=True)
    f.write_text(json.dumps({**base, "images": ["a.png"]}) + "\n")
    with pytest.raises(UsageError, match="text only"):
        load_requests(f)  # plan-weights' calibration records: text only
    (req,) = load_requests(f, images=True)
    assert req.images == ((tmp_path / "a.png").resolve(),) and req.body["images"] == [str((tmp_path / "a.png").resolve())]


def test_a_config_whose_image_token_is_not_the_tokenizers_is_refused(release, tmp_path):
    """The model puts the tower's rows where config.json's image_token_id stands, the processor writes
    the tokenizer's <|image_pad|>: a release where they differ is refused, naming config.json."""
    from clef_flash.sources.pinning import pin_local

    from .conftest import build_bundle

    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    conf = json.loads((rel / "config.json").read_text())
    conf["image_token_id"] = 5
    (rel / "config.json").write_text(json.dumps(conf))
    pin_local(rel, name="tiny_release", overwrite=True)
    head = build_bundle(rel, tmp_path / "head")
    res = runner.invoke(app, ["check-release", str(rel), "--bundle", str(head), "--requests",
                              str(ROOT / "conversion" / "requests-images.jsonl")])
    assert res.exit_code == 3 and "config.json: image_token_id 5 is not the tokenizer's <|image_pad|>" in res.output, res.output[-2000:]


def test_the_hosts_image_prompt_is_the_authors(release, author_module):
    """The text-only prompt with the image's N + 3 tokens inserted after the prefix and every span
    shifted: the author's encode_record with the image, through the assembled processor; a shift
    off by one is seen."""
    from transformers import AutoTokenizer

    from clef_flash.sources.reference import image_text_processor
    from clef_flash.vision.prompt import ImagePrompt, insert_image, shift_span

    tok = AutoTokenizer.from_pretrained(release)
    proc = image_text_processor(release, tok)
    body = json.loads((ROOT / "conversion" / "requests-images.jsonl").read_text().splitlines()[2])
    body["images"] = [str(ROOT / "conversion" / "images" / "receipt-tall.png")]
    theirs = author_module.encode_record(tok, body, processor=proc)
    text = author_module.encode_record(tok, {k: v for k, v in body.items() if k != "images"}, processor=proc)
    n = sum(1 for i in theirs.input_ids if i == proc.image_token_id)
    assert n == 114  # 19 x 6, the receipt's grid
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    at = theirs.media["token_offset"]
    prompt = insert_image(text.input_ids, at, n, start_id=ids["<|vision_start|>"], pad_id=ids["<|image_pad|>"],
                          end_id=ids["<|vision_end|>"], newline=tok("\n", add_special_tokens=False).input_ids)
    assert prompt.ids == tuple(theirs.input_ids) and prompt.shift == n + 3 and prompt.start == at + 1
    for q_text, q_img in zip(text.questions, theirs.questions, strict=True):
        assert shift_span(q_text.question_span, prompt) == q_img.question_span
        assert tuple(shift_span(o, prompt) for o in q_text.option_spans) == q_img.option_spans
    late = ImagePrompt(prompt.ids, prompt.start, prompt.tokens, prompt.shift + 1)
    assert shift_span(text.questions[0].question_span, late) != theirs.questions[0].question_span
    with pytest.raises(ValueError, match="outside the prompt"):
        insert_image([1, 2], 5, 3, start_id=0, pad_id=0, end_id=0, newline=[])


def test_no_tower_call_starts_after_ctrl_c(built, release):
    """A signal during the vision runtime's work: the call in flight returns, no other starts, then
    exit 130 (issue 49 item 5: every image of the gate ran first)."""
    import os
    import signal

    from clef_flash import interrupts
    from clef_flash.vision.contract import read_preprocessing, read_vision_config
    from clef_flash.vision.preprocess import pixel_patches
    from clef_flash.vision.runtime import runner as tower_runner

    vcfg = read_vision_config(release)
    patches, grid = pixel_patches(_image(64, 64), read_preprocessing(release, vcfg))
    asset = next(built.glob("*.aimodel"))
    calls = []

    async def work():
        async with tower_runner(asset, vcfg) as (call, _have):
            for i in range(3):
                calls.append(i)
                await call(patches, grid, 64)
                if i == 0:
                    os.kill(os.getpid(), signal.SIGINT)  # deferred: the runtime's work is under way

    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupts.install()
    try:
        with pytest.raises(interrupts.Interrupt):
            interrupts.run_async(work)
    finally:
        interrupts.clear()
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    assert calls == [0, 1]  # the second was refused before the runtime ran it; no third


# ---------------------------------------------------------------- releases as clef-finetune writes them


def test_a_make_tiny_release_goes_through_every_build_and_check_release_with_images(make_tiny, tmp_path, monkeypatch):
    """A release written by clef-finetune's own make-tiny keeps its image processor's settings in
    processor_config.json (under "image_processor", beside a video processor's), with no
    preprocessor_config.json (issue 48): pinned, head, decoder and vision builds (each gated), then
    check-release with the project's image requests, all passing; the vision manifest carries that
    file's settings, not a default's."""
    rel = make_tiny(0)
    assert (rel / "processor_config.json").is_file() and not (rel / "preprocessor_config.json").exists()
    pins = json.loads((rel / "pins.json").read_text())
    assert "processor_config.json" in pins["files"]
    dist, (head, bb, vis) = _release_with_images(rel, tmp_path, monkeypatch)
    settings = json.loads((rel / "processor_config.json").read_text())["image_processor"]
    pre = json.loads((dist / vis / "metadata.json").read_text())["preprocess"]
    assert pre["max_pixels"] == settings["size"]["longest_edge"] and pre["min_pixels"] == settings["size"]["shortest_edge"]
    assert pre["image_mean"] == settings["image_mean"]
    res = runner.invoke(app, ["check-release", str(rel), "--bundle", str(dist / head), "--backbone", str(dist / bb),
                              "--vision", str(dist / vis), "--requests", str(ROOT / "conversion" / "requests-images.jsonl"),
                              "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["checked"] == 6 and s["disagreements"] == 0 and s["max_abs_dp"] <= s["bar"]
    assert s["images"]["through_vision"] == 6 and s["images"]["host_patches_equal"] and s["images"]["host_prompt_equal"]


@pytest.mark.parametrize("layout", ["preprocessor_config.json", "processor_config.json", "both", "both disagreeing",
                                    "neither", "no image_processor"])
def test_the_image_processor_is_read_from_either_layout(release, tmp_path, layout):
    """The older file where present, transformers 5's otherwise; both present must agree (an error
    naming both); neither, or a processor file without its image part, is refused naming the file."""
    from clef_flash.errors import IntegrityError
    from clef_flash.synth.release import write_processor_settings
    from clef_flash.vision.contract import read_preprocessing, read_vision_config

    folder = tmp_path / "r"
    folder.mkdir()
    shutil.copyfile(release / "config.json", folder / "config.json")
    if layout in ("preprocessor_config.json", "both", "both disagreeing"):
        write_processor_settings(folder, "preprocessor_config.json")
    if layout in ("processor_config.json", "both", "both disagreeing"):
        write_processor_settings(folder, "processor_config.json")
    if layout == "both disagreeing":
        data = json.loads((folder / "processor_config.json").read_text())
        data["image_processor"]["size"]["longest_edge"] = 1003520
        (folder / "processor_config.json").write_text(json.dumps(data))
    if layout == "no image_processor":
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    vcfg = read_vision_config(folder)
    if layout in ("preprocessor_config.json", "processor_config.json", "both"):
        assert read_preprocessing(folder, vcfg) == read_preprocessing(release, vcfg)
        return
    with pytest.raises(IntegrityError) as err:
        read_preprocessing(folder, vcfg)
    says = {"both disagreeing": "preprocessor_config.json and ", "neither": "preprocessor_config.json: missing, and no "
            "processor_config.json", "no image_processor": "processor_config.json: no \"image_processor\""}[layout]
    assert says in str(err.value) and (layout != "both disagreeing" or "disagree on size" in str(err.value)), str(err.value)


def test_synth_release_refuses_an_unknown_processor_file(tmp_path):
    res = runner.invoke(app, ["synth-release", str(tmp_path / "r"), "--processor-file", "image.json"])
    assert res.exit_code == 2 and "--processor-file must be one of preprocessor_config.json, processor_config.json" in res.output
    assert not (tmp_path / "r").exists()


def test_image_requests_no_model_can_answer_are_listed_before_the_long_work(release, tmp_path):
    """A truncated image, a file that is not one, pixel bounds that are not numbers, an aspect past
    the processor's 200, a record that cannot hold its schema: each named by request line and file
    and listed as not fitting before the reference is loaded; the good request is still checked
    (issue 48 item 1: each was a late crash, "cannot write output" or "unexpected error")."""
    from PIL import Image

    from .conftest import build_bundle

    head = build_bundle(release, tmp_path / "b")
    src = (ROOT / "conversion" / "images" / "screenshot.png").read_bytes()
    (tmp_path / "trunc.png").write_bytes(src[: len(src) // 2])
    (tmp_path / "text.png").write_text("not an image")
    Image.new("RGB", (5000, 20), (200, 10, 10)).save(tmp_path / "wide.png")
    good = str(ROOT / "conversion" / "images" / "screenshot.png")
    base = {"model": "clef-flash", "state": "A user attached a picture.",
            "questions": {"kind": {"type": "noul", "instructions": "Is it an error?"}}}
    long_schema = {f"q{i}": {"type": "noul", "instructions": "word " * 400} for i in range(12)}
    cases = [("trunc", "trunc.png", {}, "trunc.png: not an image Pillow can read (image file is truncated)"),
             ("text", "text.png", {}, "text.png: not an image Pillow can read"),
             ("lots", good, {"media_kwargs": {"max_pixels": "lots"}}, "media_kwargs max_pixels must be a whole number"),
             ("wide", "wide.png", {}, "wide.png: aspect ratio 250.0 is over 200"),
             ("schema", good, {"questions": long_schema}, "tokens before the state; at most 16384 fit"),
             ("good", good, {}, None)]
    lines = [json.dumps({**base, "id": name, "images": [img], **extra}) for name, img, extra, _ in cases]
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    res = runner.invoke(app, ["check-release", str(release), "--bundle", str(head), "--requests", str(tmp_path / "req.jsonl"),
                              "--transcript", str(tmp_path / "t.json"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    s = json.loads(res.stdout)
    assert s["checked"] == 1 and s["does_not_fit"] == 5 and s["disagreements"] == 0
    why = {e["id"]: (e["line"], e["why"]) for e in json.loads((tmp_path / "t.json").read_text())["does_not_fit"]}
    for n, (name, _img, _extra, says) in enumerate(cases, 1):
        assert (name in why) == (says is not None) and (says is None or (why[name][0] == n and says in why[name][1])), (name, why)
    listed = res.stderr.index("request trunc (line 1)")
    assert listed < res.stderr.index("reference: ")  # before the author's model was loaded
