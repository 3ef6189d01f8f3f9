"""The parts of ``metadata.json`` that every format shares: the head (how to call it), its source,
file digests, seconds, AOT and compilation. Each backend defines its manifest model from these
(``aimodel.Manifest`` is the published schema, key for key); ``backends`` reads a manifest by its
format and writes the JSON Schemas in ``manifests/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from .digest import sha256_file
from .errors import IntegrityError
from .sources.pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, Pins

METADATA_VERSION = "0.2"
KIND = "decision-head"
GRAPH_TEXT = "clef_flash/graph.py ClefHeadGraph: the author's JointSchemaHead for one record, tensor inputs only"
def host_pad_rule(buckets: tuple[int, ...], q_pad: int, o_pad: int) -> str:
    """How a host pads a record for this bundle (the published text for the published recipe)."""
    return (f"T to the smallest bucket >= T ({', '.join(str(b) for b in buckets)}), Q to {q_pad}, O to {o_pad}; "
            "padding rows / columns zero, their valid flags 0")


_PADS = re.compile(r", Q to (\d+), O to (\d+);")


def pads(head: "Head") -> tuple[int, int]:
    """(Q, O) of a bundle, read back from its ``host_pad_rule`` (written by ``host_pad_rule``)."""
    return pads_of_rule(head.host_pad_rule)


def pads_of_rule(rule: str) -> tuple[int, int]:
    m = _PADS.search(rule)
    if m is None:
        raise ValueError(f"host_pad_rule names no Q / O pads: {rule!r}")
    return int(m.group(1)), int(m.group(2))
SOFTMAX_TEXT = "host: per question, fp32, over that question's options"
LEXICAL_TEXT = "host: lm_head_fp16.bin rows of each option span's ids, averaged (clef_head.lexical_rows)"
OUTPUT_TEXT = "[O] f32; padding options 0"


class Strict(BaseModel):
    """Every manifest model: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")


class LocalOrigin(Strict):
    """A source that is a local release folder, not a Hub commit (absent for a Hub commit)."""

    kind: Literal["local"]
    name: str
    release: dict[str, Any] | None = None  # what the folder says of itself: CLEF_FINETUNE.json facts, tiny marker


class Source(Strict):
    hf_id: str
    revision: str | None = Field(pattern=r"^[0-9a-f]{40}$")  # the Hub commit; null for a local release
    joint_schema_model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_safetensors_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    origin: LocalOrigin | None = None

    @model_serializer(mode="wrap")
    def _without_hub_origin(self, handler):
        # a Hub commit's source keeps the published keys exactly; only a local release says more
        data = handler(self)
        if data.get("origin") is None:
            data.pop("origin", None)
        return data


class Head(Strict):
    graph: str
    shape: str
    functions: list[str]
    buckets: list[tuple[str, int]]
    dims: dict[str, int] | None
    host_pad: str
    host_pad_rule: str
    inputs: dict[str, str]
    input_order: list[str]
    outputs: dict[str, str]
    weights: str
    softmax: str
    lexical: str
    source: Source


class FileDigest(Strict):
    """A file of the asset: its size and sha256."""

    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Seconds(Strict):
    build: float
    export: float
    optimize: float
    save: float
    total: float


class Aot(Strict):
    note: str
    flags: list[str]
    seconds: float


class Compilation(Strict):
    date: str
    targets: list[str]


def check_file_size(path: Path, want: FileDigest) -> None:
    """A file is there with the size its manifest gives, or ``IntegrityError`` naming it."""
    if not path.is_file():
        raise IntegrityError(f"{path}: missing")
    size = path.stat().st_size
    if size != want.bytes:
        raise IntegrityError(f"{path}: {size} bytes, the manifest says {want.bytes}")


def check_file(path: Path, want: FileDigest, digest: str | None = None) -> str:
    """A file against the size and sha256 its manifest gives; returns the digest, or raises
    ``IntegrityError`` naming the file. ``digest``: its sha256 taken by a read the caller made anyway."""
    check_file_size(path, want)
    digest = digest or sha256_file(path)
    if digest != want.sha256:
        raise IntegrityError(f"{path}: sha256 {digest[:12]}… differs from the manifest's {want.sha256[:12]}…")
    return digest


def source_section(pins: Pins) -> Source:
    return Source(
        hf_id=pins.hf_id,
        revision=pins.revision,
        joint_schema_model_sha256=pins.files[CODE_FILE],
        joint_head_safetensors_sha256=pins.files[WEIGHTS_FILE],
        joint_head_config_sha256=pins.files[CONFIG_FILE],
        origin=LocalOrigin(kind="local", name=pins.release_name, release=pins.release) if pins.origin == "local" else None,
    )


# The comparison that "describes the head" covers these keys of ``head``.
HEAD_DESCRIPTIVE_KEYS = (
    "shape", "functions", "buckets", "dims", "host_pad", "host_pad_rule",
    "inputs", "input_order", "outputs", "weights", "softmax", "lexical",
)


def json_schema_of(model: type[BaseModel], schema_file: str) -> dict[str, Any]:
    """A manifest model's JSON Schema as ``manifests/*.schema.json`` holds it (draft 2020-12, its id)."""
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"clef-export/{schema_file}"
    return schema


class TensorSpec(Strict):
    shape: list[int | str]
    dtype: Literal["int32", "fp16", "fp32"]


class BackboneSource(Strict):
    hf_id: str
    revision: str | None = Field(pattern=r"^[0-9a-f]{40}$")
    files: dict[str, str]  # every file the build read -> sha256
    synthetic: bool = False
    origin: LocalOrigin | None = None


def release_source(pins: Pins, files: dict[str, str]) -> BackboneSource:
    """The ``source`` section of a bundle built from a release's files (the decoder's, the tower's)."""
    origin = LocalOrigin(kind="local", name=pins.release_name, release=pins.release) if pins.origin == "local" else None
    return BackboneSource(hf_id=pins.hf_id, revision=pins.revision, files=files, synthetic=pins.synthetic, origin=origin)


def mlirb_digest(asset_dir: Path, outputs: dict[str, str]) -> FileDigest:
    """``main.mlirb``'s size and the sha256 already taken among a bundle's ``outputs``."""
    return FileDigest(bytes=(asset_dir / "main.mlirb").stat().st_size, sha256=outputs[f"{asset_dir.name}/main.mlirb"])
