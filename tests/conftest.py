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
    from clef_flash.author import obtain_author_code

    env = os.environ.get("CLEF_AUTHOR_CODE")
    path = Path(env) if env else ROOT / ".cache" / "author" / "joint_schema_model.py"
    return obtain_author_code(path)


@pytest.fixture(scope="session")
def author_module(author_code):
    from clef_flash.author import AUTHOR_SHA256, load_author_module

    return load_author_module(author_code, AUTHOR_SHA256)


def _synth(tmp_path_factory, author_code, config: str, seed: int, lm_head_vocab: int | None = None) -> Path:
    from clef_flash.synth import write_synth

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


def build_bundle(source: Path, out: Path, recipe: Path = TINY_RECIPE, verify: bool = False, **kw) -> Path:
    from clef_flash.build import BuildConfig, build
    from clef_flash.recipe import load_recipe

    r = load_recipe(recipe)
    cfg = BuildConfig(recipe=r, recipe_path=recipe, source=source, pins_path=source / "pins.json", out=out,
                      verify=verify, **kw)
    return build(cfg).bundle


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
