"""``metadata.json`` of a vision bundle (``kind: vision-tower``): how a host calls the tower (one
function per bucket, its inputs and output), the preprocessing it must reproduce, the buckets and
the cap, where the weights came from, the export's figures. ``manifests/metadata-vision.schema.json``
is generated from these models (``clef-export schema --kind vision``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..manifest import BackboneSource, TensorSpec
from ..manifest import Compilation, FileDigest, Strict


METADATA_VERSION = "0.1"
SCHEMA_FILE = "metadata-vision.schema.json"


class Preprocess(Strict):
    """The image processor's rule, as the release's preprocessor_config.json sets it."""

    patch_size: int = Field(ge=1)
    temporal_patch_size: int = Field(ge=1)
    merge_size: int = Field(ge=1)
    image_mean: list[float]
    image_std: list[float]
    min_pixels: int = Field(ge=1)
    max_pixels: int = Field(ge=1)
    rescale_factor: float
    resample: Literal["bicubic"]
    rule: str  # in words, what the host does


class Function(Strict):
    name: str
    tokens: int = Field(ge=1)  # merged vision tokens (rows of image_embeds)
    patches: int = Field(ge=1)
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


class VisionInterface(Strict):
    input_order: list[str]
    functions: list[Function]
    buckets: list[int]  # tokens per function, increasing
    cap_tokens: int = Field(ge=1)  # the largest image the asset takes (the last bucket)
    host_call: str


class Tower(Strict):
    vision_config: dict[str, Any]
    out_hidden_size: int = Field(ge=1)
    parameters: int = Field(ge=0)


class VisionExport(Strict):
    weights: Literal["fp16"]
    compute: Literal["fp16", "fp32"]
    aimodel_bytes: int = Field(ge=0)
    main_mlirb: FileDigest
    weight_fp16_bytes: int = Field(ge=0)
    mlirb_over_weights: float
    seconds: dict[str, float]
    tolerances: dict[str, dict[str, Any]]


class VisionManifest(Strict):
    metadata_version: str
    kind: Literal["vision-tower"]
    name: str
    assets: dict[str, str]
    tower: Tower
    preprocess: Preprocess
    interface: VisionInterface
    source: BackboneSource
    export: VisionExport
    compilation: Compilation



PREPROCESS_RULE = ("open, EXIF orientation applied, RGB; smart_resize (aspect kept, sides multiples of patch * merge, "
                   "pixels within [min_pixels, max_pixels]); Pillow bicubic on the uint8 image; x * rescale_factor in "
                   "float64, then fp32; (x - mean) / std in fp32; patches [gh * gw, C * T * p * p] merge-block-major "
                   "(block row, block col, in-row, in-col), each (C, T, p, p) with the still frame in every T slot")
HOST_CALL = ("one image per call: N = gh * gw / merge^2 tokens; the smallest bucket >= N (N over the cap: refused); "
             "patches zero-padded to the bucket's P = merge^2 * bucket rows; pos_index / pos_weight the bilinear "
             "taps (align_corners) of each patch's (row, col) into the side x side position table, "
             "src = i * (side - 1) / max(n - 1, 1) in fp32, zeros past the image; patch_rc each patch's (row, col); "
             "patch_count [P_image]; image_embeds rows 0 … N-1 are the image's, in merge-block order (row-major "
             "over the merged grid)")


def json_schema() -> dict[str, Any]:
    from ..manifest import json_schema_of

    return json_schema_of(VisionManifest, SCHEMA_FILE)
