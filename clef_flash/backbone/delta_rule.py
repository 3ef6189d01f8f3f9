"""The Gated DeltaNet's chunked scan with a backward linear in the record's length, for the plan's
reverse sweep (``estimate.carrying_back``).

transformers' ``torch_chunk_gated_delta_rule`` reads chunk ``i`` of six tensors as ``x[:, :, i]``
in its scan; autograd answers each such read with a zero tensor the size of the whole ``x``, so its
backward fills O(chunks²) floats: 77 % of a layer's carry-back at 5,192 tokens (py-spy and torch's
profiler, docs/performance.md). Here the same arithmetic reads the chunks once with ``unbind`` and
``stack``s the outputs: the forward's values and the gradients are the same bits
(``tests/test_weight_plan.py``), only the backward's bookkeeping differs. The plan's values still
come from transformers' function; this one is swapped in only while the options' gradients are
carried back (``swapped``)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

REFERENCE_NAME = "torch_chunk_gated_delta_rule"  # what the decoder's linear-attention forward calls, by module global


def _l2norm(x, eps: float = 1e-6):
    import torch

    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **_kwargs):
    """transformers' chunked gated delta rule (same arguments, same results), its scan over chunks
    read through ``unbind``: query/key ``[B, T, Hk, Dk]``, value ``[B, T, Hv, Dv]``, g and beta
    ``[B, T, Hv]`` -> ``([B, T, Hv, Dv], the last state or None)``."""
    import torch
    import torch.nn.functional as F

    initial_dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if k_heads != v_heads:  # each query/key head serves v_heads // k_heads consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum = decay.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros((batch, v_heads, k_dim, v_dim), dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    outs = []
    chunks = zip(*(t.unbind(2) for t in (new_values, k_cumdecay, query, intra, chunk_decay, key)), strict=True)
    for values_i, cumdecay_i, query_i, intra_i, decay_i, key_i in chunks:
        v_new = values_i - cumdecay_i @ state
        outs.append(query_i @ state + intra_i @ v_new)
        state = state * decay_i + key_i.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)


@contextmanager
def swapped(layer):
    """``chunk_gated_delta_rule`` in place of transformers' for ``layer``'s module during the block
    (a decoder layer without linear attention: nothing swapped)."""
    attn = getattr(layer, "linear_attn", None)
    module = sys.modules.get(type(attn).__module__) if attn is not None else None
    if module is None or not hasattr(module, REFERENCE_NAME):
        yield
        return
    kept = getattr(module, REFERENCE_NAME)
    setattr(module, REFERENCE_NAME, chunk_gated_delta_rule)
    try:
        yield
    finally:
        setattr(module, REFERENCE_NAME, kept)
