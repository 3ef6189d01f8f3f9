"""The backbone asset through the Core AI runtime (it runs on Linux CPUs): each function loaded once,
zero states of the function a record runs in allocated per record as runtime arrays that the
function updates in place."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError
from .contract import OUTPUT_NAMES, STATE_ORDER, DecoderFunction, fitting, states_at
from ..interrupts import run_async

_NP = {"fp16": np.float16, "fp32": np.float32}


@contextlib.asynccontextmanager
async def runner(asset: Path, functions: tuple[DecoderFunction, ...], state_shapes: dict[str, tuple[int, ...]],
                 state_dtype: str, chunk: int, scratch: Path | None = None):
    """``(call, new_states)``: ``call(inputs, states) -> hidden [S, H]`` fp32 in ``states.function``;
    ``new_states(tokens)``: zero states of the first of ``functions`` (shortest first) that holds a
    record of that many tokens, ``state_shapes`` being those of the last (``main``). The runtime's
    compiled copy goes to a folder of this process's own under ``scratch`` (default: the temp folder)."""
    from coreai.runtime import NDArray

    from ..formats.runtime_compile import executable
    from ..quiet import native_stderr
    from .host import RecordStates

    # the runtime's own lines (it writes them as it loads, never as it runs) off the terminal unless
    # --verbose: fd 2 is captured while loading only, so a server's own errors still reach its log
    async with contextlib.AsyncExitStack() as stack:
        with native_stderr():
            model = await stack.enter_async_context(executable(Path(asset), scratch))
            # the shortest function loaded now (most requests run there), a longer one when a record first needs it
            fns = {functions[0].name: model.load_function(functions[0].name)}
        lost = [f.name for f in functions if f.name not in model.function_names] + [n for n, fn in fns.items() if fn is None]
        if lost:
            raise IntegrityError(f"{asset}: function {lost[0]} not found")

        def function(name: str):
            if name not in fns:
                with native_stderr():
                    fns[name] = model.load_function(name)
            return fns[name]

        def new_states(tokens: int) -> RecordStates:
            f = fitting(functions, tokens, chunk)
            shapes = states_at(state_shapes, f.context)
            return RecordStates(f, {n: NDArray(np.zeros(shapes[n], dtype=_NP[state_dtype])) for n in STATE_ORDER})

        async def call(inputs: dict[str, np.ndarray], states: RecordStates) -> np.ndarray:
            out = await function(states.function.name)({k: NDArray(np.ascontiguousarray(v)) for k, v in inputs.items()},
                                                       states.arrays)
            return np.array(out[OUTPUT_NAMES[0]].numpy(), dtype=np.float32, copy=True)[0]

        yield call, new_states


async def _describe(asset: Path) -> dict[str, Any]:
    from ..formats.runtime_compile import executable

    async with executable(Path(asset)) as model:
        return _descriptor(model)


def _descriptor(model) -> dict[str, Any]:
    """``functions`` (names) and ``signatures``: each function's inputs, states and outputs."""
    names = list(model.function_names)

    def spec(desc) -> dict[str, Any]:
        return {"shape": [int(x) if isinstance(x, int) else str(x) for x in desc.shape], "dtype": str(desc.dtype)}

    signatures = {}
    for name in names:
        fn = model.load_function(name)
        if fn is None:
            continue
        d = fn.desc
        signatures[name] = {"inputs": {n: spec(d.input_descriptor(n)) for n in d.input_names},
                            "states": {n: spec(d.state_descriptor(n)) for n in d.state_names},
                            "outputs": {n: spec(d.output_descriptor(n)) for n in d.output_names}}
    return {"functions": names, "signatures": signatures}


def describe(asset: Path) -> dict[str, Any]:
    """Functions, inputs, states and outputs as the runtime reports them."""
    import warnings

    from ..quiet import native_stderr

    with warnings.catch_warnings(), native_stderr():
        warnings.simplefilter("ignore")
        return run_async(lambda: _describe(Path(asset)))
