"""Linear weights not held in fp32 where ``plan-weights`` runs a linear: fp32 arithmetic all the same.

A release's weights are bf16 or fp16, and a compressed layer's dequantized weights are fp16 values
times a power of two (``quantize.dequantize_torch``): both are exact in fp32. The planner held a
layer widened (0.87 GB at the 9B's width) and the head too (0.49 GB). Now a streamed decoder
layer's linear weight is not held at all (``OnUse``): it is read where the linear is called (the
release's 16 bits widened as they are read, or a compressed layer's dequantization), used and
dropped, and read again by the backward; a layer takes one fp32 matrix at a time (201 MB at the
9B's widest), the reads from the page cache. The head's linears are held in 16 bits where that is
exact (``hold_narrow``) and widened at each call. Either way the forward is ``F.linear`` on the
fp32 matrix and the backward (the options' gradients carried back) widens or reads it again
instead of keeping the fp32 copy autograd would save: the same arithmetic, bit for bit. In the
carry-back (``in_blocks``) a streamed weight is read 16 MB of rows at a time, never whole.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator

BLOCK_BYTES = 16 << 20  # the fp32 rows of a weight read at a time in ``in_blocks``


@dataclass(frozen=True)
class OnUse:
    """A weight read at each use: ``read()`` gives the fp32 matrix (a new torch tensor), dropped
    when the call that read it returns; ``blocks()``, where given, its fp32 row blocks
    ``(r0, r1, rows)`` of about ``BLOCK_BYTES`` each, one at a time, each good until the next is
    asked for (``in_blocks``)."""

    read: Callable[[], Any]
    blocks: Callable[[], Iterator[tuple[int, int, Any]]] | None = None


_blocked = [False]


@contextmanager
def in_blocks():
    """Linears whose weight is read on use compute by row blocks of it during the block: the fp32
    matrix is never whole in memory (201 MB at the 9B's widest, beside one option's activations in
    the plan's carry-back, where the peak is). The forward's output columns are each block's, the
    same dot products; the backward adds the blocks' products, a sum in another order than one
    product's: for gradients whose bits need match nothing but themselves (``estimate.carrying_back``)."""
    kept = _blocked[0]
    _blocked[0] = True
    try:
        yield
    finally:
        _blocked[0] = kept


def widen(w):
    """The fp32 matrix (exact: bf16 / fp16 widened)."""
    import torch

    return w.to(torch.float32)


@lru_cache(maxsize=1)
def _function():
    import torch

    class WidenedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, read, blocks):
            ctx.read, ctx.blocks = read, blocks
            if blocks is not None:  # ``in_blocks``: each block of rows gives its columns of the output
                y = x.new_empty(x.shape[:-1] + (weight.shape[0],))
                for r0, r1, w in blocks():
                    y[..., r0:r1] = torch.nn.functional.linear(x, w, None if bias is None else bias[r0:r1])
                return y
            if read is not None:  # not held: read for this call, read again by the backward
                return torch.nn.functional.linear(x, read(), bias)
            ctx.save_for_backward(weight)
            return torch.nn.functional.linear(x, widen(weight), bias)

        @staticmethod
        def backward(ctx, gy):
            if ctx.blocks is not None:
                gx = None
                for r0, r1, w in ctx.blocks():
                    part = gy[..., r0:r1].matmul(w)
                    gx = part if gx is None else gx.add_(part)
                return gx, None, None, None, None
            wide = ctx.read() if ctx.read is not None else widen(ctx.saved_tensors[0])
            return gy.matmul(wide), None, None, None, None

    return WidenedLinear


def _forward(linear, x):
    weight = linear.weight
    read = getattr(linear, "held_read", None)
    if read is None and weight.dtype == x.dtype:
        return linear.__class__.forward(linear, x)
    blocks = getattr(linear, "held_blocks", None) if _blocked[0] else None
    return _function().apply(x, weight, linear.bias, read, blocks)


def widen_on_use(module) -> list:
    """Every ``nn.Linear`` under ``module`` that is called as one computes with its weight widened at
    each call (a weight in fp32 runs as before); returns them."""
    import torch

    # a MultiheadAttention reads its out_proj's weight itself (F.multi_head_attention_forward): fp32 there
    skip = {id(m.out_proj) for m in module.modules() if isinstance(m, torch.nn.MultiheadAttention)}
    out = [m for m in module.modules() if isinstance(m, torch.nn.Linear) and id(m) not in skip]
    for m in out:
        m.forward = lambda x, m=m: _forward(m, x)
    return out


def hold_narrow(module) -> int:
    """``module``'s linear weights held in bf16 or fp16 where that is exact (their values came from
    16 bits: checked value by value), widened on use; returns the bytes given back."""
    import torch

    saved = 0
    for m in widen_on_use(module):
        w = m.weight
        if w.dtype != torch.float32:
            continue
        for dtype in (torch.bfloat16, torch.float16):
            narrow = w.detach().to(dtype)
            if torch.equal(narrow.to(torch.float32), w.detach()):
                m.weight = torch.nn.Parameter(narrow, requires_grad=False)
                saved += w.numel() * 2
                break
    return saved
