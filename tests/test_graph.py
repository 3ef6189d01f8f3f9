"""ClefHeadGraph against the author's JointSchemaHead.forward (tiny configuration, eager fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clef_flash.sources.author import HeadConfig, build_head
from clef_flash.head.contract import BUCKETS, TINY_CONFIG
from clef_flash.head.records import author_logits, random_records
from clef_flash.head.graph import ClefHeadGraph, cast_weights
from clef_flash.head.host import Question, head_inputs
from clef_flash.synth.release import synth_state

BAR = 1e-5  # the eager-parity bar (fp32, exact sizes and bucket-padded)
VOCAB = 97


@pytest.fixture(scope="module")
def tiny(author_module):
    cfg = dict(TINY_CONFIG)
    head = build_head(author_module, HeadConfig.model_validate(cfg), synth_state(cfg, 0, author_module), torch.float32, "synthetic")
    return author_module, head, ClefHeadGraph(head)


def run_graph(graph, arrays) -> np.ndarray:
    with torch.inference_mode():
        return graph(*[torch.from_numpy(arrays[k]) for k in graph.input_names]).numpy()


def edge_lengths(bucket: int, lower: int) -> list[int]:
    """T one above the lower boundary, one below and at the upper one."""
    return [lower + 1, bucket - 1, bucket]


def records_around(bucket: int, lower: int, n: int, seed: int):
    """n seeded records for one bucket, then one record at each of its edge lengths."""
    recs = random_records(n, bucket, lower, TINY_CONFIG["hidden_size"], VOCAB, seed)
    for length in edge_lengths(bucket, lower):
        # the third seeded record of a one-length range has exactly T = length, random questions
        recs.append(random_records(3, length, length - 1, TINY_CONFIG["hidden_size"], VOCAB, seed=length)[2])
    return recs


@pytest.mark.parametrize("bucket", BUCKETS)
def test_graph_matches_author_exact_and_padded(tiny, bucket):
    module, head, graph = tiny
    lower = max([b for b in BUCKETS if b < bucket], default=0)
    table = np.random.default_rng(bucket).standard_normal((VOCAB, TINY_CONFIG["hidden_size"]), dtype=np.float32)
    records = records_around(bucket, lower, 50, seed=11)
    assert set(edge_lengths(bucket, lower)) <= {len(r.ids) for r in records}
    types_seen, worst_exact, worst_padded, n_q, n_o = set(), 0.0, 0.0, set(), set()
    for rec in records:
        ref = np.concatenate(author_logits(module, head, rec, torch.from_numpy(table)))
        length = len(rec.ids)
        n_opts = sum(len(q.option_spans) for q in rec.questions)
        exact = head_inputs(rec.hidden, rec.ids, rec.questions, table, length, q_pad=len(rec.questions), o_pad=n_opts,
                            buckets=(length,))
        padded = head_inputs(rec.hidden, rec.ids, rec.questions, table, bucket)
        out_exact = run_graph(graph, exact.arrays)
        out_padded = run_graph(graph, padded.arrays)
        worst_exact = max(worst_exact, float(np.abs(out_exact - ref).max()))
        worst_padded = max(worst_padded, float(np.abs(out_padded[:n_opts] - ref).max()))
        assert np.all(out_padded[n_opts:] == 0.0), "padding logits must be exactly 0"
        assert float(np.abs(out_padded[:n_opts] - out_exact).max()) <= BAR, "a padded record must score like the unpadded one"
        types_seen |= {q.question_type for q in rec.questions}
        n_q.add(len(rec.questions))
        n_o.add(n_opts)
    assert worst_exact <= BAR and worst_padded <= BAR, (worst_exact, worst_padded)
    assert types_seen == {0, 1, 2} and {1, 16} <= n_q and {2, 128} <= n_o
    assert len(records) == 53


def test_blockwise_attention_is_the_same_softmax(tiny):
    module, head, graph = tiny
    rec = random_records(1, 600, 0, TINY_CONFIG["hidden_size"], VOCAB, seed=5)[0]
    table = np.random.default_rng(0).standard_normal((VOCAB, TINY_CONFIG["hidden_size"]), dtype=np.float32)
    arrays = head_inputs(rec.hidden, rec.ids, rec.questions, table, 1024).arrays
    plain = run_graph(ClefHeadGraph(head, key_block=4096), arrays)
    blocked = run_graph(ClefHeadGraph(head, key_block=128), arrays)  # 8 key blocks, 5 of them padding only
    assert np.abs(plain - blocked).max() <= 1e-6


def test_every_parameter_is_used(tiny, author_module):
    """Perturbing any single parameter tensor moves the graph's logits."""
    module, head, _ = tiny
    cfg = dict(TINY_CONFIG)
    state = {k: v.float() for k, v in synth_state(cfg, 0, author_module).items()}
    rec = random_records(3, 512, 0, cfg["hidden_size"], VOCAB, seed=3)[2]
    table = np.random.default_rng(1).standard_normal((VOCAB, cfg["hidden_size"]), dtype=np.float32)
    arrays = head_inputs(rec.hidden, rec.ids, rec.questions, table, 512).arrays
    base = run_graph(ClefHeadGraph(build_head(module, HeadConfig.model_validate(cfg), state, torch.float32, "x")), arrays)
    unused = []
    for name in state:
        perturbed = dict(state)
        perturbed[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(1))
        out = run_graph(ClefHeadGraph(build_head(module, HeadConfig.model_validate(cfg), perturbed, torch.float32, "x")), arrays)
        if np.array_equal(out, base):
            unused.append(name)
    assert not unused, f"parameters that do not reach the logits: {unused}"


