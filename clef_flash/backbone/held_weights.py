"""Linear weights held in 16 bits and widened to fp32 where a linear uses them (``plan-weights``).

A release's weights are bf16 or fp16, and a compressed layer's dequantized weights are fp16 values
times a power of two (``quantize.dequantize_torch``): both are exact in fp32. The planner held
them widened, 4 bytes a value: a 9B layer is 0.87 GB, the head 0.49 GB, and a compressed layer
and its uncompressed form were held at once. Held as they are (2 bytes) and widened one matrix
at a time, the arithmetic is the same fp32 bit for bit: the forward is ``F.linear`` on the widened
matrix, and the backward (the options' gradients carried back) widens it again instead of
keeping the fp32 copy autograd would save.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Held:
    """A weight held in 16 bits: fp32 = ``values`` widened, times ``2**-shift``."""

    values: Any  # torch.bfloat16 / torch.float16
    shift: int = 0


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
        def forward(ctx, x, weight, bias, shift):
            ctx.shift = shift
            ctx.save_for_backward(weight)
            return torch.nn.functional.linear(x, widen(weight, shift), bias)

        @staticmethod
        def backward(ctx, gy):
            (weight,) = ctx.saved_tensors
            return gy.matmul(widen(weight, ctx.shift)), None, None, None

    return WidenedLinear


def _forward(linear, x):
    weight = linear.weight
    shift = getattr(linear, "held_shift", 0)
    if weight.dtype == x.dtype and not shift:
        return linear.__class__.forward(linear, x)
    return _function().apply(x, weight, linear.bias, shift)


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
