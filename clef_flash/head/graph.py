"""Stage 3: ``ClefHeadGraph`` — the author's ``JointSchemaHead`` for one record, tensor inputs only.

How it works: docs/modules.md."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .contract import INPUT_ORDER, KEY_BLOCK, MASK_BIAS


def _f(t: torch.Tensor) -> torch.Tensor:
    # fp16w32: weights are stored in whatever dtype the head holds, math runs in fp32.
    return t.float()


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0)


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a 2-D input, as ATen runs it: ``addmm(b, x, w^T)`` (``mm`` without a bias)."""
    return torch.mm(x, _t(weight)) if bias is None else torch.addmm(bias, x, _t(weight))


def _linear(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    return _affine(x, _f(lin.weight), None if lin.bias is None else _f(lin.bias))


def _layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    return torch.ops.aten.native_layer_norm.default(x, list(ln.normalized_shape), _f(ln.weight), _f(ln.bias), ln.eps)[0]


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._softmax.default(x, -1, False)


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True).clamp(min=eps)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=-1)``: x / max(||x||, 1e-12)."""
    return x / _norm(x, 1e-12)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.cosine_similarity(a, b, dim=-1)`` as ATen computes it: each side over its clamped norm."""
    return ((a / _norm(a, 1e-8)) * (b / _norm(b, 1e-8))).sum(dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, block: int) -> torch.Tensor:
    """softmax(q k^T + bias) v per head; q [h, n, d] is pre-scaled, bias [m] over keys.

    Above ``block`` keys, scores are formed per key block, all blocks share one max, and the
    exp-sums and exp-weighted values are summed across blocks: the same softmax.
    """
    m = k.shape[-2]
    if m <= block:
        scores = torch.bmm(q, k.permute(0, 2, 1)) + bias
        return torch.bmm(_softmax(scores), v)
    starts = list(range(0, m, block))
    scores = [torch.bmm(q, k[:, s : s + block].permute(0, 2, 1)) + bias[s : s + block] for s in starts]
    top = scores[0].amax(dim=-1, keepdim=True)
    for s in scores[1:]:
        top = torch.maximum(top, s.amax(dim=-1, keepdim=True))
    num = None
    den = None
    for s, start in zip(scores, starts, strict=True):
        e = torch.exp(s - top)
        part = torch.bmm(e, v[:, start : start + block])
        num = part if num is None else num + part
        tot = e.sum(dim=-1, keepdim=True)
        den = tot if den is None else den + tot
    return num / den


def _mha(attn: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         bias: torch.Tensor, block: int) -> torch.Tensor:
    """``nn.MultiheadAttention`` (batch of one, no weights returned) with an additive key bias."""
    width = attn.embed_dim
    heads = attn.num_heads
    d = width // heads
    w = _f(attn.in_proj_weight)
    b = _f(attn.in_proj_bias)
    q = _affine(query, w[:width], b[:width])
    k = _affine(key, w[width : 2 * width], b[width : 2 * width])
    v = _affine(value, w[2 * width :], b[2 * width :])
    q = q.view(-1, heads, d).permute(1, 0, 2) * (1.0 / math.sqrt(d))
    k = k.view(-1, heads, d).permute(1, 0, 2)
    v = v.view(-1, heads, d).permute(1, 0, 2)
    out = _attend(q, k, v, bias, block).permute(1, 0, 2).clone(memory_format=torch.contiguous_format).view(-1, width)
    return _linear(out, attn.out_proj)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)  # exact erf form, as nn.GELU() and activation="gelu" use


