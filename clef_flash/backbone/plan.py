"""A per-layer weight plan (``plan-weights``'s output, a recipe's ``plan = "..."``): each decoder
layer's measured sensitivity to the compression scheme, the end-to-end checks that chose the set kept
fp16, and what that set costs in bytes. Written as JSON a recipe names, so the choice is
reproducible and reviewable; ``manifests/weight-plan.schema.json`` is generated from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from ..errors import IntegrityError, UsageError, first_validation_error
from ..manifest import Strict

PLAN_VERSION = "0.1"
SCHEMA_FILE = "weight-plan.schema.json"


class LayerSensitivity(Strict):
    layer: int = Field(ge=0)
    kind: Literal["linear_attention", "full_attention"]
    rel_max_abs_d: float  # the layer's output with its linears compressed vs fp16, on the same inputs
    rel_rms_d: float
    alone_max_abs_dp: float  # end to end with this layer alone compressed: the ranking's key
    compressed_bytes: int = Field(ge=0)
    fp16_bytes: int = Field(ge=0)


class Trial(Strict):
    fp16_layers: list[int]
    max_abs_dp: float  # end to end: the head's probabilities, compressed backbone vs the release's
    mean_abs_dp: float
    passes: bool


class PlanScheme(Strict):
    weights: Literal["int8", "int4"]
    bits: Literal[4, 8]
    block: int
    compute: Literal["fp16", "fp32"]  # the recipe's; the plan measures the quantization alone (fp32 eager)


class WeightPlan(Strict):
    plan_version: str
    kind: Literal["weight-plan"] = "weight-plan"
    release: dict[str, Any]  # hf_id, revision, files (the checkpoint's sha256 the plan measured)
    scheme: PlanScheme
    calibration: dict[str, Any]  # requests file + sha256, records, tokens
    budget_dp: float
    ranking: list[int]  # layers, most sensitive first (by alone_max_abs_dp, then rel_max_abs_d)
    layers: list[LayerSensitivity]
    trials: list[Trial]
    chosen: list[int]  # the layers kept fp16: the smallest set of the ranking's head that met the budget
    met: bool  # the chosen set's trial met the budget
    proof: Trial | None = None  # the chosen set less its most sensitive layer (must miss the budget)
    minimal: bool  # the proof trial missed the budget (or nothing is kept fp16)
    bytes: dict[str, int]  # implied main.mlirb weight bytes: all compressed, the chosen mix, all fp16
    seconds: dict[str, float]


def json_schema() -> dict[str, Any]:
    from ..manifest import json_schema_of

    return json_schema_of(WeightPlan, SCHEMA_FILE)


def load_plan(path: Path) -> WeightPlan:
    """The plan at ``path``, checked whole; ``UsageError`` naming the file and the cause."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: weight plan not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable weight plan ({exc})") from None
    try:
        return WeightPlan.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"{path}: invalid weight plan {first_validation_error(exc)}") from None


def check_plan_fits(plan: WeightPlan, path: Path, scheme, files: dict[str, str], layers: int) -> None:
    """A plan measured on another release, another scheme, or naming a layer the decoder lacks is
    refused: its choice would not mean what it says (exit 3 / 2)."""
    other = sorted(n for n, d in plan.release.get("files", {}).items() if files.get(n) not in (None, d))
    if other:
        raise IntegrityError(f"{path}: measured on another release ({other[0]} differs): run plan-weights on this one")
    if (plan.scheme.bits, plan.scheme.block) != (scheme.bits, scheme.block):
        raise UsageError(f"{path}: a plan for int{plan.scheme.bits} per block of {plan.scheme.block}; the recipe "
                         f"compresses to int{scheme.bits} per block of {scheme.block}")
    bad = [i for i in plan.chosen if i >= layers]
    if bad:
        raise UsageError(f"{path}: keeps layer {bad[0]} fp16; the decoder has {layers} layers")
