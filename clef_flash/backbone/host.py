"""The host loop (numpy only): a record's token ids through the backbone asset, chunk by chunk.

Zero states per record; ceil(T / S) calls; call c gets the chunk's ids (the last chunk padded
with the pad token) and ``position_ids`` the ramp 0 … (c + 1) * S - 1, whose last S entries are
the chunk's positions; the ``hidden`` rows are collected and cut to T: the rows the head's
``head_inputs`` takes. ``red`` perturbs the loop the way a broken host would (the gate must see it).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import numpy as np

from .contract import chunks_for  # noqa: F401 (the gate counts calls with it)

RED_ARMS = ("state_reset", "positions_late")


def chunk_inputs(ids: np.ndarray, chunk: int, context: int, pad_id: int, red: str | None = None) -> list[dict[str, np.ndarray]]:
    """The inputs of every call for one record."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    t = len(ids)
    if t < 1:
        raise ValueError("a record needs at least one token")
    n = chunks_for(t, chunk)
    if n * chunk > context:
        raise ValueError(f"{t} tokens need {n} chunks of {chunk}: more than the context of {context}")
    padded = np.full(n * chunk, pad_id, dtype=np.int32)
    padded[:t] = ids
    out = []
    for c in range(n):
        pos = np.arange((c + 1) * chunk, dtype=np.int32)
        if red == "positions_late":  # every position one token late
            pos = pos + 1
        out.append({"input_ids": padded[None, c * chunk:(c + 1) * chunk].copy(), "position_ids": pos[None]})
    return out


async def run_record(call: Callable[[dict[str, np.ndarray], Any], Awaitable[np.ndarray]],
                     new_states: Callable[[], Any], ids: np.ndarray, chunk: int, context: int, pad_id: int,
                     red: str | None = None) -> np.ndarray:
    """Hidden rows ``[T, hidden]`` (fp32) of one record: ``call(inputs, states)`` runs one chunk and
    updates ``states`` in place; ``new_states()`` gives zero states."""
    if red is not None and red not in RED_ARMS:
        raise ValueError(f"red arm must be one of {RED_ARMS}, got {red!r}")
    states = new_states()
    rows = []
    for inputs in chunk_inputs(ids, chunk, context, pad_id, red):
        if red == "state_reset":  # the state not carried between chunks
            states = new_states()
        rows.append(np.asarray(await call(inputs, states), dtype=np.float32).reshape(chunk, -1))
    return np.concatenate(rows)[: len(np.asarray(ids).reshape(-1))]
