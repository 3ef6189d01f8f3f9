"""Exporting a torch module in the ops coreai-torch lowers: one ATen trace with the decomposition
table applied, shared by every model that exports to Core AI."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable

from .streamed_weights import trim_freed_memory


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


def export_lowered(module, args: tuple, dynamic_shapes, log: Callable[[str], None] = lambda m: None, what: str = "the graph"):
    """``module`` exported in the ops coreai-torch lowers (its decomposition table applied in the
    trace: ``export_aten``)."""
    from ..formats.aimodel import import_toolchain

    t0 = time.perf_counter()
    ep = export_aten(module, args, dynamic_shapes, import_toolchain().get_decomp_table())
    trim_freed_memory()
    log(f"traced {what} and decomposed in {time.perf_counter() - t0:.1f} s")
    return ep
