"""The parts of ``metadata.json`` that every format shares: the head (how to call it), its source,
file digests, seconds, AOT and compilation. Each backend defines its manifest model from these
(``aimodel.Manifest`` is the published schema, key for key); ``backends`` reads a manifest by its
format and writes the JSON Schemas in ``manifests/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from . import contract
from .digest import sha256_file
from .errors import IntegrityError
from .pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, Pins

METADATA_VERSION = "0.2"
KIND = "decision-head"
GRAPH_TEXT = "clef_flash/graph.py ClefHeadGraph: the author's JointSchemaHead for one record, tensor inputs only"
HOST_PAD_RULE = (
    "T to the smallest bucket >= T (512, 1024, 2048, 4096), Q to 16, O to 128; "
    "padding rows / columns zero, their valid flags 0"
)
SOFTMAX_TEXT = "host: per question, fp32, over that question's options"
LEXICAL_TEXT = "host: lm_head_fp16.bin rows of each option span's ids, averaged (clef_head.lexical_rows)"
OUTPUT_TEXT = "[O] f32; padding options 0"


class Strict(BaseModel):
    """Every manifest model: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")


class Source(Strict):
    hf_id: str
    revision: str = Field(pattern=r"^[0-9a-f]{40}$")
    joint_schema_model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_safetensors_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


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


def check_file(path: Path, want: FileDigest) -> str:
    """A file against the size and sha256 its manifest gives; returns the digest, or raises
    ``IntegrityError`` naming the file."""
    if not path.is_file():
        raise IntegrityError(f"{path}: missing")
    size = path.stat().st_size
    if size != want.bytes:
        raise IntegrityError(f"{path}: {size} bytes, the manifest says {want.bytes}")
    digest = sha256_file(path)
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
    )


def head_section(*, buckets: tuple[int, ...], weights: str, source: Source, hidden_size: int = 4096) -> Head:
    """Everything that describes the head; equal to the published values for the published recipe."""
    return Head(
        graph=GRAPH_TEXT,
        shape="bucket",
        functions=[contract.function_name(b) for b in buckets],
        buckets=[(contract.function_name(b), b) for b in buckets],
        dims=None,
        host_pad="bucket",
        host_pad_rule=HOST_PAD_RULE,
        inputs={name: contract.spec_text(name, hidden_size) for name in contract.INPUT_ORDER},
        input_order=list(contract.INPUT_ORDER),
        outputs={"logits": OUTPUT_TEXT},
        weights=weights,
        softmax=SOFTMAX_TEXT,
        lexical=LEXICAL_TEXT,
        source=source,
    )


def common_fields(*, name: str, asset: str, buckets: tuple[int, ...], weights: str, pins: Pins, hidden_size: int,
                  date: str) -> dict[str, Any]:
    """The keys every bundle's manifest has, whatever its format; a backend adds ``export``."""
    return {
        "metadata_version": METADATA_VERSION,
        "kind": KIND,
        "name": name,
        "assets": {"main": asset},
        "head": head_section(buckets=buckets, weights=weights, source=source_section(pins), hidden_size=hidden_size),
        "aot": None,
        "compilation": Compilation(date=date, targets=[]),
    }


# The comparison that "describes the head" covers these keys of ``head``.
HEAD_DESCRIPTIVE_KEYS = (
    "shape", "functions", "buckets", "dims", "host_pad", "host_pad_rule",
    "inputs", "input_order", "outputs", "weights", "softmax", "lexical",
)
