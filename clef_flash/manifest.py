"""Typed manifests: ``metadata.json`` (the published schema, key for key) and ``build-record.json``.

The JSON Schema in ``manifests/metadata.schema.json`` is generated from ``Manifest`` (``clef-export
schema``); a test keeps it in sync. Both the published manifest and ours validate against it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import contract

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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Source(_Strict):
    hf_id: str
    revision: str = Field(pattern=r"^[0-9a-f]{40}$")
    joint_schema_model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_safetensors_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    joint_head_config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Head(_Strict):
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


class MainMlirb(_Strict):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Seconds(_Strict):
    build: float
    export: float
    optimize: float
    save: float
    total: float


class ExportAttempt(_Strict):
    externalize: str
    ok: bool
    seconds: float


class Export(_Strict):
    aimodel_bytes: int = Field(ge=0)
    main_mlirb: MainMlirb
    seconds: Seconds
    export_attempts: list[ExportAttempt]


class Aot(_Strict):
    note: str
    flags: list[str]
    seconds: float


class Compilation(_Strict):
    date: str
    targets: list[str]


class Manifest(_Strict):
    """``metadata.json`` of a head bundle."""

    metadata_version: str
    kind: str
    name: str
    assets: dict[str, str]
    head: Head
    export: Export
    aot: Aot | None
    compilation: Compilation


class MlpackageExport(_Strict):
    """The ``export`` section of a Core ML package manifest (``format: mlpackage``)."""

    mlpackage_bytes: int = Field(ge=0)
    model: MainMlirb  # Data/com.apple.CoreML/model.mlmodel
    weight_bin: MainMlirb  # Data/com.apple.CoreML/weights/weight.bin
    weight_storage: Literal["fp16", "fp32"]
    compute_precision: Literal["fp32"]
    minimum_deployment_target: str
    coremltools: str
    seconds: Seconds
    predictions: str


class MlpackageManifest(_Strict):
    """``metadata.json`` of a Core ML package bundle: the same ``decision-head`` shape, naming its
    format (the published ``.aimodel`` manifest has no ``format`` key and stays key for key)."""

    metadata_version: str
    kind: str
    format: Literal["mlpackage"]
    name: str
    assets: dict[str, str]
    head: Head
    export: MlpackageExport
    aot: Aot | None
    compilation: Compilation


AnyManifest = Manifest | MlpackageManifest
FORMATS: dict[str, type[BaseModel]] = {"aimodel": Manifest, "mlpackage": MlpackageManifest}


def manifest_format(manifest: BaseModel) -> str:
    return "mlpackage" if isinstance(manifest, MlpackageManifest) else "aimodel"


def load_manifest(data: bytes) -> AnyManifest:
    """A bundle's ``metadata.json``: ``format: mlpackage`` selects the Core ML model, else the
    published one. Raises ``ValueError`` (pydantic's) on anything else."""
    import json

    raw = json.loads(data)
    if isinstance(raw, dict) and raw.get("format") == "mlpackage":
        return MlpackageManifest.model_validate(raw)
    return Manifest.model_validate(raw)


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


# The comparison that "describes the head" covers these keys of ``head``.
HEAD_DESCRIPTIVE_KEYS = (
    "shape", "functions", "buckets", "dims", "host_pad", "host_pad_rule",
    "inputs", "input_order", "outputs", "weights", "softmax", "lexical",
)


SCHEMA_FILES = {"aimodel": "metadata.schema.json", "mlpackage": "metadata-mlpackage.schema.json"}


def json_schema(fmt: str = "aimodel") -> dict[str, Any]:
    schema = FORMATS[fmt].model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"clef-export/{SCHEMA_FILES[fmt]}"
    return schema
