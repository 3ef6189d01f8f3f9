"""Tracing shared by every backend: example inputs from the contract, trace groups, and
``torch.export`` of ``ClefHeadGraph`` with a static or a dynamic T. torch is imported inside
functions; nothing here knows an asset format."""

from __future__ import annotations

import contextlib
import warnings

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


@contextlib.contextmanager
def no_stack_traces():
    """FX records a symbolised Python stack per node (a third of a static trace); the converters'
    debug locations built from them are dropped before saving anyway."""
    import torch.fx.config as fx_config

    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


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


def export_aten(module, args: tuple, dynamic_shapes, decompositions: dict):
    """``module`` exported in the ATen dialect with ``decompositions`` applied, in one trace.

    ``torch.export.export`` then ``run_decompositions`` traces the program twice, the second time
    the slower (the 9B decoder: 12.5 + 23.8 s). torch's own export at aot dispatch takes the table
    in its one trace: the same ops in the same order, less torch.export's ``_assert_tensor_metadata``
    checks (tests hold the two routes' assets byte for byte). Private torch API, pinned with torch
    2.13.0; where it is missing the two public passes run instead."""
    import functools
    import gc

    import torch

    with warnings.catch_warnings(), no_stack_traces():  # the decomposition traces too: no stack traces
        warnings.simplefilter("ignore")
        parts = _one_pass_api()
        if parts is None:
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
            ep = ep.run_decompositions(dict(decompositions))
        else:
            trace_mod, split, override = parts
            cia, python_table = split(dict(decompositions))
            plain = trace_mod._export_to_aten_ir  # noqa: SLF001
            trace_mod._export_to_aten_ir = functools.partial(plain, decomp_table=python_table)  # noqa: SLF001
            try:
                with override(cia):
                    ep = trace_mod._export(module, args, dynamic_shapes=dynamic_shapes, strict=False, pre_dispatch=False)  # noqa: SLF001
            finally:
                trace_mod._export_to_aten_ir = plain  # noqa: SLF001
    ep.example_inputs = None  # nothing reads them again
    gc.collect()  # the tracer's fake tensors and graphs hold cycles
    return ep


def _one_pass_api():
    """(torch.export._trace, run_decompositions' split of a table into CompositeImplicitAutograd
    overrides and python decompositions, the override) where this torch has them as 2.13.0 does;
    None otherwise."""
    import inspect

    try:
        from torch.export import _trace
        from torch.export.exported_program import _override_composite_implicit_decomp, _split_decomp_table_to_cia_and_python_decomp
    except ImportError:
        return None
    if not callable(getattr(_trace, "_export", None)) or "pre_dispatch" not in inspect.signature(_trace._export).parameters:  # noqa: SLF001
        return None
    if "decomp_table" not in inspect.signature(_trace._export_to_aten_ir).parameters:  # noqa: SLF001
        return None
    return _trace, _split_decomp_table_to_cia_and_python_decomp, _override_composite_implicit_decomp
