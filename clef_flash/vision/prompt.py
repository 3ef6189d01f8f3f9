"""The prompt of an image request, from the same request's text-only prompt (pure Python): what a
host does with the tokenizer's ids once it knows the image's N.

How it works: docs/modules.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ImagePrompt:
    ids: tuple[int, ...]
    start: int  # the first image token's index
    tokens: int  # N
    shift: int  # how far everything from the insertion point moved


def insert_image(ids: Sequence[int], at: int, tokens: int, *, start_id: int, pad_id: int, end_id: int,
                 newline: Sequence[int]) -> ImagePrompt:
    """``ids`` (a text-only prompt) with one image of ``tokens`` vision tokens inserted at ``at``."""
    if not 0 <= at <= len(ids):
        raise ValueError(f"insertion point {at} outside the prompt of {len(ids)} tokens")
    media = [start_id] + [pad_id] * tokens + [end_id] + list(newline)
    return ImagePrompt(ids=tuple(ids[:at]) + tuple(media) + tuple(ids[at:]), start=at + 1, tokens=tokens,
                       shift=len(media))


def shift_span(span: tuple[int, int], prompt: ImagePrompt) -> tuple[int, int]:
    """A span of the text-only prompt in the image prompt."""
    at = prompt.start - 1
    a, b = span
    return (a + prompt.shift if a >= at else a, b + prompt.shift if b > at else b)
