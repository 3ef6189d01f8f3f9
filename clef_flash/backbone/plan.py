"""A per-layer weight plan (``plan-weights``'s output, a recipe's ``plan = "..."``): each decoder
layer's measured sensitivity to the compression scheme, the end-to-end checks that chose the set kept
fp16, and what that set costs in bytes. Written as JSON a recipe names, so the choice is
reproducible and reviewable; ``manifests/weight-plan.schema.json`` is generated from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from ..errors import IntegrityError, NumericError, UsageError, first_validation_error
from ..manifest import Strict

PLAN_VERSION = "0.2"
SCHEMA_FILE = "weight-plan.schema.json"
PLAN_FILE = "weight-plan.json"  # in a bundle built with fp16_layers = "auto": the plan its build chose


class LayerSensitivity(Strict):
    layer: int = Field(ge=0)
    kind: Literal["linear_attention", "full_attention"]
    rel_max_abs_d: float  # the layer's output with its linears compressed vs fp16, on the same inputs
    rel_rms_d: float
    # the first-order max |dp| with this layer alone compressed: its own error against the answers'
    # gradients at its output (one reverse sweep); the ranking's key unless ranked_by is "exhaustive"
    estimated_dp: float | None = None
    fisher: float | None = None  # the diagonal Fisher term sum((g * d)**2), the worst answer: reported, not ranked by
    alone_max_abs_dp: float | None = None  # measured end to end with this layer alone compressed (--exhaustive)
    compressed_bytes: int = Field(ge=0)
    fp16_bytes: int = Field(ge=0)


Layer = Annotated[int, Field(ge=0)]  # a decoder layer's index


class Trial(Strict):
    fp16_layers: list[Layer]
    max_abs_dp: float  # end to end: the head's probabilities, compressed backbone vs the release's
    mean_abs_dp: float
    passes: bool
    estimated_max_abs_dp: float | None = None  # the first-order estimate of the same set, for comparison


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
    # how the ranking was made: "first-order" (estimated_dp, one reverse sweep) or "exhaustive"
    # (alone_max_abs_dp, one end-to-end pass a layer); plans before 0.2 were all exhaustive
    ranked_by: Literal["first-order", "exhaustive"] = "exhaustive"
    device: str = "cpu"  # where the plan's arithmetic ran (fp32, TF32 off)
    # the records (by number) whose per-layer changes were measured end to end, not carried back:
    # cheaper there at their option count (estimate.measured_alone; --estimate first-order: none)
    measured_alone: list[Annotated[int, Field(ge=0)]] = []
    kendall_tau: float | None = None  # the first-order ranking against the exhaustive one (--exhaustive only)
    budget_dp: float = Field(gt=0, le=1)
    ranking: list[Layer]  # layers, most sensitive first (by the ranked_by figure, then rel_max_abs_d)
    layers: list[LayerSensitivity]
    trials: list[Trial]
    chosen: list[Layer]  # the layers kept fp16: the smallest set of the ranking's head that met the budget
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
        raise UsageError(f"{path}: weight plan not found (a recipe's plan = \"...\" is read from the recipe's "
                         f"own folder)") from None
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
    check_plan_backs_choice(plan, path, layers)


def layer_problems(plan: WeightPlan, layers: int | None = None) -> list[str]:
    """What makes a plan's layer numbers mean nothing: a layer measured twice, a ranking that is not
    the measured layers once each, a kept set (chosen or a trial's) naming a layer twice or one the
    ranking lacks, a layer past the decoder's ``layers``."""
    measured = [x.layer for x in plan.layers]
    problems = []
    if len(set(measured)) != len(measured):
        problems.append(f"layers measures layer {next(i for i in measured if measured.count(i) > 1)} twice")
    if sorted(plan.ranking) != sorted(set(measured)):
        problems.append(f"ranking {plan.ranking} is not the measured layers {sorted(set(measured))} once each")
    for what, kept in [("chosen", plan.chosen)] + [(f"trial {t.fp16_layers}", t.fp16_layers)
                                                    for t in plan.trials + ([plan.proof] if plan.proof else [])]:
        if len(set(kept)) != len(kept):
            problems.append(f"{what} names a layer twice")
        elif not set(kept) <= set(plan.ranking):
            problems.append(f"{what} keeps layer {min(set(kept) - set(plan.ranking))}, which the ranking lacks")
    if layers is not None and any(i >= layers for i in measured + plan.chosen):
        problems.append(f"names layer {max(measured + plan.chosen)}; the decoder has {layers} layers")
    return problems


def check_plan_backs_choice(plan: WeightPlan, path: Path, layers: int | None = None) -> None:
    """A plan that is read (a recipe's, a build's own): its layer numbers mean something (exit 2), its
    trials back its choice (an edited or corrupt file: exit 3), and it met its budget (exit 4)."""
    problems = layer_problems(plan, layers)
    if problems:
        raise UsageError(f"{path}: {problems[0]}")
    problems = plan_problems(plan, minimal=False)  # a plan that is not minimal still meets its budget
    honest = [p for p in problems if not p.startswith("no trial of the chosen set")]
    if honest:
        raise IntegrityError(f"{path}: the plan does not back its choice ({honest[0]}); run plan-weights again")
    if problems:
        raise NumericError(f"{path}: did not meet its budget ({problems[0]}); run plan-weights with a larger "
                           f"--budget-dp or keep more layers fp16")


def plan_problems(plan: WeightPlan, minimal: bool = True) -> list[str]:
    """What a plan's own trials do not back: a trial whose verdict is not its figure against the
    budget, a chosen set without its passing trial, a kept set without its proof trial, and (``minimal``)
    a proof trial that met the budget (a smaller set would do). Empty: the plan proves its choice."""
    problems = [f"trial {t.fp16_layers}: max |dp| {t.max_abs_dp:.4g} against {plan.budget_dp:g} but passes = {t.passes}"
                for t in plan.trials + ([plan.proof] if plan.proof else []) if t.passes != (t.max_abs_dp <= plan.budget_dp)]
    backed = any(t.fp16_layers == plan.chosen and t.passes for t in plan.trials)
    if not backed:
        problems.append(f"no trial of the chosen set {plan.chosen} meets max |dp| {plan.budget_dp:g}")
    if plan.met != backed:
        problems.append(f"met = {plan.met} disagrees with the trials")
    if plan.chosen and plan.proof is None:
        problems.append(f"keeps {plan.chosen} fp16 without a proof trial (the set less its most sensitive layer)")
    if plan.chosen and plan.proof is not None and plan.proof.fp16_layers != sorted(plan.ranking[1:len(plan.chosen)]):
        problems.append(f"the proof trial keeps {plan.proof.fp16_layers}, not the chosen set less its most sensitive layer")
    if plan.minimal != (plan.proof is None or not plan.proof.passes):
        problems.append(f"minimal = {plan.minimal} disagrees with the proof trial")
    if minimal and plan.proof is not None and plan.proof.passes:
        problems.append(f"not minimal: {plan.proof.fp16_layers} fp16 also meets the budget ({plan.proof.max_abs_dp:.4g})")
    return problems


def check_shipped_plan(bundle: Path, c) -> str:
    """A bundle's shipped plan (``fp16_layers = "auto"``) against its manifest's compression section:
    the file is there with the recorded sha256, a valid plan whose chosen layers are the ones kept
    fp16, that met its budget; ``IntegrityError`` naming the file. Returns the checklist's detail."""
    from ..digest import sha256_file

    path = Path(bundle) / PLAN_FILE
    if not path.is_file():
        raise IntegrityError(f"{path}: missing (the manifest says the build chose its fp16 layers and shipped the plan)")
    if sha256_file(path) != c.plan.sha256:
        raise IntegrityError(f"{path}: its sha256 differs from the manifest's")
    try:
        plan = load_plan(path)
    except UsageError as exc:
        raise IntegrityError(str(exc)) from None
    if plan.chosen != c.plan.chosen or sorted(c.fp16_layers) != plan.chosen:
        raise IntegrityError(f"{path}: chose fp16 layers {plan.chosen}; the manifest keeps {c.fp16_layers}")
    if (plan.scheme.bits, plan.scheme.block) != (c.bits, c.block):
        raise IntegrityError(f"{path}: a plan for int{plan.scheme.bits} per block of {plan.scheme.block}")
    try:
        check_plan_backs_choice(plan, path)
    except (UsageError, NumericError) as exc:
        raise IntegrityError(str(exc)) from None
    return f"{PLAN_FILE}: fp16 layers {plan.chosen or 'none'}, max |dp| <= {plan.budget_dp:g}, minimal: {plan.minimal}"
