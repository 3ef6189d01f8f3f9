"""Weight-only compression of the decoder's linears: symmetric integer codes per block of the input
axis, one fp16 scale a block, as coreai-torch's ``constexpr_blockwise_shift_scale`` reads them
(``output = scale * code``, blocks ``[1, block]`` of an ``[out, in]`` matrix; int4 packed two a byte,
the even element in the low nibble).

How it works: docs/modules.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


SCALE_FLOOR = 2.0 ** -14  # the smallest normal fp16: a smaller scale would be flushed by the runtime


@dataclass(frozen=True)
class Scheme:
    bits: int  # 8 or 4
    block: int  # values a scale covers, along the input axis

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def weights(self) -> str:
        return f"int{self.bits}"

    def code_bytes(self, shape: tuple[int, ...]) -> int:
        n = int(np.prod(shape))
        return n if self.bits == 8 else (n + 1) // 2

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (shape[0], shape[1] // self.block)

    def scale_bytes(self, shape: tuple[int, ...]) -> int:
        return int(np.prod(self.scale_shape(shape))) * 2


# ------------------------------------------------------------------ the build's quantizer (torch)

def scales_torch(w, scheme: Scheme, work=None):
    """``w [r, in]`` fp32 (torch) -> the scales fp16 ``[r, in/block]`` alone: what ``quantize_torch``
    gives with the codes, for a blob of scales written before its codes (the converter's order)."""
    import torch

    r, cols = w.shape
    shape = (r, cols // scheme.block, scheme.block)
    tmp = (torch.empty(shape, dtype=torch.float32) if work is None else work[: w.numel()].view(shape))
    torch.abs(w.reshape(shape), out=tmp)
    return torch.clamp((tmp.amax(-1) / scheme.qmax).to(torch.float16), min=SCALE_FLOOR)


def codes_torch(w, scales, scheme: Scheme, work=None, codes_out=None):
    """``w [r, in]`` fp32 (torch) and its ``scales`` (``scales_torch``) -> codes int8 ``[r, in]``."""
    import torch

    r, cols = w.shape
    shape = (r, cols // scheme.block, scheme.block)
    tmp = (torch.empty(shape, dtype=torch.float32) if work is None else work[: w.numel()].view(shape))
    torch.div(w.reshape(shape), scales.float()[..., None], out=tmp)
    tmp.round_().clamp_(-scheme.qmax, scheme.qmax)
    codes = torch.empty((r, cols), dtype=torch.int8) if codes_out is None else codes_out[: w.numel()].view(r, cols)
    codes.copy_(tmp.view(r, cols))
    return codes


def quantize_torch(w, scheme: Scheme, work=None, codes_out=None):
    """``w [r, in]`` fp32 (torch) -> codes int8 ``[r, in]`` (int4 values unpacked), scales fp16 ``[r, in/block]``.

    ``work`` (fp32, at least ``w``'s values) and ``codes_out`` (int8, as many): buffers reused from
    block to block. A fresh 64 MB temporary per step cost more in page faults than its arithmetic
    (measured: 140 ms against 56 ms for 16 M values); the values are the same, a test holds it."""
    scales = scales_torch(w, scheme, work)
    return codes_torch(w, scales, scheme, work, codes_out), scales


def dequantize_torch(codes, scales, scheme: Scheme, work=None, half=None):
    """``dequantize`` in torch: ``fp16(code * scale)`` per block (the product exact in fp32, one rounding).
    ``work``: an fp32 buffer of at least ``codes``' values for the products (a fresh 1 MB tile a
    call is a new mapping where allocations that size are mapped: half the planner's dequantization);
    ``half``: an fp16 buffer as large the result is written into (the same rounding as ``.half()``)."""
    r, cols = codes.shape
    blocks = codes.view(r, cols // scheme.block, scheme.block)
    wide = blocks.float() if work is None else work[:codes.numel()].view(blocks.shape).copy_(blocks)
    wide = wide.mul_(scales.float()[..., None])
    if half is None:
        return wide.half().view(r, cols)
    return half[:codes.numel()].view(r, cols).copy_(wide.view(r, cols))


def pack_int4_torch(codes):
    """int8 values in [-8, 7] -> packed bytes (uint8), the even element in the low nibble."""
    import torch

    flat = (codes.reshape(-1) & 0xF).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat((flat, flat.new_zeros(1)))
    return flat[0::2] | (flat[1::2] << 4)


# ------------------------------------------------------------------ the gate's quantizer (numpy)

class Buffers:
    """The numpy rule's temporaries for matrices of up to ``values`` values, reused from call to
    call (the gate runs the rule over cache-sized tiles: a fresh array per step cost it more in
    page faults than the arithmetic, measured 2.5x)."""

    def __init__(self, values: int, scheme: Scheme) -> None:
        self.values = values
        self.f32 = np.empty(values, np.float32)
        self.by_block = np.empty(values, np.float32)  # |w| with the blocks' values as rows (``quantize_np``)
        self.codes = np.empty(values, np.int8)
        n = -(-values // scheme.block)
        self.amax = np.empty(n, np.float32)
        self.scales = np.empty(n, np.float16)
        self.scales32 = np.empty(n, np.float32)


def quantize_np(w: np.ndarray, scheme: Scheme, work: Buffers | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The same rule in numpy (the gate's independent implementation). With ``work`` the codes and
    scales returned are views of its buffers, good until the next call."""
    r, cols = w.shape
    nb, q = cols // scheme.block, np.float32(scheme.qmax)
    work = work if work is not None and work.values >= w.size else Buffers(w.size, scheme)
    blocks = w.reshape(r, nb, scheme.block)
    tmp = work.f32[: w.size].reshape(r, nb, scheme.block)
    amax = work.amax[: r * nb].reshape(r, nb)
    np.abs(blocks, out=tmp)
    # each block's max over long rows: |w| laid out value-of-block major first (numpy's max over a
    # short last axis is slow; exact either way)
    by_block = work.by_block[: w.size].reshape(scheme.block, r * nb)
    np.copyto(by_block, tmp.reshape(r * nb, scheme.block).T)
    np.maximum.reduce(by_block, axis=0, out=amax.reshape(-1))
    np.divide(amax, q, out=amax)
    scales = work.scales[: r * nb].reshape(r, nb)
    np.copyto(scales, amax, casting="unsafe")  # rounds to nearest even, as astype
    np.maximum(scales, np.float16(SCALE_FLOOR), out=scales)
    wide = work.scales32[: r * nb].reshape(r, nb)
    np.copyto(wide, scales)
    np.divide(blocks, wide[..., None], out=tmp)
    np.clip(np.rint(tmp, out=tmp), -q, q, out=tmp)
    codes = work.codes[: w.size].reshape(r, cols)
    np.copyto(codes, tmp.reshape(r, cols), casting="unsafe")
    return codes, scales


def pack_int4(codes: np.ndarray) -> np.ndarray:
    flat = (codes.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate((flat, np.zeros(1, np.uint8)))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    low, high = (packed & 0xF).astype(np.int8), (packed >> 4).astype(np.int8)
    flat = np.stack((low, high), axis=-1).reshape(-1)[:n]
    return np.where(flat > 7, flat - 16, flat).astype(np.int8)


def code_bytes_of(codes: np.ndarray, scheme: Scheme) -> np.ndarray:
    """The codes as the asset stores them (int8 as they are; int4 packed)."""
    return codes.reshape(-1).view(np.uint8) if scheme.bits == 8 else pack_int4(codes)


def codes_from_bytes(data: np.ndarray, shape: tuple[int, ...], scheme: Scheme) -> np.ndarray:
    n = int(np.prod(shape))
    return (data.view(np.int8)[:n] if scheme.bits == 8 else unpack_int4(data, n)).reshape(shape)


def dequantize(codes: np.ndarray, scales: np.ndarray, scheme: Scheme) -> np.ndarray:
    """What the asset computes with: ``fp16(code * scale)`` per block (exact product, one rounding)."""
    r, cols = codes.shape
    full = codes.reshape(r, cols // scheme.block, scheme.block).astype(np.float32) * scales.astype(np.float32)[..., None]
    return full.astype(np.float16).reshape(r, cols)
