"""The host loop (numpy only): a record's token ids through the backbone asset, chunk by chunk.

Zero states per record; ceil(T / S) calls; call c gets the chunk's ids (the last chunk padded
with the pad token) and ``position_ids`` the ramp 0 … (c + 1) * S - 1, whose last S entries are
the chunk's positions; the ``hidden`` rows are collected and cut to T: the rows the head's
``head_inputs`` takes. ``red`` perturbs the loop the way a broken host would (the gate must see it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from .contract import NO_IMAGE, DecoderFunction, chunks_for  # noqa: F401 (the gate counts calls with it)

RED_ARMS = ("state_reset", "positions_late")
# what a broken host would do with an image (the gate must see each)
IMAGE_RED_ARMS = ("image_zeroed", "rc_swapped", "shift_dropped")


@dataclass(frozen=True)
class RecordStates:
    """A record's zero states and the function they are shaped for (its ``context`` slots)."""

    function: DecoderFunction
    arrays: dict[str, Any]


@dataclass(frozen=True)
class ImageSpan:
    """One image in a record: its first token's index, the tower's rows, the merged grid."""

    start: int
    rows: np.ndarray  # [N, hidden] fp32, row-major over the merged grid
    grid: tuple[int, int]  # (H, W), H * W = N

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def image_inputs(image_rows: int, hidden: int, dtype, image: ImageSpan | None = None,
                 red: str | None = None) -> dict[str, np.ndarray]:
    """The decoder's four image inputs (the same for every chunk of a record): the text-only values
    (zeros, zeros, 1 << 30, 0) without an image."""
    embeds = np.zeros((image_rows, hidden), dtype=dtype)
    rc = np.zeros((image_rows, 2), dtype=np.int32)
    start, amount = NO_IMAGE["rope_shift_start"], NO_IMAGE["rope_shift_amount"]
    if image is not None:
        n, (h, w) = image.tokens, image.grid
        if n > image_rows:
            raise ValueError(f"{n} image tokens: more than the decoder's {image_rows} image rows")
        if image.rows.shape != (n, hidden):
            raise ValueError(f"image rows {image.rows.shape}, expected {(n, hidden)}")
        if red != "image_zeroed":
            embeds[:n] = image.rows
        k = np.arange(n)
        rc[:n, 0], rc[:n, 1] = (k % w, k // w) if red == "rc_swapped" else (k // w, k % w)
        start, amount = image.start + n, (0 if red == "shift_dropped" else n - max(h, w))
    return {"image_embeds": embeds, "image_rc": rc, "rope_shift_start": np.array([start], np.int32),
            "rope_shift_amount": np.array([amount], np.int32)}


def image_ids(ids: np.ndarray, image: ImageSpan, vocab: int) -> np.ndarray:
    """The ids the decoder takes: image token k as V + k (its row in image_embeds)."""
    out = np.asarray(ids, dtype=np.int64).reshape(-1).copy()
    if image.start + image.tokens > len(out):
        raise ValueError(f"the image's {image.tokens} tokens from index {image.start} overrun the record of {len(out)}")
    out[image.start:image.start + image.tokens] = vocab + np.arange(image.tokens)
    return out


def chunk_inputs(ids: np.ndarray, chunk: int, context: int, pad_id: int, red: str | None = None,
                 extra: dict[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """The inputs of every call for one record (``extra``: the image inputs, the same every call)."""
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
        out.append({"input_ids": padded[None, c * chunk:(c + 1) * chunk].copy(), "position_ids": pos[None], **(extra or {})})
    return out


def record_slots(tokens: int, chunk: int, red: str | None = None) -> int:
    """The slots a record's function must hold: its tokens; with positions one late (a red arm), one
    past its chunks, which that broken host writes."""
    return chunks_for(tokens, chunk) * chunk + 1 if red == "positions_late" else tokens


async def run_record(call: Callable[[dict[str, np.ndarray], RecordStates], Awaitable[np.ndarray]],
                     new_states: Callable[[int], RecordStates], ids: np.ndarray, chunk: int, pad_id: int,
                     red: str | None = None, extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Hidden rows ``[T, hidden]`` (fp32) of one record: ``call(inputs, states)`` runs one chunk in
    ``states.function`` and updates ``states.arrays`` in place; ``new_states(tokens)`` gives zero
    states of the first function that holds a record of that many tokens."""
    if red is not None and red not in RED_ARMS and red not in IMAGE_RED_ARMS:
        raise ValueError(f"red arm must be one of {RED_ARMS}, got {red!r}")
    t = len(np.asarray(ids).reshape(-1))
    slots = record_slots(t, chunk, red)
    states = new_states(slots)
    rows = []
    for inputs in chunk_inputs(ids, chunk, states.function.context, pad_id, red, extra):
        if red == "state_reset":  # the state not carried between chunks
            states = new_states(slots)
        rows.append(np.asarray(await call(inputs, states), dtype=np.float32).reshape(chunk, -1))
    return np.concatenate(rows)[:t]
