"""The backbone asset through the Core AI runtime (it runs on Linux CPUs): ``main`` loaded once,
zero states allocated per record as runtime arrays that the function updates in place."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError
from .contract import FUNCTION, OUTPUT_NAMES, STATE_ORDER
from ..interrupts import run_async

_NP = {"fp16": np.float16, "fp32": np.float32}


@contextlib.asynccontextmanager
async def runner(asset: Path, state_shapes: dict[str, tuple[int, ...]], state_dtype: str, scratch: Path | None = None):
    """``(call, new_states)``: ``call(inputs, states) -> hidden [S, H]`` fp32. The runtime's compiled
    copy goes to a folder of this process's own under ``scratch`` (default: the temp folder)."""
    from coreai.runtime import NDArray

    from ..formats.runtime_compile import executable
    from ..quiet import native_stderr

    # the runtime's own lines (it writes them as it loads, never as it runs) off the terminal unless
    # --verbose: fd 2 is captured while loading only, so a server's own errors still reach its log
    async with contextlib.AsyncExitStack() as stack:
        with native_stderr():
            model = await stack.enter_async_context(executable(Path(asset), scratch))
            fn = model.load_function(FUNCTION)
        if fn is None:
            raise IntegrityError(f"{asset}: function {FUNCTION} not found")

        def new_states() -> dict[str, Any]:
            return {n: NDArray(np.zeros(state_shapes[n], dtype=_NP[state_dtype])) for n in STATE_ORDER}

        async def call(inputs: dict[str, np.ndarray], states: dict[str, Any]) -> np.ndarray:
            out = await fn({k: NDArray(np.ascontiguousarray(v)) for k, v in inputs.items()}, states)
            return np.array(out[OUTPUT_NAMES[0]].numpy(), dtype=np.float32, copy=True)[0]

        yield call, new_states


async def _describe(asset: Path) -> dict[str, Any]:
    from ..formats.runtime_compile import executable

    async with executable(Path(asset)) as model:
        return _descriptor(model)


def _descriptor(model) -> dict[str, Any]:
    out = {"functions": list(model.function_names)}
    fn = model.load_function(FUNCTION)
    if fn is None:
        return out
    d = fn.desc

    def spec(desc) -> dict[str, Any]:
        return {"shape": [int(x) if isinstance(x, int) else str(x) for x in desc.shape], "dtype": str(desc.dtype)}

    out["inputs"] = {n: spec(d.input_descriptor(n)) for n in d.input_names}
    out["states"] = {n: spec(d.state_descriptor(n)) for n in d.state_names}
    out["outputs"] = {n: spec(d.output_descriptor(n)) for n in d.output_names}
    return out


def describe(asset: Path) -> dict[str, Any]:
    """Functions, inputs, states and outputs as the runtime reports them."""
    import warnings

    from ..quiet import native_stderr

    with warnings.catch_warnings(), native_stderr():
        warnings.simplefilter("ignore")
        return run_async(lambda: _describe(Path(asset)))
