"""Tracing shared by every backend: example inputs from the contract, trace groups, and
``torch.export`` of ``ClefHeadGraph`` with a static or a dynamic T. torch is imported inside
functions; nothing here knows an asset format."""

from __future__ import annotations

import warnings

from ..engine.lowered import export_aten, no_stack_traces
from . import contract


def example_inputs(bucket: int, hidden_size: int, q_pad: int, o_pad: int):
    import torch

    shapes = contract.input_shapes(bucket, hidden_size, q_pad, o_pad)
    return tuple(
        torch.zeros(shapes[n], dtype=torch.int32 if contract.INPUT_SPECS[n][1] == "i32" else torch.float32)
        for n in contract.INPUT_ORDER
    )


def trace_groups(buckets: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Buckets that attend in one block (T <= KEY_BLOCK) share one trace with a dynamic T, later
    specialised statically per bucket; a larger bucket (key blocks) is traced on its own."""
    plain = tuple(b for b in buckets if b <= contract.KEY_BLOCK)
    groups: list[tuple[str, tuple[int, ...]]] = [("dynamic", plain)] if len(plain) >= 2 else [("static", (b,)) for b in plain]
    return groups + [("static", (b,)) for b in buckets if b > contract.KEY_BLOCK]


# the T axis of each input that has one
T_AXES = {"hidden": 0, "key_valid": 0, "q_avg": 1, "o_avg": 1, "g_avg": 1}


def export_graph(graph, buckets: tuple[int, ...], hidden_size: int, q_pad: int, o_pad: int, decompositions: dict | None = None):
    """``torch.export`` of ``graph``: static T for one bucket, a dynamic T over several; with
    ``decompositions`` (a table, ``{}`` for none) in the ATen dialect (``export_aten``). The example
    inputs are dropped from the program (up to 64 MB of zeros nothing reads again)."""
    import gc

    import torch
    from torch.export import Dim

    dynamic_shapes = None
    if len(buckets) > 1:
        t = Dim("T", min=min(buckets), max=max(buckets))
        dynamic_shapes = {n: ({T_AXES[n]: t} if n in T_AXES else None) for n in contract.INPUT_ORDER}
    args = example_inputs(max(buckets), hidden_size, q_pad, o_pad)
    if decompositions is not None:
        return export_aten(graph, args, dynamic_shapes, decompositions)
    with warnings.catch_warnings(), no_stack_traces():
        warnings.simplefilter("ignore")
        ep = torch.export.export(graph, args, dynamic_shapes=dynamic_shapes, strict=False)
    ep.example_inputs = None
    gc.collect()  # the tracer's fake tensors and graphs hold cycles
    return ep


