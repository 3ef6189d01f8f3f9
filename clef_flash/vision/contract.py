"""The vision tower's names, shapes and preprocessing: one place, read before anything is traced.

How it works: docs/modules.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bundle import read_json
from ..errors import IntegrityError, not_a_config, refuse_problems
from ..sources.image_processor import image_processor_settings
from ..sources.layers import layer_count_problems

VISUAL = "model.visual."
INPUT_ORDER: tuple[str, ...] = ("patches", "pos_index", "pos_weight", "patch_rc", "patch_count")
OUTPUT_NAMES: tuple[str, ...] = ("image_embeds",)
TAPS = 4  # bilinear: two taps an axis
KIND = "vision-tower"


def function_name(tokens: int) -> str:
    return f"n{tokens}"


@dataclass(frozen=True)
class VisionConfig:
    """What the graph needs of a release's ``vision_config`` (Qwen3.5's tower)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_position_embeddings: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    in_channels: int
    rope_theta: float
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def vision_config(raw: dict[str, Any], where: str) -> VisionConfig:
    """A ``VisionConfig`` from a release's ``config.json``; a one-line ``IntegrityError`` naming
    ``where`` when it has no Qwen3.5 tower."""
    v = raw.get("vision_config") if isinstance(raw, dict) else None
    if not isinstance(v, dict):
        raise IntegrityError(f"{where}: no vision_config (the release has no vision tower)")
    try:
        rope = v.get("rope_parameters") or {}
        cfg = VisionConfig(
            depth=int(v["depth"]), hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_heads=int(v["num_heads"]), num_position_embeddings=int(v["num_position_embeddings"]),
            out_hidden_size=int(v["out_hidden_size"]), patch_size=int(v["patch_size"]),
            spatial_merge_size=int(v["spatial_merge_size"]), temporal_patch_size=int(v["temporal_patch_size"]),
            in_channels=int(v.get("in_channels", 3)), rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")))
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"rope_type {rope['rope_type']!r} (the tower's rotary is axial)")
    except (KeyError, TypeError, ValueError) as exc:
        raise not_a_config(where, "Qwen3.5 vision configuration", exc) from None
    refuse_problems(where, layer_count_problems(raw))  # transformers reads the whole file: its text part too
    refuse_problems(where, check_config(cfg), "vision_config: ")
    return cfg


def check_config(cfg: VisionConfig) -> list[str]:
    out = []
    if cfg.hidden_size % cfg.num_heads:
        out.append("hidden_size is not a multiple of num_heads")
    if cfg.head_dim % 4:
        out.append(f"head_dim {cfg.head_dim} must be a multiple of 4 (two rotary axes, two halves)")
    if cfg.side ** 2 != cfg.num_position_embeddings:
        out.append(f"num_position_embeddings {cfg.num_position_embeddings} is not a square")
    if cfg.hidden_act not in ("gelu_pytorch_tanh",):
        out.append(f"hidden_act {cfg.hidden_act!r} (the exported blocks use gelu_pytorch_tanh)")
    if cfg.depth < 1 or cfg.spatial_merge_size < 1:
        out.append("depth and spatial_merge_size must be >= 1")
    return out


def read_vision_config(folder: Path) -> VisionConfig:
    path = Path(folder) / "config.json"
    return vision_config(read_json(path, hint="a release folder holds its config.json"), str(path))


@dataclass(frozen=True)
class Preprocessing:
    """The image processor's rule (``Qwen2VLImageProcessor`` as the release configures it)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def min_tokens(self) -> int:
        return -(-self.min_pixels // self.factor ** 2)

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


RESAMPLE = {3: "bicubic"}  # PIL's numbering, as preprocessor_config.json stores it


def preprocessing(raw: dict[str, Any], where: str, vcfg: VisionConfig | None = None) -> Preprocessing:
    """The release's ``preprocessor_config.json``, checked against its tower (patch, merge, frames)."""
    try:
        size = raw.get("size") or {}
        pre = Preprocessing(
            patch_size=int(raw["patch_size"]), temporal_patch_size=int(raw["temporal_patch_size"]),
            merge_size=int(raw["merge_size"]),
            image_mean=tuple(float(x) for x in raw["image_mean"]), image_std=tuple(float(x) for x in raw["image_std"]),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels"))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels"))),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            resample=RESAMPLE.get(int(raw.get("resample", 3)), str(raw.get("resample"))))
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise IntegrityError(f"{where}: not a Qwen2-VL image processor configuration ({what})") from None
    problems = []
    if pre.resample != "bicubic":
        problems.append(f"resample {pre.resample!r} (bicubic is reproduced)")
    if len(pre.image_mean) != 3 or len(pre.image_std) != 3:
        problems.append("image_mean / image_std must have three channels")
    if raw.get("do_resize", True) is False or raw.get("do_rescale", True) is False or raw.get("do_normalize", True) is False:
        problems.append("do_resize, do_rescale and do_normalize must be on (the tower was trained so)")
    if vcfg is not None:
        if (pre.patch_size, pre.merge_size, pre.temporal_patch_size) != \
                (vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size):
            problems.append(f"patch {pre.patch_size} / merge {pre.merge_size} / frames {pre.temporal_patch_size} "
                            f"differ from the tower's {vcfg.patch_size} / {vcfg.spatial_merge_size} / "
                            f"{vcfg.temporal_patch_size}")
    if not 0 < pre.min_pixels <= pre.max_pixels:
        problems.append(f"min_pixels {pre.min_pixels} / max_pixels {pre.max_pixels}")
    if problems:
        raise IntegrityError(f"{where}: {problems[0]}")
    return pre


def read_preprocessing(folder: Path, vcfg: VisionConfig | None = None) -> Preprocessing:
    raw, where = image_processor_settings(folder)
    return preprocessing(raw, where, vcfg)


def weight_names(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower reads, by checkpoint name, with its shape."""
    h, m, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    big = h * cfg.merge_unit
    out: dict[str, tuple[int, ...]] = {
        f"{VISUAL}patch_embed.proj.weight": (h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        f"{VISUAL}patch_embed.proj.bias": (h,),
        f"{VISUAL}pos_embed.weight": (cfg.num_position_embeddings, h),
        f"{VISUAL}merger.norm.weight": (h,), f"{VISUAL}merger.norm.bias": (h,),
        f"{VISUAL}merger.linear_fc1.weight": (big, big), f"{VISUAL}merger.linear_fc1.bias": (big,),
        f"{VISUAL}merger.linear_fc2.weight": (o, big), f"{VISUAL}merger.linear_fc2.bias": (o,),
    }
    for i in range(cfg.depth):
        p = f"{VISUAL}blocks.{i}."
        out.update({p + "norm1.weight": (h,), p + "norm1.bias": (h,), p + "norm2.weight": (h,), p + "norm2.bias": (h,),
                    p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
                    p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                    p + "mlp.linear_fc1.weight": (m, h), p + "mlp.linear_fc1.bias": (m,),
                    p + "mlp.linear_fc2.weight": (h, m), p + "mlp.linear_fc2.bias": (h,)})
    return out


def input_shapes(cfg: VisionConfig, tokens: int) -> dict[str, tuple[int, ...]]:
    p = tokens * cfg.merge_unit
    return {"patches": (p, cfg.patch_dim), "pos_index": (p, TAPS), "pos_weight": (p, TAPS),
            "patch_rc": (p, 2), "patch_count": (1,)}


def input_dtypes() -> dict[str, str]:
    return {"patches": "fp32", "pos_index": "int32", "pos_weight": "fp32", "patch_rc": "int32", "patch_count": "int32"}
