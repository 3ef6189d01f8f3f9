"""The head's sections of a manifest, from its contract: how to call it, in the published words."""

from __future__ import annotations

from typing import Any

from ..manifest import (
    GRAPH_TEXT, KIND, LEXICAL_TEXT, METADATA_VERSION, OUTPUT_TEXT, SOFTMAX_TEXT, Compilation, Head, Source, host_pad_rule,
    source_section,
)
from ..sources.pins import Pins
from . import contract


def head_section(*, buckets: tuple[int, ...], weights: str, source: Source, hidden_size: int = 4096,
                 q_pad: int = contract.Q_PAD, o_pad: int = contract.O_PAD) -> Head:
    """Everything that describes the head; equal to the published values for the published recipe."""
    return Head(
        graph=GRAPH_TEXT,
        shape="bucket",
        functions=[contract.function_name(b) for b in buckets],
        buckets=[(contract.function_name(b), b) for b in buckets],
        dims=None,
        host_pad="bucket",
        host_pad_rule=host_pad_rule(buckets, q_pad, o_pad),
        inputs={name: contract.spec_text(name, hidden_size) for name in contract.INPUT_ORDER},
        input_order=list(contract.INPUT_ORDER),
        outputs={"logits": OUTPUT_TEXT},
        weights=weights,
        softmax=SOFTMAX_TEXT,
        lexical=LEXICAL_TEXT,
        source=source,
    )


def common_fields(*, name: str, asset: str, buckets: tuple[int, ...], weights: str, pins: Pins, hidden_size: int,
                  date: str, q_pad: int = contract.Q_PAD, o_pad: int = contract.O_PAD) -> dict[str, Any]:
    """The keys every bundle's manifest has, whatever its format; a backend adds ``export``."""
    return {
        "metadata_version": METADATA_VERSION,
        "kind": KIND,
        "name": name,
        "assets": {"main": asset},
        "head": head_section(buckets=buckets, weights=weights, source=source_section(pins), hidden_size=hidden_size,
                             q_pad=q_pad, o_pad=o_pad),
        "aot": None,
        "compilation": Compilation(date=date, targets=[]),
    }
