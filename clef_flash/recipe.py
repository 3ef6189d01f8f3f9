"""Read and check a ``conversion/*.toml`` recipe: what to build (name, buckets, pads, weights)."""

from __future__ import annotations

import tomllib
from pathlib import Path, PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from .head.contract import BUCKETS, O_PAD, Q_PAD, Shape
from .data import data_dir
from .errors import UsageError, first_validation_error

CONVERSION = data_dir("conversion")
DEFAULT_RECIPE = CONVERSION / "head_bucket_fp16w32.toml"


def format_recipe(fmt: str) -> Path:
    """The recipe ``build --format F`` uses when no recipe is named: the backend names it."""
    from .head.backends import backend

    return CONVERSION / backend(fmt).RECIPE


def _default_format() -> str:
    from .head.backends import DEFAULT_FORMAT

    return DEFAULT_FORMAT


RELEASE = "{release}"


class VerifyPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True
    records: int = Field(default=2, ge=1, le=1000)
    seed: int = 0


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # the bundle's name; ``{release}`` stands for the release's name (``clef_flash`` for
    # Cloudflare/clef-flash, a local release's ``--name``)
    model: Literal["head"] = "head"
    name: str = Field(pattern=r"^(\{release\}|[A-Za-z0-9])[A-Za-z0-9_.-]*$")
    shape: Literal["bucket"] = "bucket"
    buckets: tuple[int, ...] = BUCKETS
    q_pad: int = Field(default=Q_PAD, ge=1)
    o_pad: int = Field(default=O_PAD, ge=2)
    weights: Literal["fp16w32", "fp32"] = "fp16w32"
    format: str = Field(default_factory=lambda: _default_format())  # a backend's name (``backends.FORMATS``)
    verify: VerifyPlan = VerifyPlan()

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        from .head.backends import FORMATS

        if v not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}")
        return v

    @field_validator("buckets")
    @classmethod
    def _increasing(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("buckets must name at least one T")
        if any(b < 1 for b in v):
            raise ValueError(f"buckets must be positive, got {list(v)}")
        if any(a >= b for a, b in zip(v, v[1:])):
            raise ValueError(f"buckets must be strictly increasing, got {list(v)}")
        return v

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        plain = v.replace(RELEASE, "x")
        if plain in (".", "..") or PurePath(plain).name != plain or RELEASE in v[len(RELEASE):]:
            raise ValueError("name must be a plain folder name ({release} only at its start)")
        return v

    def bundle_name(self, release: str) -> str:
        """The bundle's folder name for a release named ``release``."""
        return self.name.replace(RELEASE, release)

    @property
    def shape_contract(self) -> Shape:
        return Shape(buckets=self.buckets, q_pad=self.q_pad, o_pad=self.o_pad)


class BackboneVerifyPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True
    seed: int = 0
    # the numeric gate runs when the decoder has at most this many parameters (fp16 arithmetic on
    # the Linux CPU runtime takes minutes a chunk at real width); descriptor and weights always
    numeric_max_parameters: int = Field(default=2_000_000_000, ge=0)
    long_record: int | None = Field(default=None, ge=1)


def is_backbone(recipe: Any) -> bool:
    """A backbone recipe (``model = "backbone"``), as opposed to a head recipe."""
    return isinstance(recipe, BackboneRecipe)


class BackboneRecipe(BaseModel):
    """A backbone recipe: the release's Qwen3.5 text decoder, one chunked function with states."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: Literal["backbone"]
    name: str = Field(pattern=r"^(\{release\}|[A-Za-z0-9])[A-Za-z0-9_.-]*$")
    chunk: int = Field(default=64, ge=2, le=4096)
    context: int = Field(default=4096, ge=2)
    # functions at these shorter contexts beside ``main`` (the whole context), sharing its weights: a
    # record runs in the first that holds its chunks, so a chunk attends over that function's slots
    # only (a short request on a 16,384-token decoder pays 4,096 slots, not 16,384; docs/host.md)
    short_contexts: tuple[StrictInt, ...] = ()
    weights: Literal["fp16", "int8", "int4"] = "fp16"
    compute: Literal["fp16", "fp32"] = "fp16"  # the asset is always a Core AI one
    # int8 / int4: symmetric codes per block of ``block`` values along each linear's input axis,
    # fp16 scales (``engine.quantize``); the decoder layers named here stay fp16: a list, or
    # "auto" (``plan-weights`` chooses them for the release's own weights, at build time)
    block: int = Field(default=32, ge=2, le=4096)
    fp16_layers: tuple[StrictInt, ...] | Literal["auto"] = ()  # strict: true or 1.0 is not a layer
    # a plan written by ``plan-weights`` (relative to the recipe's folder): its chosen layers stay fp16
    plan: str | None = None
    plan_budget_dp: float = Field(default=0.02, gt=0, le=1)  # "auto": the end-to-end bar the plan meets
    # "auto": the calibration records the plan measures on (the first N requests; None: every one)
    plan_records: int | None = Field(default=None, ge=1)
    # "auto": where the plan's arithmetic runs (auto: CUDA, then Apple's MPS, then the CPU; fp32 throughout)
    plan_device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    # NMAX: the image rows the decoder takes (the published port's four image inputs; 1,024 at 9B);
    # 0: a text-only decoder (input_ids and position_ids only)
    image_rows: int = Field(default=0, ge=0, le=65536)
    verify: BackboneVerifyPlan = BackboneVerifyPlan()

    _plain_name = field_validator("name")(Recipe._plain_name.__func__)  # type: ignore[attr-defined]

    @field_validator("context")
    @classmethod
    def _whole_chunks(cls, v: int, info) -> int:
        chunk = info.data.get("chunk")
        if chunk and v % chunk:
            raise ValueError(f"context {v} must be a multiple of the chunk {chunk}")
        if chunk and v < 2 * chunk:  # the gate's state arm needs a state carried from one chunk to the next
            raise ValueError(f"context {v} must hold at least two chunks of {chunk} (the gate's state arm "
                             f"runs a record of two or more chunks)")
        return v

    @model_validator(mode="after")
    def _image_fits(self):
        if self.image_rows and self.image_rows + 3 > self.context:
            raise ValueError(f"image_rows {self.image_rows} leave no room in the context {self.context} "
                             f"(an image takes its rows plus three tokens)")
        return self

    @model_validator(mode="after")
    def _short_contexts_fit(self):
        shorter = self.short_contexts
        if list(shorter) != sorted(set(shorter)):
            raise ValueError(f"short_contexts must rise, each once, got {list(shorter)}")
        for c in shorter:
            if c % self.chunk or c < self.chunk or c >= self.context:
                raise ValueError(f"short_contexts: {c} must be a multiple of the chunk {self.chunk}, below the "
                                 f"context {self.context}")
        return self

    @model_validator(mode="after")
    def _long_record_fits(self):
        if self.verify.long_record is not None and self.verify.long_record > self.context:
            raise ValueError(f"verify.long_record {self.verify.long_record} exceeds the context {self.context}")
        return self

    @model_validator(mode="after")
    def _scheme_is_whole(self):
        if self.weights == "fp16" and (self.fp16_layers or self.plan):
            raise ValueError("fp16_layers and plan are for compressed weights (weights = \"int8\" or \"int4\")")
        if self.block % 2:
            raise ValueError(f"block {self.block} must be even (int4 codes are packed two a byte)")
        if isinstance(self.fp16_layers, tuple) and any(i < 0 for i in self.fp16_layers):
            raise ValueError(f"fp16_layers must be layer indices (0 and up), got {list(self.fp16_layers)}")
        if isinstance(self.fp16_layers, tuple) and len(set(self.fp16_layers)) != len(self.fp16_layers):
            raise ValueError(f"fp16_layers names a layer twice: {list(self.fp16_layers)}")
        if self.plan and self.fp16_layers:
            raise ValueError("name either fp16_layers or a plan, not both")
        if self.plan_records is not None and self.weights == "fp16":
            raise ValueError("plan_records is for compressed weights (weights = \"int8\" or \"int4\")")
        return self

    @property
    def scheme(self):
        """The compression scheme (``engine.quantize.Scheme``), None for fp16 weights."""
        if self.weights == "fp16":
            return None
        from .engine.quantize import Scheme

        return Scheme(bits=int(self.weights[3:]), block=self.block)

    @property
    def experimental(self) -> bool:
        """int4 is labelled experimental until a real model's gate says otherwise."""
        return self.weights == "int4"

    def bundle_name(self, release: str) -> str:
        return self.name.replace(RELEASE, release)

    @property
    def long_record(self) -> int:
        return self.verify.long_record or self.context - self.chunk + 1


class VisionVerifyPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True
    seed: int = 0
    # every bucket runs its image where the tower has at most this many parameters; above it, the
    # smallest bucket only (a real-shape tower call takes minutes on the Linux CPU runtime)
    all_buckets_max_parameters: int = Field(default=50_000_000, ge=0)
    # the numeric gate runs at all up to this size (fp16 arithmetic on the Linux CPU runtime is
    # usable at tiny size only: the fp16 recipe's value is small)
    numeric_max_parameters: int = Field(default=2_000_000_000, ge=0)


class VisionRecipe(BaseModel):
    """A vision recipe: the release's tower, one static function per bucket of vision tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: Literal["vision"]
    name: str = Field(pattern=r"^(\{release\}|[A-Za-z0-9])[A-Za-z0-9_.-]*$")
    # merged vision tokens per function (the processor's N = (h / 32) (w / 32)); the last is the cap
    buckets: tuple[int, ...] = (64, 256, 1024)
    weights: Literal["fp16"] = "fp16"
    compute: Literal["fp16", "fp32"] = "fp32"
    verify: VisionVerifyPlan = VisionVerifyPlan()

    _plain_name = field_validator("name")(Recipe._plain_name.__func__)  # type: ignore[attr-defined]
    _increasing = field_validator("buckets")(Recipe._increasing.__func__)  # type: ignore[attr-defined]

    @field_validator("buckets")
    @classmethod
    def _fits_a_record(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        from .host.encode import MAX_LENGTH

        if v and v[-1] > MAX_LENGTH:  # an image's tokens take their place in the record
            raise ValueError(f"bucket {v[-1]:,} tokens cannot fit a record (at most {MAX_LENGTH:,} tokens, "
                             f"the author's systemone default)")
        return v

    @property
    def cap(self) -> int:
        return self.buckets[-1]

    def bundle_name(self, release: str) -> str:
        return self.name.replace(RELEASE, release)


AnyRecipe = Recipe | BackboneRecipe | VisionRecipe


MODELS = {"head": Recipe, "backbone": BackboneRecipe, "vision": VisionRecipe}  # a recipe's ``model`` -> its schema


def load_recipe(path: Path | None) -> AnyRecipe:
    """The recipe at ``path``, checked whole: ``UsageError`` (exit 2) naming the file and the cause."""
    path = Path(path) if path else DEFAULT_RECIPE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: recipe not found") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a folder, not a recipe file (name a conversion/*.toml)") from None
    except (UnicodeDecodeError, PermissionError) as exc:
        raise UsageError(f"{path}: cannot read the recipe ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: recipe is not valid TOML ({exc})") from None
    model = data.get("model", "head")
    if model not in MODELS:
        raise UsageError(f"{path}: model {model!r} is not one this tool builds (known: {', '.join(MODELS)})")
    try:
        return MODELS[model].model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"{path}: invalid recipe {first_validation_error(exc)}{_misplaced(exc, MODELS[model])}") from None


def _misplaced(exc: ValidationError, schema) -> str:
    """A top-level key written under a ``[section]`` (TOML reads a key after a section's header as
    the section's): the hint that says so."""
    for e in exc.errors():
        loc = e.get("loc", ())
        if e.get("type") == "extra_forbidden" and len(loc) == 2 and loc[1] in schema.model_fields:
            return (f" ({loc[1]} is a top-level key: in TOML a key after [{loc[0]}] belongs to that section; "
                    f"move it above [{loc[0]}])")
    return ""
