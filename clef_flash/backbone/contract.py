"""The backbone's names and shapes: one place, checked before anything is traced.

The interface is the published port's text decoder: one function ``main``; inputs ``input_ids
[1, S] int32`` and ``position_ids [1, seq] int32`` (seq varies; the chunk's positions are its last S
entries); states ``keyCache`` / ``valueCache [n_full, 1, n_kv, ctx, head_dim]``, ``convState
[n_linear, 1, conv_channels, kernel - 1]``, ``recState [n_linear, 1, v_heads, k_dim, v_dim]``,
updated in place; output ``hidden [1, S, hidden_size]``, the final-norm rows (no lm_head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..bundle import read_json
from ..errors import not_a_config, refuse_problems
from ..sources.layers import layer_count_problems
from ..ops import MASK_BIAS  # noqa: F401 (the decoder's mask bias is the tower's: one value)

if TYPE_CHECKING:
    from ..engine.quantize import Scheme

FUNCTION = "main"  # the function over the whole context (``max_context``), as the published port's
INPUT_ORDER: tuple[str, ...] = ("input_ids", "position_ids")
STATE_ORDER: tuple[str, ...] = ("keyCache", "valueCache", "convState", "recState")
OUTPUT_NAMES: tuple[str, ...] = ("hidden",)
LINEAR, FULL = "linear_attention", "full_attention"
# Attention over more key slots than this runs in key blocks sharing one max (the same softmax):
# the Apple GPU returned wrong values for one plain softmax over 4,032+ keys (the head does the same).
KEY_BLOCK = 2048


@dataclass(frozen=True)
class TextConfig:
    """What the graph needs of a release's ``text_config`` (Qwen3.5)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    pad_token_id: int
    attn_output_gate: bool = True
    # M-RoPE: rotary frequency j takes the h position if j % 3 == 1 and j < 3 * s[1], the w position
    # if j % 3 == 2 and j < 3 * s[2], else t (transformers' interleaved layout, its default [11, 11, 10]);
    # for text the three positions are equal, so it is plain RoPE
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def state_shapes(self, context: int) -> dict[str, tuple[int, ...]]:
        nf, nl = len(self.full_layers), len(self.linear_layers)
        return {
            "keyCache": (nf, 1, self.num_key_value_heads, context, self.head_dim),
            "valueCache": (nf, 1, self.num_key_value_heads, context, self.head_dim),
            "convState": (nl, 1, self.conv_channels, self.conv_kernel - 1),
            "recState": (nl, 1, self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
        }

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def _text(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("text_config", raw) if isinstance(raw, dict) else {}


def text_config(raw: dict[str, Any], where: str, tokenizer_pad: int | None = None) -> TextConfig:
    """A ``TextConfig`` from a release's ``config.json`` (its ``text_config``); a one-line
    ``IntegrityError`` naming ``where`` when it is not a Qwen3.5 text configuration."""
    t = _text(raw)
    try:
        layer_types = tuple(t["layer_types"])
        head_dim = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
        rope = t.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
        theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} (only default RoPE is exported)")
        pad = t.get("pad_token_id")
        if pad is None:
            pad = tokenizer_pad if tokenizer_pad is not None else t.get("eos_token_id")
        if isinstance(pad, list):
            pad = pad[0]
        cfg = TextConfig(
            vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]), layer_types=layer_types,
            num_attention_heads=int(t["num_attention_heads"]), num_key_value_heads=int(t["num_key_value_heads"]),
            head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=theta,
            linear_num_key_heads=int(t["linear_num_key_heads"]), linear_num_value_heads=int(t["linear_num_value_heads"]),
            linear_key_head_dim=int(t["linear_key_head_dim"]), linear_value_head_dim=int(t["linear_value_head_dim"]),
            conv_kernel=int(t["linear_conv_kernel_dim"]), rms_norm_eps=float(t["rms_norm_eps"]),
            pad_token_id=int(pad) if pad is not None else -1,
            attn_output_gate=bool(t.get("attn_output_gate", True)),
            mrope_section=tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10))),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise not_a_config(where, "Qwen3.5 text configuration", exc) from None
    refuse_problems(where, layer_count_problems(raw) + check_config(cfg))
    return cfg


