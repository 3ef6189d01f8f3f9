"""``metadata.json`` of a backbone bundle (``kind: decision-backbone``): how a host calls the
decoder (function, inputs, states, output, the pad rule), the language facts, where the weights
came from (every checkpoint file's sha256; for a local release what ``CLEF_FINETUNE.json`` says),
the export's figures and the compute precision. ``manifests/metadata-backbone.schema.json`` is
generated from these models (``clef-export schema --kind backbone``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..manifest import BackboneSource, Compilation, FileDigest, Strict, TensorSpec

KIND = "decision-backbone"
METADATA_VERSION = "0.2"
SCHEMA_FILE = "metadata-backbone.schema.json"


class Language(Strict):
    prefill_chunk: int = Field(ge=1)
    max_context: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    pad_token_id: int = Field(ge=0)
    layer_types: list[Literal["linear_attention", "full_attention"]]
    text_config: dict[str, Any]


class ShortFunction(Strict):
    """A function beside ``function`` over fewer slots: the same inputs, output and weights, its KV
    caches' slot axis ``context`` (``interface.states`` are the main function's)."""

    function: str
    context: int = Field(ge=1)


class Interface(Strict):
    function: str
    # the shorter functions, shortest first; a host runs a record in the first whose context holds
    # its chunks (``backbone.contract.fitting``), else in ``function`` over ``max_context``
    short_functions: list[ShortFunction] = Field(default_factory=list)
    inputs: dict[str, TensorSpec]
    input_order: list[str]
    states: dict[str, TensorSpec]
    state_order: list[str]
    outputs: dict[str, TensorSpec]
    host_loop: str
    vision: "ImageInputs | None" = None  # None: a text-only decoder (no image inputs)


class ImageInputs(Strict):
    """How a host sends one image's rows (the published port's interface)."""

    image_rows: int = Field(ge=1)  # NMAX
    image_token_base: int = Field(ge=1)  # V: image token k is sent as id V + k
    embeds_dtype: Literal["fp16", "fp32"]
    text_values: dict[str, int]  # rope_shift_start, rope_shift_amount for a request without an image
    mrope_section: list[int]
    rule: str


Interface.model_rebuild()


class LayerWeights(Strict):
    layer: int = Field(ge=0)
    weights: Literal["fp16", "int8", "int4"]
    tensors: int = Field(ge=0)  # 2-D tensors of the layer (its linears and conv1d)
    bytes: int = Field(ge=0)  # what they occupy in main.mlirb: codes + scales, or fp16


class PlanRef(Strict):
    file: str  # the plan's file name, as the recipe or the build named it
    sha256: str
    budget_dp: float
    chosen: list[int]  # the layers it keeps fp16
    shipped: bool = False  # fp16_layers = "auto": the build chose them and the plan is in the bundle (weight-plan.json)


class Compression(Strict):
    """What was compressed and how, so a host and a reader can tell (``engine.quantize``)."""
    bits: Literal[4, 8]
    block: int = Field(ge=2)  # values a scale covers, along each linear's input axis
    symmetric: Literal[True] = True
    scale_dtype: Literal["fp16"] = "fp16"
    scale_floor: float  # no scale is smaller: the smallest normal fp16
    rounding: Literal["half-to-even"] = "half-to-even"
    op: str  # the Core AI op that dequantizes: output = fp16(scale * code)
    experimental: bool
    fp16_layers: list[int]
    plan: PlanRef | None = None
    compressed_tensors: int = Field(ge=0)
    layers: list[LayerWeights]
    other: dict[str, int]  # tensors kept fp16 outside the layers' linears (embedding, conv1d): tensors, bytes
    implied_bytes: int = Field(ge=0)  # codes + scales + the fp16 remainder
    mlirb_over_implied: float


class BackboneExport(Strict):
    weights: Literal["fp16", "int8", "int4"]
    compute: Literal["fp16", "fp32"]
    aimodel_bytes: int = Field(ge=0)
    main_mlirb: FileDigest
    weight_fp16_bytes: int = Field(ge=0)
    mlirb_over_weights: float
    seconds: dict[str, float]
    tolerances: dict[str, dict[str, Any]]
    compression: Compression | None = None  # int8 / int4 weights
    # engine.weight_map: each weight's blob in main.mlirb and the folded 1-D tensors (the torch engine's way in)
    weight_map: FileDigest | None = None


class BackboneManifest(Strict):
    metadata_version: str
    kind: Literal["decision-backbone"]
    name: str
    assets: dict[str, str]
    language: Language
    interface: Interface
    source: BackboneSource
    tokenizer: dict[str, str]  # file in tokenizer/ -> sha256
    export: BackboneExport
    compilation: Compilation


HOST_LOOP = ("zero states per record; ceil(T / S) calls of main; call c: input_ids = tokens c*S … c*S+S-1 "
             "(the last chunk padded with pad_token_id), position_ids = the ramp 0 … (c+1)*S-1 (its last S "
             "entries are the chunk's positions); hidden rows concatenated and cut to T: the head's hidden input")


IMAGE_RULE = ("one image of N <= image_rows tokens on a merged grid H x W, its first token at index s: ids V + k "
              "(k = 0 … N-1) in its place; image_embeds rows 0 … N-1 the vision tower's rows, the rest zero; image_rc "
              "row k = (k // W, k % W); rope_shift_start = s + N (the index of <|vision_end|>); rope_shift_amount = "
              "N - max(H, W). Positions: image token k at (t, h, w) = (s, s + k // W, s + k % W), text from "
              "rope_shift_start on at its index - rope_shift_amount; rotary frequency j reads h if j % 3 == 1 and "
              "j < 3 * mrope_section[1], w if j % 3 == 2 and j < 3 * mrope_section[2], else t. Text only: zeros, "
              "zeros, 1 << 30, 0")


def functions_of(m: BackboneManifest):
    """The decoder's functions as a host calls them (``contract.DecoderFunction``), shortest first."""
    from .contract import DecoderFunction

    return tuple(DecoderFunction(f.function, f.context) for f in m.interface.short_functions) + (
        DecoderFunction(m.interface.function, m.language.max_context),)


def json_schema() -> dict[str, Any]:
    from ..manifest import json_schema_of

    return json_schema_of(BackboneManifest, SCHEMA_FILE)
