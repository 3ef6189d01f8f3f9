"""Torch ops the decoder and the vision tower share (attention in key blocks, rotary halves): a leaf.
torch is imported inside each op, so the contracts that read ``MASK_BIAS`` stay torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Additive bias of a key slot a query may not see: exp underflows to exactly 0 in fp32 and fp16
# (after the max is subtracted), and the value stays finite so no row turns NaN.
MASK_BIAS = -30000.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v in fp32; over more than ``block`` slots, per key block with
    one shared max (the same softmax, computed blockwise)."""
    import torch

    n = k.shape[-2]
    if n <= block:
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
        return torch.matmul(torch.softmax(s, dim=-1), v.float())
    edges = list(range(0, n, block)) + [n]
    scores = [torch.matmul(q, k[..., a:b, :].transpose(-1, -2)).float() * scale + bias[..., a:b]
              for a, b in zip(edges, edges[1:])]
    m = torch.stack([s.amax(-1, keepdim=True) for s in scores], dim=0).amax(0)
    num = den = None
    for (a, b), s in zip(zip(edges, edges[1:]), scores):
        e = torch.exp(s - m)
        part_num, part_den = torch.matmul(e, v[..., a:b, :].float()), e.sum(-1, keepdim=True)
        num = part_num if num is None else num + part_num
        den = part_den if den is None else den + part_den
    return num / den