def check_config(cfg: TextConfig) -> list[str]:
    """What makes a configuration unexportable, in words (empty when it is fine)."""
    out = []
    if not cfg.layer_types or set(cfg.layer_types) - {LINEAR, FULL}:
        out.append(f"layer_types must be {LINEAR} / {FULL}, got {sorted(set(cfg.layer_types))}")
    if not cfg.full_layers or not cfg.linear_layers:
        out.append("layer_types needs at least one linear and one full attention layer")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        out.append("num_attention_heads is not a multiple of num_key_value_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        out.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        out.append(f"rotary dimension {cfg.rotary_dim} must be even and within head_dim {cfg.head_dim}")
    if cfg.conv_kernel < 2:
        out.append("linear_conv_kernel_dim must be >= 2")
    if not 0 <= cfg.pad_token_id < cfg.vocab_size:
        out.append(f"no pad token id within the vocabulary (got {cfg.pad_token_id})")
    if len(cfg.mrope_section) != 3 or any(x < 0 for x in cfg.mrope_section):
        out.append(f"mrope_section must be three sizes, got {list(cfg.mrope_section)}")
    if not cfg.attn_output_gate:
        out.append("attn_output_gate false is not exported (Qwen3.5 gates its attention output)")
    return out


def read_text_config(folder: Path, tokenizer_pad: int | None = None) -> TextConfig:
    path = Path(folder) / "config.json"
    raw = read_json(path, hint="a release folder holds its backbone's config.json")
    return text_config(raw, str(path), tokenizer_pad)


@dataclass(frozen=True)
class Chunking:
    """The recipe's prefill chunk S and maximum context (the KV cache's capacity)."""

    chunk: int
    context: int
    image_rows: int = 0  # NMAX: image rows the decoder takes (the port's four image inputs); 0: text only


@dataclass(frozen=True)
class DecoderFunction:
    """One function of the decoder asset: its name and its KV caches' capacity (``context`` slots)."""

    name: str
    context: int


def function_name(context: int, max_context: int) -> str:
    """``main`` over the whole context; ``main_ctx{N}`` for a shorter one (the recipe's ``short_contexts``)."""
    return FUNCTION if context == max_context else f"{FUNCTION}_ctx{context}"


def decoder_functions(max_context: int, short_contexts=()) -> tuple[DecoderFunction, ...]:
    """Every function of a decoder asset, the shortest context first (the order a host tries them in)."""
    return tuple(DecoderFunction(function_name(c, max_context), c) for c in sorted({*short_contexts, max_context}))


def fitting(functions: tuple[DecoderFunction, ...], tokens: int, chunk: int) -> DecoderFunction:
    """The first function whose slots hold a record's chunks (the longest where none does: its host
    loop then refuses the record, naming the context)."""
    need = chunks_for(tokens, chunk) * chunk
    return next((f for f in functions if f.context >= need), functions[-1])


def states_at(shapes: dict[str, tuple[int, ...]], context: int) -> dict[str, tuple[int, ...]]:
    """The state shapes of a function over ``context`` slots, from another function's: only the KV
    caches' slot axis differs."""
    return {n: (s[:3] + (context,) + s[4:]) if n in ("keyCache", "valueCache") else tuple(s) for n, s in shapes.items()}


def mrope_axes(cfg: TextConfig) -> list[int]:
    """The position axis (0 t, 1 h, 2 w) each of the ``rotary_dim / 2`` frequencies reads."""
    out = []
    for j in range(cfg.rotary_dim // 2):
        out.append(1 if j % 3 == 1 and j < 3 * cfg.mrope_section[1] else 2 if j % 3 == 2 and j < 3 * cfg.mrope_section[2] else 0)
    return out


IMAGE_INPUTS: tuple[str, ...] = ("image_embeds", "image_rc", "rope_shift_start", "rope_shift_amount")
TEXT_SHIFT_START = 1 << 30  # the text-only values: no image row, no shift
NO_IMAGE = {"rope_shift_start": TEXT_SHIFT_START, "rope_shift_amount": 0}


def check_contract(cfg: TextConfig, ch: Chunking) -> None:
    """Names, shapes and chunking consistent before tracing; ``ValueError`` naming the break."""
    if len(set(INPUT_ORDER + STATE_ORDER + OUTPUT_NAMES)) != len(INPUT_ORDER + STATE_ORDER + OUTPUT_NAMES):
        raise ValueError("contract: input, state and output names collide")
    if ch.chunk < 2 or ch.context < ch.chunk or ch.context % ch.chunk:
        raise ValueError(f"contract: context {ch.context} must be a multiple of the chunk {ch.chunk} (>= 2)")
    problems = check_config(cfg)
    if problems:
        raise ValueError(f"contract: {problems[0]}")
    shapes = cfg.state_shapes(ch.context)
    if shapes["keyCache"] != shapes["valueCache"] or shapes["keyCache"][3] != ch.context:
        raise ValueError("contract: key and value caches disagree")


def input_shapes(ch: Chunking, hidden_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Example shapes: position_ids at its largest (seq = context); the image inputs with NMAX rows."""
    out = {"input_ids": (1, ch.chunk), "position_ids": (1, ch.context)}
    if ch.image_rows:
        out.update({"image_embeds": (ch.image_rows, hidden_size), "image_rc": (ch.image_rows, 2),
                    "rope_shift_start": (1,), "rope_shift_amount": (1,)})
    return out


def input_order(ch: Chunking) -> tuple[str, ...]:
    return INPUT_ORDER + (IMAGE_INPUTS if ch.image_rows else ())


def chunks_for(tokens: int, chunk: int) -> int:
    """Calls a record of ``tokens`` tokens takes: ceil(T / S)."""
    return -(-tokens // chunk)


# the checkpoint's names (here, not in graph: the build's plan reads them without importing torch)
LM = "model.language_model."


def weight_names(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, by its checkpoint name, with its shape."""
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    out: dict[str, tuple[int, ...]] = {f"{LM}embed_tokens.weight": (cfg.vocab_size, h), f"{LM}norm.weight": (h,)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{LM}layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "q_proj.weight"] = (nh * hd * (2 if cfg.attn_output_gate else 1), h)
            out[a + "k_proj.weight"] = (nkv * hd, h)
            out[a + "v_proj.weight"] = (nkv * hd, h)
            out[a + "o_proj.weight"] = (h, nh * hd)
            out[a + "q_norm.weight"] = (hd,)
            out[a + "k_norm.weight"] = (hd,)
        else:
            a = p + "linear_attn."
            out[a + "in_proj_qkv.weight"] = (2 * hk + hv, h)
            out[a + "in_proj_z.weight"] = (hv, h)
            out[a + "in_proj_b.weight"] = (cfg.linear_num_value_heads, h)
            out[a + "in_proj_a.weight"] = (cfg.linear_num_value_heads, h)
            out[a + "conv1d.weight"] = (cfg.conv_channels, 1, cfg.conv_kernel)
            out[a + "dt_bias"] = (cfg.linear_num_value_heads,)
            out[a + "A_log"] = (cfg.linear_num_value_heads,)
            out[a + "norm.weight"] = (cfg.linear_value_head_dim,)
            out[a + "out_proj.weight"] = (h, hv)
    return out


LINEARS = re.compile(re.escape(LM) + r"layers\.(\d+)\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|"
                     r"in_proj_b|in_proj_a|out_proj)|mlp\.(gate|up|down)_proj)\.weight$")


def layer_of(name: str) -> int | None:
    """The decoder layer a compressible linear belongs to (None: not a decoder linear)."""
    m = LINEARS.match(name)
    return int(m.group(1)) if m else None


def compressed_names(wanted: dict[str, tuple[int, ...]], scheme: Scheme, fp16_layers=()) -> list[str]:
    """The tensors the scheme compresses: decoder linears outside ``fp16_layers`` whose input axis the
    block divides (anything the scheme cannot block stays fp16)."""
    keep = set(fp16_layers)
    return sorted(n for n, s in wanted.items()
                  if len(s) == 2 and layer_of(n) is not None and layer_of(n) not in keep and s[1] % scheme.block == 0)