class ClefHeadGraph(torch.nn.Module):
    """The author's head for one record. ``forward`` takes the ten inputs in ``INPUT_ORDER``."""

    input_names = INPUT_ORDER
    output_names = ("logits",)

    def __init__(self, head: torch.nn.Module, key_block: int = KEY_BLOCK) -> None:
        super().__init__()
        self.head = head.eval()
        self.key_block = key_block

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] final-norm rows of the backbone; padding rows zero
        key_valid: torch.Tensor,  # [T] 1 for a real token
        q_avg: torch.Tensor,  # [Q, T] 1/len over each question's instruction span
        o_avg: torch.Tensor,  # [O, T] 1/len over each option's span
        g_avg: torch.Tensor,  # [1, T] 1 at the last real token
        lexical: torch.Tensor,  # [O, H] mean lm_head rows of each option's ids
        member: torch.Tensor,  # [Q, O] 1 where option o belongs to question q
        type_ids: torch.Tensor,  # [Q] i32 noul 0, choice 1, score 2
        q_valid: torch.Tensor,  # [Q]
        o_valid: torch.Tensor,  # [O]
    ) -> torch.Tensor:
        h = self.head
        block = self.key_block
        key_bias = (key_valid - 1.0) * -MASK_BIAS  # 0 for real keys, MASK_BIAS for padding
        field_bias = (q_valid - 1.0) * -MASK_BIAS
        option_of = _t(member)  # [O, Q] one-hot: each option's question

        normalized = _layer_norm(hidden, h.hidden_norm)
        memory = _linear(normalized, h.memory_projection)  # [T, W]
        question_vectors = torch.mm(q_avg, normalized)  # [Q, H]
        context = torch.mm(o_avg, normalized)  # [O, H]
        global_vector = torch.mm(g_avg, normalized)  # [1, H]

        # Option queries: context + lexical + their question's projection.
        routed = (
            _linear(context, h.option_context_projection)
            + _linear(lexical, h.option_lexical_projection)
            + torch.mm(option_of, _linear(question_vectors, h.option_question_projection))
        )
        for layer in h.evidence_layers:
            queries = _layer_norm(routed, layer.query_norm)
            mem = _layer_norm(memory, layer.memory_norm)
            routed = routed + _mha(layer.attention, queries, mem, mem, key_bias, block)
            ff = layer.feedforward
            routed = routed + _linear(_gelu(_linear(_layer_norm(routed, layer.feedforward_norm), ff[0])), ff[3])

        # Per question: softmax over its own options, the weighted option summary.
        base_fields = _linear(question_vectors, h.question_projection)  # [Q, W]
        scores = torch.mm(base_fields, _t(routed)) / math.sqrt(routed.shape[-1])
        scores = scores + (member - 1.0) * -MASK_BIAS
        summaries = torch.mm(_softmax(scores), routed)
        fields = (
            base_fields
            + _layer_norm(summaries, h.option_summary_norm)
            + _linear(global_vector, h.global_projection)
            + F.embedding(type_ids, _f(h.type_embedding.weight))
        )
        for layer in h.layers:  # TransformerDecoderLayer, norm_first, gelu
            x = _layer_norm(fields, layer.norm1)
            fields = fields + _mha(layer.self_attn, x, x, x, field_bias, block)
            x = _layer_norm(fields, layer.norm2)
            fields = fields + _mha(layer.multihead_attn, x, memory, memory, key_bias, block)
            x = _layer_norm(fields, layer.norm3)
            fields = fields + _linear(_gelu(_linear(x, layer.linear1)), layer.linear2)
        fields = _layer_norm(fields, h.field_norm)

        # Per option: lexical prior + gated joint score against its question's field.
        anchor = _normalize(question_vectors + global_vector)  # [Q, H]
        lexical_anchor = _normalize(lexical)  # [O, H]
        log100 = math.log(100.0)
        prior_scale = _f(h.prior_logit_scale).clamp(max=log100).exp()
        prior = prior_scale * (lexical_anchor * torch.mm(option_of, anchor)).sum(dim=-1)
        options = _layer_norm(routed, h.option_norm)
        field = torch.mm(option_of, fields)  # [O, W]
        cosine = _cosine(field, options)
        features = torch.cat([field, options, field * options, torch.abs(field - options)], dim=-1)
        scorer = h.residual_scorer
        residual = torch.squeeze(_linear(_gelu(_linear(features, scorer[0])), scorer[3]), (-1,))
        joint_scale = _f(h.joint_logit_scale).clamp(max=log100).exp()
        joint = joint_scale * cosine + residual
        logits = prior + torch.sigmoid(_f(h.residual_gate)) * joint
        return torch.where(o_valid > 0.5, logits, torch.full_like(logits, 0.0))


def cast_weights(head: torch.nn.Module, weights: str) -> torch.nn.Module:
    """``fp16w32``: parameters stored fp16 (read through .float()); ``fp32``: stored fp32."""
    dtypes = {"fp16w32": torch.float16, "fp32": torch.float32}
    if weights not in dtypes:
        raise ValueError(f"unknown weights mode {weights!r}; expected one of {sorted(dtypes)}")
    return head.to(dtypes[weights])
