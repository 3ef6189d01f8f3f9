"""``DecoderChunk``: a Qwen3.5 text decoder over one prefill chunk of S tokens, its states explicit.

How it works: docs/modules.md."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .contract import KEY_BLOCK, LM, Chunking, TextConfig, mrope_axes, weight_names  # noqa: F401 (weight_names: re-exported)
from ..ops import MASK_BIAS, attend, rotate_half


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def delta_rule_constants(chunk: int) -> dict:
    """What ``delta_rule_chunk`` needs of the chunk size alone, built once per module (shared by every
    layer, so the graph holds them once): the causal masks and, for each level of the blocked
    inverse, the flat positions in the padded ``[P, P]`` matrix of its sub-diagonal blocks."""
    p = 1 << (chunk - 1).bit_length()
    idx = torch.arange(chunk)
    levels, b = [], 1
    while b < p:
        j, r, c = torch.arange(p // (2 * b))[:, None, None], torch.arange(b)[None, :, None], torch.arange(b)[None, None, :]
        levels.append(((j * 2 * b + b + r) * p + (j * 2 * b + c)).reshape(-1))
        b *= 2
    return {"lower": (idx[:, None] >= idx[None, :]).float(), "strict": (idx[:, None] > idx[None, :]).float(),
            "padded": p, "levels": levels}


def _unit_lower_inverse(a: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
    """(I + a)^-1 for a strictly lower-triangular ``a [H, P, P]``, P a power of two, by doubling:
    the inverses of the diagonal blocks of size b give those of size 2b as
    [[X11, 0], [-X22 A21 X11, X22]] (blocked forward substitution; each level is a few batched
    matmuls over every block at once)."""
    h, p = a.shape[0], a.shape[-1]
    flat = a.reshape(h, p * p)
    x = torch.ones(h * p, 1, 1, dtype=a.dtype)  # the inverses of the 1 x 1 diagonal blocks
    b = 1
    for index in levels:
        n = p // (2 * b)
        a21 = torch.index_select(flat, 1, index).reshape(h * n, b, b)
        pair = x.reshape(h * n, 2, b, b)
        x11, x22 = pair[:, 0], pair[:, 1]
        y = -torch.bmm(torch.bmm(x22, a21), x11)
        x = torch.cat((torch.cat((x11, torch.zeros_like(x11)), -1), torch.cat((y, x22), -1)), -2)  # [H n, 2b, 2b]
        b *= 2
    return x.reshape(h, p, p)


def delta_rule_chunk(q, k, v, beta, log_decay, state, consts: dict | None = None):
    """The gated delta rule over one chunk in closed form (the WY form transformers' torch path uses):
    per token ``s = s * a_t; u_t = beta_t (v_t - s^T k_t); s = s + k_t u_t^T; o_t = s^T q_t``, for all
    S tokens at once. ``q, k [1, S, H, dk]``, ``v [1, S, H, dv]``, ``beta, log_decay [1, S, H]``,
    ``state [1, H, dk, dv]``; fp32. Returns ``o [1, S, H, dv]`` and the chunk's final state.

    With G the cumulative log decay, the updates U solve ``(I + A) U = beta (V - e^G K s0)``, A the
    strictly lower ``beta_t e^(G_t - G_i) k_t.k_i``: one triangular inverse instead of S dependent
    steps, so the graph has about 280 nodes a linear layer rather than 1,650 (trace, decompose
    and convert time scale with them), and no loop (a loop does not lower on the Mac's delegates)."""
    S = q.shape[1]
    c = consts or delta_rule_constants(S)
    Q, K, V = (t[0].transpose(0, 1) for t in (q, k, v))  # [H, S, d]
    bt, ld = beta[0].transpose(0, 1)[:, :, None], log_decay[0].transpose(0, 1)  # [H, S, 1], [H, S]
    G = torch.matmul(ld, c["lower"].transpose(0, 1))  # [H, S]: sum of log decays up to t
    E = torch.exp((G[:, :, None] - G[:, None, :]).clamp(max=0.0)) * c["lower"]  # decay from i to t (i <= t)
    s0 = state[0]  # [H, dk, dv]
    gamma = torch.exp(G)[:, :, None]
    Kt = K.transpose(1, 2)
    a = torch.bmm(K, Kt) * (E * c["strict"]) * bt
    rhs = bt * (V - gamma * torch.bmm(K, s0))
    p = c["padded"]
    if p != S:  # identity rows below: the inverse's top-left block is the chunk's own
        a = F.pad(a, (0, p - S, 0, p - S))
    inverse = _unit_lower_inverse(a, c["levels"])
    u = torch.bmm(inverse[:, :S, :S] if p != S else inverse, rhs)  # [H, S, dv]
    o = gamma * torch.bmm(Q, s0) + torch.bmm(torch.bmm(Q, Kt) * E, u)
    tail = torch.exp(G[:, -1:, None] - G[:, :, None])  # decay from each token to the chunk's end
    new = torch.exp(G[:, -1])[:, None, None] * s0 + torch.bmm(Kt, tail * u)
    return o.transpose(0, 1)[None], new[None]


class _Call(torch.nn.Module):
    """Calls what it is handed: a module boundary for the trace's node tags, no state of its own."""

    def forward(self, fn, *args):
        return fn(*args)


class DecoderChunk(torch.nn.Module):
    def __init__(self, cfg: TextConfig, chunking: Chunking, weights: dict[str, torch.Tensor], compute: str = "fp32",
                 key_block: int = KEY_BLOCK, exponents: dict[str, int] | None = None,
                 quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None, bits: int = 8) -> None:
        """``quantized``: name -> (int8 codes [out, in], fp16 scales [out, in / block]) for the tensors a
        compressed recipe compresses (``quantize``); the graph reads each through coreai-torch's
        blockwise dequantize op (``bits`` 4: the codes are int4 values held in int8, packed by the
        converter), so ``main.mlirb`` keeps the codes and scales as they are."""
        super().__init__()
        if compute not in ("fp32", "fp16"):
            raise ValueError(f"compute must be fp32 or fp16, got {compute!r}")
        self.cfg, self.ch, self.compute, self.key_block = cfg, chunking, compute, key_block
        self.dtype = torch.float32 if compute == "fp32" else torch.float16
        quantized = dict(quantized or {})
        self.bits = bits
        missing = [n for n in weight_names(cfg) if n not in weights and n not in quantized]
        if missing:
            raise ValueError(f"weights lack {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        # no copy of a memory-mapped tensor is made. Matrices are buffers (non-persistent): the trace
        # sees them as graph inputs, so an op on one (the fp32 cast) is recorded, not run; a plain
        # tensor attribute is a constant, and export would run the cast on the real values (reading every
        # weight; docs/performance.md). 1-D tensors stay plain attributes: they fold into constants.
        self.w = {n: t for n, t in weights.items() if t.dim() < 2}
        self._buffer = {}
        for i, name in enumerate(sorted(n for n, t in weights.items() if t.dim() >= 2)):
            self._buffer[name] = f"w{i}"
            self.register_buffer(f"w{i}", weights[name], persistent=False)
        # the codes are persistent buffers: the converter takes integer codes from the state dict only
        self._codes = {}
        if quantized:
            import coreai_torch._compression.custom_layers  # noqa: F401 (registers torch.ops.coreai.constexpr_blockwise_shift_scale)
        for i, name in enumerate(sorted(quantized)):
            codes, scales = quantized[name]
            self._codes[name] = (f"q{i}", f"s{i}")
            self.register_buffer(f"q{i}", codes, persistent=True)
            self.register_buffer(f"s{i}", scales, persistent=True)
        # name -> k when the stored tensor is W * 2**k (``weights``: fp16 subnormals are flushed by the
        # runtime); what is computed from it is multiplied by 2**-k, exactly
        self.exponents = dict(exponents or {})
        half = cfg.rotary_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / cfg.rotary_dim))
        self.slots = torch.arange(chunking.context, dtype=torch.int32)
        self.delta = delta_rule_constants(chunking.chunk)
        axes = torch.tensor(mrope_axes(cfg))
        self.on_h, self.on_w = axes == 1, axes == 2  # [rot/2]: the frequencies that read h, w (else t)
        # each layer called through a module of its own: the trace tags the layer's nodes with it
        # (``nn_module_stack``), which ``stitch`` reads; ``only``: the layers a template trace runs
        self.blocks = torch.nn.ModuleList(_Call() for _ in cfg.layer_types)
        # name -> a matrix's widened row blocks, set by the torch engine for the layer it runs (never traced)
        self.row_blocks: dict = {}
        self.row_counts: dict[str, int] = {}
        self.only: frozenset[int] | None = None

    def _get(self, name: str) -> torch.Tensor:
        return getattr(self, self._buffer[name]) if name in self._buffer else self.w[name]

    def _mat(self, name: str) -> torch.Tensor:
        """A stored weight as the compute reads it (an fp16 weight through a cast for fp32; a compressed
        one dequantized to fp16 by the blockwise op first)."""
        if name in self._codes:
            q, s = (getattr(self, b) for b in self._codes[name])
            # the codes' dtype said, never inferred: the converter infers it from the values' range, and a
            # streamed build's codes are zeros until main.mlirb is written (inferred int2: garbage)
            w = torch.ops.coreai.constexpr_blockwise_shift_scale(q, s, None, None, torch.int4 if self.bits == 4 else torch.int8)
            return w.to(self.dtype)
        return self._get(name).to(self.dtype)

    def _unscale(self, y: torch.Tensor, name: str) -> torch.Tensor:
        k = self.exponents.get(name, 0)
        return y * (2.0 ** -k) if k else y

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        blocks = self.row_blocks.get(name)
        if blocks is None:
            return self._unscale(F.linear(x, self._mat(name)), name)
        # the torch engine's streamed weights: each block of rows gives its columns of the output (the
        # same dot products), the widened matrix never whole in memory
        y = x.new_empty(x.shape[:-1] + (self.row_counts[name],))
        for r0, r1, w in blocks():
            y[..., r0:r1] = F.linear(x, w)
        return self._unscale(y, name)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32."""
        return (_rms(x, self.cfg.rms_norm_eps) * (1.0 + self.w[name].float())).to(self.dtype)

    def forward(self, input_ids, position_ids, keyCache, valueCache, convState, recState):  # noqa: N803
        return self._decode(input_ids, position_ids, None, keyCache, valueCache, convState, recState)

    def _embed_and_positions(self, input_ids, pos, image):
        """The chunk's input rows and the rotary angles ``[S, rot/2]``. Text: the token's row, every
        axis at its sequence index. With ``image`` (``image_embeds, image_rc, rope_shift_start,
        rope_shift_amount``): an id V + k takes image row k at (t, h, w) = (s, s + r_k, s + c_k),
        s = its index - k (the image's first index); text from ``rope_shift_start`` on sits
        ``rope_shift_amount`` earlier (N - max(H, W)). KV slots and the mask stay on the index."""
        table = f"{LM}embed_tokens.weight"
        if image is None:
            x = self._unscale(F.embedding(input_ids.long(), self._get(table)).to(self.dtype), table)
            return x, pos.float()[:, None] * self.inv_freq[None, :]
        embeds, rc, shift_start, shift_amount = image
        ids = input_ids[0]
        V = self.cfg.vocab_size
        is_img = ids >= V
        k = torch.where(is_img, ids - V, 0).clamp(0, embeds.shape[0] - 1).long()
        tok = torch.where(is_img, 0, ids).long()
        text = self._unscale(F.embedding(tok, self._get(table)).to(self.dtype), table)  # [S, H]
        x = torch.where(is_img[:, None], torch.index_select(embeds, 0, k).to(self.dtype), text)[None]
        rck = torch.index_select(rc, 0, k)  # [S, 2]
        first = pos - k.to(pos.dtype)
        shifted = pos - torch.where(pos >= shift_start, shift_amount, 0)
        t = torch.where(is_img, first, shifted)
        h = torch.where(is_img, first + rck[:, 0], shifted)
        w = torch.where(is_img, first + rck[:, 1], shifted)
        p3 = torch.where(self.on_h[None, :], h[:, None], torch.where(self.on_w[None, :], w[:, None], t[:, None]))
        return x, p3.float() * self.inv_freq[None, :]

    def prelude(self, input_ids, position_ids, image):
        """What every layer of a chunk takes: the input rows ``[1, S, H]``, the chunk's positions
        ``[1, S]``, the rotary cos and sin, the attention bias ``[S, ctx]`` (the torch engine runs
        the layers over a whole record from these, ``executor``)."""
        S = self.ch.chunk
        pos = position_ids[:, -S:]  # [1, S]
        x, freqs = self._embed_and_positions(input_ids, pos[0], image)  # [1, S, H], [S, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        # query i sees key slot j when j <= its position
        bias = torch.where(self.slots[None, :] <= pos[0][:, None], 0.0, MASK_BIAS)  # [S, ctx]
        return x, pos, cos, sin, bias

    def _decode(self, input_ids, position_ids, image, keyCache, valueCache, convState, recState):  # noqa: N803
        cfg = self.cfg
        x, pos, cos, sin, bias = self.prelude(input_ids, position_ids, image)
        full_idx = {layer: n for n, layer in enumerate(cfg.full_layers)}
        lin_idx = {layer: n for n, layer in enumerate(cfg.linear_layers)}
        for i, kind in enumerate(cfg.layer_types):
            if self.only is None or i in self.only:
                n = full_idx[i] if kind == "full_attention" else lin_idx[i]
                x = self.blocks[i](self._layer, i, kind, n, x, pos, cos, sin, bias, keyCache, valueCache, convState, recState)
        return self._norm(x, f"{LM}norm.weight")

    def _layer(self, i, kind, n, x, pos, cos, sin, bias, keyCache, valueCache, convState, recState):  # noqa: N803
        p = f"{LM}layers.{i}."
        h = self._norm(x, p + "input_layernorm.weight")
        if kind == "full_attention":
            h = self._full(h, p + "self_attn.", n, pos, cos, sin, bias, keyCache, valueCache)
        else:
            h = self._linear(h, p + "linear_attn.", n, convState, recState)
        x = x + h
        h = self._norm(x, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        return x + self._lin(F.silu(self._lin(h, m + "gate_proj.weight")) * self._lin(h, m + "up_proj.weight"),
                             m + "down_proj.weight")

    def _full(self, x, a, n, pos, cos, sin, bias, keyCache, valueCache):  # noqa: N803
        cfg, S = self.cfg, self.ch.chunk
        nh, nkv, hd, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
        qg = self._lin(x, a + "q_proj.weight").view(1, S, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(1, S, nh * hd)
        q = (_rms(q, cfg.rms_norm_eps) * (1.0 + self.w[a + "q_norm.weight"].float())).transpose(1, 2)  # [1,nh,S,hd] fp32
        k = self._lin(x, a + "k_proj.weight").view(1, S, nkv, hd)
        k = (_rms(k, cfg.rms_norm_eps) * (1.0 + self.w[a + "k_norm.weight"].float())).transpose(1, 2)
        v = self._lin(x, a + "v_proj.weight").view(1, S, nkv, hd).transpose(1, 2)

        def rope(t):
            r = t[..., :rot]
            return torch.cat((r * cos + rotate_half(r) * sin, t[..., rot:]), dim=-1)

        q, k = rope(q).to(self.dtype), rope(k).to(keyCache.dtype)
        idx = pos[0].long()
        keyCache[n, 0].index_copy_(1, idx, k[0])
        valueCache[n, 0].index_copy_(1, idx, v[0].to(valueCache.dtype))
        kc, vc = keyCache[n].to(self.dtype), valueCache[n].to(self.dtype)  # [1, nkv, ctx, hd]
        rep = nh // nkv
        if rep > 1:  # grouped-query attention: each kv head serves ``rep`` consecutive query heads
            ctx = kc.shape[2]
            kc = kc[:, :, None].expand(1, nkv, rep, ctx, hd).reshape(1, nh, ctx, hd)
            vc = vc[:, :, None].expand(1, nkv, rep, ctx, hd).reshape(1, nh, ctx, hd)
        o = attend(q, kc, vc, bias, 1.0 / math.sqrt(hd), self.key_block)  # [1, nh, S, hd] fp32
        o = o.transpose(1, 2).reshape(1, S, nh * hd).to(self.dtype)
        o = o * torch.sigmoid(gate)
        return self._lin(o, a + "o_proj.weight")

    def _linear(self, x, a, n, convState, recState):  # noqa: N803
        cfg, S = self.cfg, self.ch.chunk
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        qkv = self._lin(x, a + "in_proj_qkv.weight").transpose(1, 2)  # [1, C, S]
        z = self._lin(x, a + "in_proj_z.weight").view(1, S, hv, dv)
        b = self._lin(x, a + "in_proj_b.weight").float()
        g_in = self._lin(x, a + "in_proj_a.weight").float()
        window = torch.cat((convState[n].to(self.dtype), qkv), dim=-1)  # [1, C, K - 1 + S]
        convState[n].copy_(window[:, :, S:].to(convState.dtype))
        conv = self._unscale(F.conv1d(window, self._mat(a + "conv1d.weight"), groups=window.shape[1]),
                             a + "conv1d.weight")  # [1, C, S]
        mixed = F.silu(conv).transpose(1, 2).float()  # [1, S, C]
        q = mixed[..., : hk * dk].reshape(1, S, hk, dk)
        k = mixed[..., hk * dk: 2 * hk * dk].reshape(1, S, hk, dk)
        v = mixed[..., 2 * hk * dk:].reshape(1, S, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        rep = hv // hk
        if rep > 1:  # each key head serves ``rep`` consecutive value heads
            q = q[:, :, :, None].expand(1, S, hk, rep, dk).reshape(1, S, hv, dk)
            k = k[:, :, :, None].expand(1, S, hk, rep, dk).reshape(1, S, hv, dk)
        beta = torch.sigmoid(b)  # [1, S, hv]
        log_decay = -torch.exp(self.w[a + "A_log"].float()) * F.softplus(g_in + self.w[a + "dt_bias"].float())
        o, state = delta_rule_chunk(q, k, v, beta, log_decay, recState[n].float(), self.delta)  # [1, S, hv, dv] fp32
        recState[n].copy_(state.to(recState.dtype))
        o = _rms(o, cfg.rms_norm_eps) * self.w[a + "norm.weight"].float() * F.silu(z.float())
        return self._lin(o.reshape(1, S, hv * dv).to(self.dtype), a + "out_proj.weight")


class ImageDecoderChunk(DecoderChunk):
    """The decoder with the published port's four image inputs (``contract.IMAGE_INPUTS``): with the
    text-only values (zeros, zeros, 1 << 30, 0) it computes what ``DecoderChunk`` computes."""

    def forward(self, input_ids, position_ids, image_embeds, image_rc, rope_shift_start, rope_shift_amount,  # noqa: N803
                keyCache, valueCache, convState, recState):
        return self._decode(input_ids, position_ids, (image_embeds, image_rc, rope_shift_start, rope_shift_amount),
                            keyCache, valueCache, convState, recState)


def zero_states(cfg: TextConfig, chunking: Chunking, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v, dtype=dtype) for k, v in cfg.state_shapes(chunking.context).items()}
