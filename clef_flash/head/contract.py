"""The names and shapes that must agree everywhere: inputs, dtypes, buckets, pads, functions.

Every stage reads these; ``check_contract`` asserts them consistent before anything is traced.
"""

from __future__ import annotations

from dataclasses import dataclass

BUCKETS: tuple[int, ...] = (512, 1024, 2048, 4096)
Q_PAD = 16
O_PAD = 128
# Attention over more keys than this runs in key blocks that share one max (same softmax):
# the Apple GPU returned wrong values for one plain softmax over 4,032+ keys (SOURCE-FACTS).
KEY_BLOCK = 2048
# Additive bias for masked keys / options: exp(x - max) underflows to exactly 0 in fp32 for
# any score magnitude below ~1e8, and the value stays finite so no softmax row turns NaN.
MASK_BIAS = -1.0e9

INPUT_ORDER: tuple[str, ...] = (
    "hidden",
    "key_valid",
    "q_avg",
    "o_avg",
    "g_avg",
    "lexical",
    "member",
    "type_ids",
    "q_valid",
    "o_valid",
)
OUTPUT_NAMES: tuple[str, ...] = ("logits",)

# name -> (symbolic shape, dtype); H is the backbone hidden size.
INPUT_SPECS: dict[str, tuple[tuple[str, ...], str]] = {
    "hidden": (("T", "H"), "f32"),
    "key_valid": (("T",), "f32"),
    "q_avg": (("Q", "T"), "f32"),
    "o_avg": (("O", "T"), "f32"),
    "g_avg": (("1", "T"), "f32"),
    "lexical": (("O", "H"), "f32"),
    "member": (("Q", "O"), "f32"),
    "type_ids": (("Q",), "i32"),
    "q_valid": (("Q",), "f32"),
    "o_valid": (("O",), "f32"),
}
OUTPUT_SPECS: dict[str, tuple[tuple[str, ...], str]] = {"logits": (("O",), "f32")}

QUESTION_TYPES: dict[str, int] = {"noul": 0, "choice": 1, "score": 2}

# The head's configuration: the real one follows from the published 121.8M parameters.
REAL_CONFIG: dict[str, int | float] = {
    "hidden_size": 4096,
    "width": 1024,
    "routing_layers": 2,
    "layers": 4,
    "heads": 16,
    "feedforward": 4096,
    "dropout": 0.0,
}
REAL_PARAMETERS = 121_762_820
TINY_CONFIG: dict[str, int | float] = {
    "hidden_size": 64,
    "width": 32,
    "routing_layers": 2,
    "layers": 2,
    "heads": 4,
    "feedforward": 64,
    "dropout": 0.0,
}
CONFIGS = {"real": REAL_CONFIG, "tiny": TINY_CONFIG}


def function_name(bucket: int) -> str:
    return f"t{bucket}"


def dims(bucket: int, hidden_size: int, q_pad: int = Q_PAD, o_pad: int = O_PAD) -> dict[str, int]:
    return {"T": bucket, "H": hidden_size, "Q": q_pad, "O": o_pad, "1": 1}


def input_shapes(
    bucket: int, hidden_size: int, q_pad: int = Q_PAD, o_pad: int = O_PAD
) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of the ten inputs for one bucket, in ``INPUT_ORDER``."""
    d = dims(bucket, hidden_size, q_pad, o_pad)
    return {name: tuple(d[s] for s in INPUT_SPECS[name][0]) for name in INPUT_ORDER}


def spec_text(name: str, published_hidden: int = 4096) -> str:
    """The manifest's text form of a tensor spec, e.g. ``[T, 4096] f32``."""
    specs = {**INPUT_SPECS, **OUTPUT_SPECS}
    shape, dtype = specs[name]
    parts = [str(published_hidden) if s == "H" else s for s in shape]
    return f"[{', '.join(parts)}] {dtype}"


@dataclass(frozen=True)
class Shape:
    """The shape contract of one export: buckets and pads."""

    buckets: tuple[int, ...] = BUCKETS
    q_pad: int = Q_PAD
    o_pad: int = O_PAD


def check_contract(shape: Shape, hidden_size: int) -> None:
    """Assert names, shapes and buckets consistent; raise ``ValueError`` naming the break."""
    if set(INPUT_SPECS) != set(INPUT_ORDER) or len(INPUT_ORDER) != len(set(INPUT_ORDER)):
        raise ValueError("contract: INPUT_ORDER and INPUT_SPECS name different inputs")
    if not shape.buckets or list(shape.buckets) != sorted(set(shape.buckets)):
        raise ValueError(f"contract: buckets must be strictly increasing, got {shape.buckets}")
    if any(b <= 0 for b in shape.buckets):
        raise ValueError(f"contract: buckets must be positive, got {shape.buckets}")
    if shape.q_pad < 1 or shape.o_pad < 2:
        raise ValueError(f"contract: Q pad must be >= 1 and O pad >= 2, got {shape.q_pad}, {shape.o_pad}")
    if hidden_size <= 0:
        raise ValueError(f"contract: hidden size must be positive, got {hidden_size}")
    names = [function_name(b) for b in shape.buckets]
    if len(set(names)) != len(names):
        raise ValueError(f"contract: function names collide: {names}")
    for b in shape.buckets:
        s = input_shapes(b, hidden_size, shape.q_pad, shape.o_pad)
        if s["hidden"][0] != b or s["q_avg"][1] != b or s["o_avg"][1] != b or s["g_avg"] != (1, b):
            raise ValueError(f"contract: T axis of bucket {b} disagrees across inputs")
        if s["member"] != (shape.q_pad, shape.o_pad) or s["lexical"] != (shape.o_pad, hidden_size):
            raise ValueError(f"contract: Q/O axes of bucket {b} disagree across inputs")
