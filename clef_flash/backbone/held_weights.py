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
instead of keeping the fp32 copy autograd would save: the same arithmetic, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable


@dataclass(frozen=True)
class OnUse:
    """A weight read at each use: ``read()`` gives the fp32 matrix (a new torch tensor), dropped
    when the call that read it returns."""

    read: Callable[[], Any]


def widen(w, shift: int = 0):
    """The fp32 matrix (exact: bf16 / fp16 widened; a power of two, as the build's scaling)."""
    import torch

    wide = w.to(torch.float32)
    if shift:
        wide = (wide if wide is not w else wide.clone()).mul_(2.0 ** -shift)
    return wide


@lru_cache(maxsize=1)
def _function():
    import torch

    class WidenedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, read):
            ctx.read = read
            if read is not None:  # not held: read for this call, read again by the backward
                return torch.nn.functional.linear(x, read(), bias)
            ctx.save_for_backward(weight)
            return torch.nn.functional.linear(x, widen(weight), bias)

        @staticmethod
        def backward(ctx, gy):
            wide = ctx.read() if ctx.read is not None else widen(ctx.saved_tensors[0])
            return gy.matmul(wide), None, None, None

    return WidenedLinear


def _forward(linear, x):
    weight = linear.weight
    read = getattr(linear, "held_read", None)
    if read is None and weight.dtype == x.dtype:
        return linear.__class__.forward(linear, x)
    return _function().apply(x, weight, linear.bias, read)


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
