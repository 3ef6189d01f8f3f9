"""The vision asset through the Core AI runtime (it runs on Linux CPUs): loaded once, one call per
image, its inputs padded to the image's bucket (``host.tower_inputs``) and the padding's rows dropped."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from ..errors import IntegrityError
from ..interrupts import refuse_if_interrupted
from .contract import INPUT_ORDER, VisionConfig
from .host import TowerCall, image_rows, tower_inputs


@contextlib.asynccontextmanager
async def runner(asset: Path, cfg: VisionConfig, scratch: Path | None = None):
    """``(call, functions)``: ``await call(patches, grid, bucket) -> (rows [N, out_hidden] fp32, TowerCall)``;
    ``functions`` the asset's. The runtime's compiled copy goes to a folder of this process's own
    under ``scratch`` (default: the temp folder)."""
    from coreai.runtime import NDArray

    from ..formats.runtime_compile import executable
    from ..quiet import native_stderr

    # the runtime's own lines (written as it loads a function) off the terminal unless --verbose;
    # fd 2 captured while loading only, so a server's own errors still reach its log
    async with contextlib.AsyncExitStack() as stack:
        with native_stderr():
            model = await stack.enter_async_context(executable(Path(asset), scratch))

        async def call(patches: np.ndarray, grid, bucket: int) -> tuple[np.ndarray, TowerCall]:
            refuse_if_interrupted()  # Ctrl-C: no tower call starts after it (interrupts.run_async)
            c = tower_inputs(patches, grid, cfg, bucket)
            with native_stderr():
                fn = model.load_function(c.function)
            if fn is None:
                raise IntegrityError(f"{asset}: function {c.function} not found")
            res = await fn({k: NDArray(np.ascontiguousarray(c.inputs[k])) for k in INPUT_ORDER})
            return image_rows(np.array(res["image_embeds"].numpy(), dtype=np.float32, copy=True), c), c

        yield call, set(model.function_names)