def test_fp16w32_stores_fp16_and_computes_fp32(tiny, author_module):
    cfg = dict(TINY_CONFIG)
    state = synth_state(cfg, 0, author_module)
    head = cast_weights(build_head(author_module, HeadConfig.model_validate(cfg), state, torch.float16, "x"), "fp16w32")
    assert {p.dtype for p in head.parameters()} == {torch.float16}
    rec = Question(question_type=1, question_span=(0, 3), option_spans=((3, 5), (5, 9)))
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((10, cfg["hidden_size"]), dtype=np.float32)
    table = rng.standard_normal((VOCAB, cfg["hidden_size"]), dtype=np.float32)
    arrays = head_inputs(hidden, rng.integers(0, VOCAB, 10), [rec], table, 512).arrays
    out16 = run_graph(ClefHeadGraph(head), arrays)
    out32 = run_graph(ClefHeadGraph(build_head(author_module, HeadConfig.model_validate(cfg), state, torch.float32, "x")), arrays)
    assert out16.dtype == np.float32
    # bf16 values are exact in fp16's normal range: only the few subnormal-range values round
    assert np.abs(out16 - out32).max() <= 1e-5
    with pytest.raises(ValueError, match="unknown weights mode"):
        cast_weights(head, "int4")


def test_core_forms_are_bit_identical_to_the_functional_ones():
    """The graph spells ops in core ATen (so no decomposition pass); eagerly they equal torch's own."""
    import torch.nn.functional as F

    from clef_flash.head import graph as g

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)
    lin = torch.nn.Linear(96, 48)
    ln = torch.nn.LayerNorm(96)
    torch.nn.init.normal_(ln.weight, generator=gen)
    assert torch.equal(g._linear(a, lin), F.linear(a, lin.weight, lin.bias))
    assert torch.equal(g._layer_norm(a, ln), F.layer_norm(a, (96,), ln.weight, ln.bias, ln.eps))
    assert torch.equal(g._softmax(a), torch.softmax(a, dim=-1))
    assert torch.equal(g._normalize(a), F.normalize(a, dim=-1))
    assert torch.equal(g._cosine(a, b), F.cosine_similarity(a, b, dim=-1))
    assert torch.equal(g._cosine(a, torch.zeros_like(a)), F.cosine_similarity(a, torch.zeros_like(a), dim=-1))


@pytest.mark.parametrize("buckets", [(512,), (4096,), (512, 1024, 2048)])
def test_exported_graph_needs_no_decomposition(tiny, buckets):
    """coreai-torch takes the traced program as it is; a functional op slipping in would bring the
    slow ``run_decompositions`` pass back, and this check sees it."""
    from clef_flash.formats.aimodel import needs_decomposition
    from clef_flash.head.aimodel import trace_program

    coreai_torch = pytest.importorskip("coreai_torch")
    _, head, _ = tiny
    graph = ClefHeadGraph(cast_weights(head, "fp16w32")).eval()
    ep = trace_program(graph, buckets, TINY_CONFIG["hidden_size"], 16, 128)
    assert not needs_decomposition(ep)
    assert not [str(n.target) for n in ep.graph.nodes if str(n.target).startswith(("aten.linear", "aten.matmul"))]

    class Functional(torch.nn.Module):  # the same kind of layer written with F.linear
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(3, 4))

    plain = torch.export.export(Functional(), (torch.zeros(2, 4),), strict=False)
    assert needs_decomposition(plain)
    assert not needs_decomposition(plain.run_decompositions(coreai_torch.get_decomp_table()))
