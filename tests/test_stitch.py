"""The decoder's program from one traced layer of each group, copied for the rest (``stitch``),
against the trace of every layer: the same ops, and bitwise the same outputs and state updates."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from clef_flash.backbone import stitch as S
from clef_flash.backbone.contract import Chunking, text_config, weight_names
from clef_flash.backbone.export import example_args, trace
from clef_flash.backbone.graph import DecoderChunk, ImageDecoderChunk
from clef_flash.engine.quantize import Scheme, quantize_torch
from clef_flash.backbone.contract import compressed_names
from clef_flash.synth.wide import TEXT_9B

PATTERN = ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"]


def small_config():
    raw = json.loads(json.dumps(TEXT_9B))
    raw.update(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               num_hidden_layers=len(PATTERN), layer_types=PATTERN, pad_token_id=5, eos_token_id=6)
    return text_config({"text_config": raw}, "test")


def make(case: str):
    """fp32: no compression, one matrix of layer 4 scaled by 2**3 (a group of its own); fp16: the
    image inputs, int8 codes in every layer but 2 (kept fp16: another group)."""
    cfg = small_config()
    ch = Chunking(8, 32, 4 if case == "fp16" else 0)
    g = torch.Generator().manual_seed(0)
    w = {n: (torch.randn(s, generator=g) * (0.05 if len(s) > 1 else 0.1)).to(torch.float16 if len(s) > 1 else torch.float32)
         for n, s in weight_names(cfg).items()}
    quantized, exponents = {}, {}
    if case == "fp16":
        for n in compressed_names(weight_names(cfg), Scheme(8, 32), [2]):
            quantized[n] = quantize_torch(w.pop(n).float(), Scheme(8, 32))
    else:
        exponents["model.language_model.layers.4.mlp.down_proj.weight"] = 3
    cls = ImageDecoderChunk if ch.image_rows else DecoderChunk
    return cls(cfg, ch, w, case, exponents=exponents, quantized=quantized, bits=8), cfg, ch


def inputs(cfg, ch, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    args = list(example_args(cfg, ch, dtype))
    args[0] = torch.randint(0, cfg.vocab_size, args[0].shape, generator=g, dtype=torch.int32)
    if ch.image_rows:
        args[0][0, 2:4] = torch.tensor([cfg.vocab_size, cfg.vocab_size + 1], dtype=torch.int32)  # two image rows
        args[2] = torch.randn(args[2].shape, generator=g).to(dtype)
        args[3] = torch.randint(0, 3, args[3].shape, generator=g, dtype=torch.int32)
    for k in range(len(args) - 4, len(args)):  # the states: nonzero, so a slot read or written wrong shows
        args[k] = (torch.randn(args[k].shape, generator=g) * 0.5).to(dtype)
    return args


def run(ep, args):
    mine = [a.clone() for a in args]
    out = ep.module()(*mine)
    return out, mine[-4:]


def ops(ep):
    return collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("case", ["fp32", "fp16"])
def test_the_stitched_program_computes_what_the_full_trace_does(case):
    module, cfg, ch = make(case)
    dtype = torch.float32 if case == "fp32" else torch.float16
    groups = set(S.templates(module).values())
    assert groups == ({0, 1, 4} if case == "fp32" else {0, 1, 2}), groups  # stitched: fewer traced than layers
    said: list[str] = []
    stitched = trace(module, cfg, ch, dtype, said.append)
    assert any("copied them to 6 layers" in s for s in said), said
    full = trace(module, cfg, ch, dtype, said.append, stitched=False)
    assert ops(stitched) == ops(full)
    args = inputs(cfg, ch, dtype)
    (o1, s1), (o2, s2) = run(full, args), run(stitched, args)
    assert torch.equal(o1, o2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))
    assert not all(torch.equal(a, b) for a, b in zip(s1, args[-4:]))  # the chunk did write the states


def test_a_copy_that_kept_its_templates_state_slot_is_caught(monkeypatch):
    """The red arm: every copy left reading and writing slot 0 (its template's) computes something
    else, and the comparison above sees it."""
    module, cfg, ch = make("fp32")
    full = trace(module, cfg, ch, torch.float32, stitched=False)
    real, template = S.state_index, S.templates(module)
    monkeypatch.setattr(S, "state_index", lambda cfg, i: real(cfg, template[i]))  # each copy given its template's slot
    said: list[str] = []
    broken = trace(module, cfg, ch, torch.float32, said.append)
    assert any("copied them" in s for s in said), said
    args = inputs(cfg, ch, torch.float32)
    (o1, s1), (o2, s2) = run(full, args), run(broken, args)
    assert not (torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(s1, s2)))


def test_a_trace_the_copy_does_not_understand_is_traced_whole(monkeypatch):
    module, cfg, ch = make("fp32")

    def refuse(ep):
        raise S.StitchError("state keyCache is written by aten.index_put (expected where)")

    monkeypatch.setattr(S, "_state_versions", refuse)
    said: list[str] = []
    ep = trace(module, cfg, ch, torch.float32, said.append)
    assert any("could not be copied (state keyCache is written by aten.index_put" in s and "tracing all 6" in s for s in said), said
    assert any(s.startswith("traced 6 layers") for s in said), said
    args = inputs(cfg, ch, torch.float32)
    full = trace(module, cfg, ch, torch.float32, stitched=False)
    assert torch.equal(run(ep, args)[0], run(full, args)[0])


def test_groups_follow_kind_compression_and_exponents():
    module, cfg, _ = make("fp16")
    t = S.templates(module)
    assert t == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 1}  # layer 2's matrices kept fp16: its own group
    assert [S.state_index(cfg, i) for i in range(6)] == [0, 0, 1, 1, 2, 3]
