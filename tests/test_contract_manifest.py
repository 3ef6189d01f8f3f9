"""The contract, the pins and the manifest schema: one source of names, checked both ways."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from clef_flash.head import contract
from clef_flash.errors import UsageError
from clef_flash.head.aimodel import Manifest
from clef_flash.head.backends import json_schema, load_manifest
from clef_flash.manifest import HEAD_DESCRIPTIVE_KEYS, Source
from clef_flash.head.manifest import head_section
from clef_flash.sources.pins import load_pins

from .conftest import PUBLISHED, ROOT

SCHEMA = ROOT / "manifests" / "metadata.schema.json"
PINS = ROOT / "manifests" / "clef-flash.source.json"


def published() -> dict:
    return json.loads(PUBLISHED.read_text())


def test_contract_consistent_and_breaks_are_named():
    contract.check_contract(contract.Shape(), 4096)
    with pytest.raises(ValueError, match="strictly increasing"):
        contract.check_contract(contract.Shape(buckets=(1024, 512)), 4096)
    with pytest.raises(ValueError, match="strictly increasing"):
        contract.check_contract(contract.Shape(buckets=(512, 512)), 4096)
    with pytest.raises(ValueError, match="pad"):
        contract.check_contract(contract.Shape(o_pad=1), 4096)
    shapes = contract.input_shapes(1024, 4096)
    assert list(shapes) == list(contract.INPUT_ORDER)
    assert shapes["hidden"] == (1024, 4096) and shapes["member"] == (16, 128) and shapes["g_avg"] == (1, 1024)


def test_published_manifest_validates_and_schema_is_in_sync():
    Manifest.model_validate(published())
    checked_in = json.loads(SCHEMA.read_text())
    assert checked_in == json_schema(), "run `clef-export schema > manifests/metadata.schema.json`"
    jsonschema.validate(published(), checked_in)


def test_mlpackage_schema_is_in_sync_and_separate():
    checked_in = json.loads((ROOT / "manifests" / "metadata-mlpackage.schema.json").read_text())
    assert checked_in == json_schema("mlpackage"), \
        "run `clef-export schema --format mlpackage > manifests/metadata-mlpackage.schema.json`"
    # the published .aimodel manifest is not a package manifest, and loads as what it is
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(published(), checked_in)
    assert type(load_manifest(json.dumps(published()).encode())) is Manifest
    wrong = published()
    wrong["format"] = "aimodel"  # the published shape has no format key: one would be an extra
    with pytest.raises(ValueError):
        load_manifest(json.dumps(wrong).encode())


def test_schema_rejects_extra_and_missing_keys():
    checked_in = json.loads(SCHEMA.read_text())
    extra = published()
    extra["head"]["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(extra, checked_in)
    with pytest.raises(ValueError):
        Manifest.model_validate(extra)
    missing = published()
    del missing["export"]["main_mlirb"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(missing, checked_in)
    with pytest.raises(ValueError):
        Manifest.model_validate(missing)


def test_head_section_equals_published_description():
    pub = published()["head"]
    ours = head_section(buckets=contract.BUCKETS, weights="fp16w32", source=Source(**pub["source"])).model_dump(mode="json")
    for key in HEAD_DESCRIPTIVE_KEYS:
        assert ours[key] == pub[key], key
    assert set(ours) == set(pub)


def test_pins_file_matches_published_source():
    pins = load_pins(PINS)
    src = published()["head"]["source"]
    assert pins.hf_id == src["hf_id"] and pins.revision == src["revision"]
    assert pins.files["joint_schema_model.py"] == src["joint_schema_model_sha256"]
    assert pins.files["joint_head.safetensors"] == src["joint_head_safetensors_sha256"]
    assert pins.files["joint_head_config.json"] == src["joint_head_config_sha256"]
    assert pins.synthetic is False


GOOD = json.loads(PINS.read_text())


@pytest.mark.parametrize(
    "mutate, cause",
    [
        (lambda d: d.update(revision="17f0b0ad"), "revision"),
        (lambda d: d.update(revision="main"), "revision"),
        (lambda d: d.update(revision="G" * 40), "revision"),
        (lambda d: d["files"].update({"joint_head.safetensors": "abc"}), "64 lowercase hex"),
        (lambda d: d["files"].update({"joint_head.safetensors": "Z" * 64}), "64 lowercase hex"),
        (lambda d: d["files"].pop("joint_head_config.json"), "lack the head's files"),
        (lambda d: d["files"].update({"../evil.py": "0" * 64}), "relative path"),
        (lambda d: d["files"].update({"/etc/passwd": "0" * 64}), "relative path"),
        (lambda d: d.update(extra=1), "extra"),
    ],
)
def test_malformed_pins_are_usage_errors(tmp_path: Path, mutate, cause):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    p = tmp_path / "pins.json"
    p.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=cause) as exc:
        load_pins(p)
    assert str(p) in str(exc.value) and exc.value.exit_code == 2


def test_pins_not_json_or_missing(tmp_path: Path):
    p = tmp_path / "pins.json"
    p.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_pins(p)
    with pytest.raises(UsageError, match="not found"):
        load_pins(tmp_path / "absent.json")
