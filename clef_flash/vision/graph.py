"""``VisionTower``: Qwen3.5's vision tower over one image padded to a bucket of P patches, with the
grid-derived tensors as inputs (``contract``), so its shapes are static and nothing in it depends on
the image's grid. torch only, no Core AI: the module traced for export is the one tests run eagerly.

How it works: docs/modules.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import MASK_BIAS, attend, rotate_half
from .contract import VISUAL, VisionConfig, weight_names

KEY_BLOCK = 2048  # attention over more patches than this runs per key block (as the decoder's)
LN_EPS = 1e-6


class VisionTower(torch.nn.Module):
    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor], compute: str = "fp32",
                 exponents: dict[str, int] | None = None, key_block: int = KEY_BLOCK) -> None:
        super().__init__()
        if compute not in ("fp32", "fp16"):
            raise ValueError(f"compute must be fp32 or fp16, got {compute!r}")
        missing = [n for n in weight_names(cfg) if n not in weights]
        if missing:
            raise ValueError(f"weights lack {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        self.cfg, self.compute, self.key_block = cfg, compute, key_block
        self.dtype = torch.float32 if compute == "fp32" else torch.float16
        self.exponents = dict(exponents or {})
        self.w = {n: t for n, t in weights.items() if t.dim() < 2}
        self._buffer = {}
        for i, name in enumerate(sorted(n for n, t in weights.items() if t.dim() >= 2)):
            t = weights[name]
            if t.dim() > 2:  # the Conv3d's [hidden, C, T, p, p] as the matmul reads it: a view, same bytes
                t = t.reshape(t.shape[0], -1)
            self._buffer[name] = f"w{i}"
            self.register_buffer(f"w{i}", t, persistent=False)
        quarter = cfg.head_dim // 4
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))

    def _mat(self, name: str) -> torch.Tensor:
        return getattr(self, self._buffer[name]).to(self.dtype)

    def _unscale(self, y: torch.Tensor, name: str) -> torch.Tensor:
        k = self.exponents.get(name, 0)
        return y * (2.0 ** -k) if k else y

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        y = self._unscale(F.linear(x.to(self.dtype), self._mat(prefix + "weight")), prefix + "weight")
        return y + self.w[prefix + "bias"].to(y.dtype)

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.w[prefix + "weight"].float(), self.w[prefix + "bias"].float(),
                            LN_EPS).to(self.dtype)

    def forward(self, patches, pos_index, pos_weight, patch_rc, patch_count):
        cfg = self.cfg
        P = patches.shape[0]
        x = self._lin(patches, f"{VISUAL}patch_embed.proj.")
        table = f"{VISUAL}pos_embed.weight"
        taps = F.embedding(pos_index.long(), getattr(self, self._buffer[table])).float()  # [P, 4, hidden]
        pos = self._unscale((taps * pos_weight[:, :, None]).sum(1), table)
        x = x + pos.to(x.dtype)
        rc = patch_rc.float()
        freqs = torch.cat((rc[:, :1] * self.inv_freq[None], rc[:, 1:] * self.inv_freq[None]), dim=-1)  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [P, 1, hd]
        cos, sin = emb.cos(), emb.sin()
        # keys past the image's patches are never seen (the padding's rows are computed and dropped)
        bias = torch.where(torch.arange(P, dtype=torch.int32)[None, :] < patch_count[:, None], 0.0, MASK_BIAS)  # [1, P]
        for i in range(cfg.depth):
            p = f"{VISUAL}blocks.{i}."
            x = x + self._attn(self._ln(x, p + "norm1."), p + "attn.", cos, sin, bias)
            h = F.gelu(self._lin(self._ln(x, p + "norm2."), p + "mlp.linear_fc1."), approximate="tanh")
            x = x + self._lin(h, p + "mlp.linear_fc2.")
        m = f"{VISUAL}merger."
        h = self._ln(x, m + "norm.").reshape(P // cfg.merge_unit, cfg.hidden_size * cfg.merge_unit)
        h = F.gelu(self._lin(h, m + "linear_fc1."))
        return self._lin(h, m + "linear_fc2.")

    def _attn(self, x, a, cos, sin, bias):
        cfg = self.cfg
        P, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        qkv = self._lin(x, a + "qkv.").reshape(P, 3, nh, hd)
        q, k, v = qkv[:, 0].float(), qkv[:, 1].float(), qkv[:, 2]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose(0, 1).to(self.dtype) for t in (q, k, v))  # [nh, P, hd]
        o = attend(q, k, v, bias, hd ** -0.5, self.key_block)  # [nh, P, hd] fp32
        return self._lin(o.transpose(0, 1).reshape(P, nh * hd).to(self.dtype), a + "proj.")
