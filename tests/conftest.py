"""Fixtures: the author's verified code (obtained at test time, never committed), synthetic
sources at the tiny and real configurations, and bundles built from them (once per session)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The published manifest of Cloudflare's own export, kept in the repository (manifests/published/README.md)
PUBLISHED = ROOT / "manifests" / "published" / "clef_flash_head_bucket_fp16w32.metadata.json"
TINY_RECIPE = ROOT / "conversion" / "head_bucket_fp16w32.toml"


@pytest.fixture(scope="session")
def author_code(tmp_path_factory) -> Path:
    from clef_flash.sources.author import obtain_author_code

    env = os.environ.get("CLEF_AUTHOR_CODE")
    path = Path(env) if env else ROOT / ".cache" / "author" / "joint_schema_model.py"
    return obtain_author_code(path)


@pytest.fixture(scope="session")
def author_module(author_code):
    from clef_flash.sources.author import AUTHOR_SHA256, load_author_module

    return load_author_module(author_code, AUTHOR_SHA256)


def _synth(tmp_path_factory, author_code, config: str, seed: int, lm_head_vocab: int | None = None) -> Path:
    from clef_flash.synth.release import write_synth

    out = tmp_path_factory.mktemp(f"src-{config}-{seed}") / "snapshot"
    write_synth(out, config_name=config, seed=seed, author_code=author_code, lm_head_vocab=lm_head_vocab)
    return out


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory, author_code) -> Path:
    """The tiny head plus a backbone-shaped lm_head shard of 512 rows."""
    return _synth(tmp_path_factory, author_code, "tiny", 0, lm_head_vocab=512)


@pytest.fixture(scope="session")
def tiny_source_other(tmp_path_factory, author_code) -> Path:
    return _synth(tmp_path_factory, author_code, "tiny", 1)


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """``make_tiny(seed) -> release``: a release written by clef-finetune's own ``make-tiny`` (its
    environment apart from ours, torch from the registry with torchvision: ``make finetune-env``,
    which ``make test`` runs first; ``CLEF_FINETUNE`` names its command), pinned. Once per seed."""
    import subprocess

    from clef_flash.sources.pinning import pin_local

    exe = os.environ.get("CLEF_FINETUNE") or str(ROOT / ".cache" / "finetune-env" / "bin" / "clef-finetune")
    if not Path(exe).is_file():
        pytest.fail(f"{exe}: clef-finetune's command not found; run `make finetune-env` (make test does)")
    made: dict[int, Path] = {}

    def make(seed: int) -> Path:
        if seed not in made:
            out = tmp_path_factory.mktemp(f"make-tiny-{seed}") / f"make_tiny_{seed}"
            res = subprocess.run([exe, "make-tiny", str(out), "--seed", str(seed)], capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-2000:]
            pin_local(out, name=out.name)
            made[seed] = out
        return made[seed]
    return make


def build_bundle(source: Path, out: Path, recipe: Path = TINY_RECIPE, verify: bool = False, **kw) -> Path:
    from clef_flash.build import BuildConfig, build
    from clef_flash.recipe import load_recipe

    r = load_recipe(recipe)
    cfg = BuildConfig(recipe=r, recipe_path=recipe, source=source, pins_path=source / "pins.json", out=out,
                      verify=verify, **kw)
    return build(cfg).bundle


def rerecord(bundle: Path) -> None:
    """A forger's last step: the build record rewritten to the bundle's edited files, so that only a
    check deeper than the files' digests can see the edit."""
    from clef_flash.digest import tree_files

    record = json.loads((bundle / "build-record.json").read_text())
    record["outputs"] = {k: v for k, v in tree_files(bundle).items() if k != "build-record.json"}
    (bundle / "build-record.json").write_text(json.dumps(record))


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_source) -> Path:
    return build_bundle(tiny_source, tmp_path_factory.mktemp("tiny-build"), verify=True)


@pytest.fixture()
def tiny_bundle_copy(tmp_path, tiny_bundle) -> Path:
    dst = tmp_path / "out" / tiny_bundle.name
    shutil.copytree(tiny_bundle, dst)
    return dst


@pytest.fixture(scope="session")
def real_source(tmp_path_factory, author_code) -> Path:
    return _synth(tmp_path_factory, author_code, "real", 0)


@pytest.fixture()
def hub(tiny_source):
    """A loopback fake Hub serving the tiny snapshot at its pinned revision."""
    from .fakehub import FakeHub

    pins = json.loads((tiny_source / "pins.json").read_text())
    with FakeHub(pins["hf_id"], pins["revision"], tiny_source) as h:
        yield h


LICENSE_TEXT = ("                                 Apache License\n                           Version 2.0, January 2004\n"
                "                        http://www.apache.org/licenses/\n\n(the release's own licence text)\n")
NOTICE_TEXT = "tiny release, random weights\nCopyright nobody: generated by clef-export's tests\n"


@pytest.fixture(scope="session")
def whole_dist(tmp_path_factory, author_code) -> dict[str, Path]:
    """A fine-tune's whole Mac release of a tiny release that carries LICENSE and NOTICE: the head,
    an fp32-compute backbone (chunk 64, context 1024, gated) and the lm_head table, via `release`;
    and a passing check-release transcript of those very assets on four requests."""
    import sys

    from typer.testing import CliRunner

    from clef_flash.cli import app
    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    root = tmp_path_factory.mktemp("whole-dist")
    rel = write_release(root / "licensed_release", config_name=MAKE_TINY_HEAD, seed=3, author_code=author_code,
                        backbone="qwen3_5", variant="tiny")
    (rel / "LICENSE").write_text(LICENSE_TEXT)
    (rel / "NOTICE").write_text(NOTICE_TEXT)
    pin_local(rel, name="licensed_release")
    recipe = root / "backbone_fp32_64.toml"
    recipe.write_text('model = "backbone"\nname = "{release}_decode_fp32_pf64"\nchunk = 64\ncontext = 1024\ncompute = "fp32"\n')
    dist = root / "dist"
    path = os.environ["PATH"]
    os.environ["PATH"] = "/usr/bin:/bin:" + str(Path(sys.executable).parent)  # no xcrun: AOT skipped
    try:
        runner = CliRunner()
        res = runner.invoke(app, ["release", str(TINY_RECIPE), str(recipe), "--source", str(rel),
                                  "--pins", str(rel / "pins.json"), "--dist", str(dist), "--json"])
        assert res.exit_code == 0, res.output[-3000:]
        summary = json.loads(res.stdout)
        head, backbone = summary["bundles"]
        requests = root / "requests-4.jsonl"
        requests.write_text("".join((ROOT / "conversion" / "requests.jsonl").read_text().splitlines(True)[:4]))
        res = runner.invoke(app, ["check-release", str(rel), "--bundle", str(dist / head), "--backbone", str(dist / backbone),
                                  "--requests", str(requests), "--transcript", str(root / "check.json")])
        assert res.exit_code == 0, res.output[-3000:]
    finally:
        os.environ["PATH"] = path
    return {"release": rel, "dist": dist, "check": root / "check.json", "summary": summary}
