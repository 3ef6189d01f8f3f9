"""plan-weights' one-pass ranking (issue 47): each layer's first-order effect on the answers from
one reverse sweep, held to the exhaustive ranking (one end-to-end pass a layer, ``--exhaustive``)
on releases written by clef-finetune's own ``make-tiny`` and ours, and on the cases a fast ranking
must survive (``tests/plan_fixtures.py``); the choice proved by trials, escalated when the estimate
is too kind; the same plan on a rerun and at another thread count; where it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .plan_fixtures import edited_release, head_ignores, saturated

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "conversion" / "backbone_pf64_int8.toml"
runner = CliRunner()
RECORDS = "8"


def _one_thread_invoke(args):
    """The CLI in this process on one torch thread: two test workers share two cores, and torch's
    threads of both waiting on each other made a 10 s plan take minutes (measured)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return runner.invoke(app, args)
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """``plans(release, budget, exhaustive=False, estimate="first-order") -> WeightPlan``, each run
    once. The one-pass plans carry every record back unless asked otherwise: at 4 tiny layers the
    default (``auto``) measures every record end to end, cheaper there, and the first-order
    estimate is what these tests hold to the oracle."""
    from clef_flash.backbone.plan import load_plan

    done: dict = {}

    def plan(release: Path, budget: float, exhaustive: bool = False, estimate: str = "first-order"):
        key = (str(release), budget, exhaustive, estimate)
        if key not in done:
            out = tmp_path_factory.mktemp("plan") / "plan.json"
            res = _one_thread_invoke(["plan-weights", str(release), "--recipe", str(RECIPE), "--out", str(out),
                                      "--budget-dp", str(budget), "--records", RECORDS, "--estimate", estimate]
                                + (["--exhaustive"] if exhaustive else []))
            assert res.exit_code == 0, res.output[-3000:]
            done[key] = load_plan(out)
        return done[key]
    return plan


@pytest.fixture(scope="module")
def ours(tmp_path_factory, author_code) -> Path:
    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    rel = write_release(tmp_path_factory.mktemp("ours") / "tiny_release", config_name=MAKE_TINY_HEAD, seed=0,
                        author_code=author_code, backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    return rel


def _agree(fast, oracle) -> None:
    from clef_flash.backbone.plan import plan_problems

    assert fast.ranked_by == "first-order" and oracle.ranked_by == "exhaustive"
    assert fast.chosen == oracle.chosen, (fast.ranking, oracle.ranking)
    assert fast.met and oracle.met and plan_problems(fast, minimal=False) == []
    assert oracle.kendall_tau is not None and -1 <= oracle.kendall_tau <= 1
    # the fast plan measured fewer sets end to end than the oracle (which runs one a layer besides)
    assert len(fast.trials) <= len(oracle.trials)
    assert all(e.estimated_dp is not None and e.fisher is not None for e in fast.layers)
    assert fast.measured_alone == []


# (make-tiny seed, budget): each a budget the all-int8 release misses, so a set is chosen
AGREE = [(0, 2e-4), (1, 1e-4), (2, 5e-5), (3, 1e-4)]


@pytest.mark.parametrize("seed,budget", AGREE)
def test_the_one_pass_ranking_chooses_what_the_exhaustive_one_chooses(make_tiny, plans, seed, budget):
    release = make_tiny(seed)
    fast, oracle = plans(release, budget), plans(release, budget, exhaustive=True)
    _agree(fast, oracle)
    assert 1 <= len(fast.chosen) < 4
    assert not any(t.passes for t in oracle.trials if t.fp16_layers == [])


def test_the_one_pass_ranking_on_our_own_tiny_release(ours, plans):
    _agree(plans(ours, 1e-4), plans(ours, 1e-4, exhaustive=True))


def test_a_small_own_error_that_later_layers_amplify_ranks_by_its_effect(make_tiny, plans):
    """make-tiny seed 0: layer 0's own error is the smallest of the four, yet its effect on the
    answers is the second largest. Ranked by own error it would be kept last; the estimate ranks it
    where the oracle does, and the plan keeps it."""
    fast, oracle = plans(make_tiny(0), 2e-4), plans(make_tiny(0), 2e-4, exhaustive=True)
    own = {e.layer: e.rel_max_abs_d for e in fast.layers}
    assert min(own, key=own.get) == 0
    assert fast.ranking.index(0) == oracle.ranking.index(0) == 1
    assert 0 in fast.chosen and fast.chosen == oracle.chosen


def test_a_large_own_error_the_head_ignores_ranks_last(make_tiny, plans, tmp_path_factory):
    """The last layer writes only along the direction the head's LayerNorm removes: its own error is
    the largest by far, its effect nothing. The estimate sees that (the answers' gradient is
    orthogonal to it); ranked by own error it would be kept fp16 first."""
    release = edited_release(make_tiny(0), tmp_path_factory.mktemp("fx") / "head_ignores", head_ignores)
    fast, oracle = plans(release, 1e-4), plans(release, 1e-4, exhaustive=True)
    own = {e.layer: e.rel_max_abs_d for e in fast.layers}
    est = {e.layer: e.estimated_dp for e in fast.layers}
    alone = {e.layer: e.alone_max_abs_dp for e in oracle.layers}
    assert max(own, key=own.get) == 3 and own[3] > 2 * max(own[i] for i in (0, 1, 2))
    assert alone[3] < 1e-6 and est[3] < 1e-6  # measured and estimated: the head does not see it
    assert fast.ranking[-1] == oracle.ranking[-1] == 3 and 3 not in fast.chosen
    _agree(fast, oracle)


def test_two_layers_within_budget_alone_over_it_together(make_tiny, plans, monkeypatch):
    """make-tiny seed 0 at 1.5e-4: layers 1 and 2 each meet the budget alone; compressed together
    (the others kept fp16) they miss it. The estimate adds their signed changes per option, so the
    plan keeps one of them, as the oracle does. With the estimate made too kind (halved), the first
    trial misses and the plan escalates: one more layer of the ranking, measured, the same set."""
    from clef_flash.backbone import estimate

    fast, oracle = plans(make_tiny(0), 1.5e-4), plans(make_tiny(0), 1.5e-4, exhaustive=True)
    alone = {e.layer: e.alone_max_abs_dp for e in oracle.layers}
    assert alone[1] <= 1.5e-4 and alone[2] <= 1.5e-4
    both = next(t for t in oracle.trials if t.fp16_layers == [0, 3])
    assert not both.passes and both.estimated_max_abs_dp > 1.5e-4
    _agree(fast, oracle)
    assert fast.chosen == [0, 2, 3]

    real = estimate.set_estimate
    monkeypatch.setattr(estimate, "set_estimate", lambda e, squeezed: real(e, squeezed) / 2)
    out = make_tiny(0).parent / "kind.json"
    res = _one_thread_invoke(["plan-weights", str(make_tiny(0)), "--recipe", str(RECIPE), "--out", str(out),
                              "--budget-dp", "1.5e-4", "--records", RECORDS, "--overwrite", "--estimate", "first-order"])
    assert res.exit_code == 0, res.output[-3000:]
    from clef_flash.backbone.plan import load_plan

    kind = load_plan(out)
    sets = [t.fp16_layers for t in kind.trials]
    climb = sets[:sets.index(kind.chosen) + 1]  # escalation: one more layer of the ranking each trial
    assert len(climb) >= 2 and all(s == sorted(kind.ranking[:len(s)]) for s in climb)
    assert [len(s) for s in climb] == list(range(len(climb[0]), len(climb[0]) + len(climb)))
    assert not any(t.passes for t in kind.trials[:len(climb) - 1]) and kind.trials[len(climb) - 1].passes
    assert kind.chosen == oracle.chosen and kind.met


def test_each_record_is_taken_the_cheaper_way():
    """A record's per-layer changes are carried back (its options through the layers above the
    first) or measured end to end (each compressed layer and those after it), whichever costs less:
    at 4 layers a record of 3 options is measured, at 32 one of 18 is carried back and one of 19 is
    not (the carry-back's forward runs once a record, its backward once an option); one compressed
    layer, the last, is always cheaper measured."""
    from clef_flash.backbone.estimate import measured_alone

    assert measured_alone([1, 2, 3, 6], 4, list(range(4))) == [2, 3]
    assert measured_alone([1, 2, 18, 19], 32, list(range(32))) == [3]
    assert measured_alone([1, 2], 32, [31]) == [0, 1]
    assert measured_alone([], 32, list(range(32))) == []


def test_records_measured_end_to_end_give_the_oracles_figures(make_tiny, plans, monkeypatch, tmp_path):
    """Carrying made dear (10 forwards an option's backward), every record is measured end to end: each layer's
    figure is the oracle's own measurement, bit for bit, no Fisher term (nothing carried back), the
    same choice."""
    from clef_flash.backbone import estimate
    from clef_flash.backbone.plan import load_plan

    monkeypatch.setattr(estimate, "BACKWARD_UNITS", 10)
    out = tmp_path / "measured.json"
    res = _one_thread_invoke(["plan-weights", str(make_tiny(0)), "--recipe", str(RECIPE), "--out", str(out),
                              "--budget-dp", "2e-4", "--records", RECORDS])
    assert res.exit_code == 0, res.output[-3000:]
    auto, oracle = load_plan(out), plans(make_tiny(0), 2e-4, exhaustive=True)
    assert auto.measured_alone == list(range(int(RECORDS))) and auto.ranked_by == "first-order"
    alone = {e.layer: e.alone_max_abs_dp for e in oracle.layers}
    assert {e.layer: e.estimated_dp for e in auto.layers} == alone
    assert all(e.fisher is None for e in auto.layers)
    assert auto.chosen == oracle.chosen and auto.met and auto.ranking == oracle.ranking


def test_a_plan_of_records_taken_both_ways_chooses_the_oracles_set(make_tiny, plans):
    """The default at 4 tiny layers: the record of 2 options is carried back, the rest measured end
    to end; the two kinds of figures meet in one estimate, which chooses the oracle's set (make-tiny
    seed 0 at 1.5e-4: three layers of four, a pair that misses together)."""
    mixed, oracle = plans(make_tiny(0), 1.5e-4, estimate="auto"), plans(make_tiny(0), 1.5e-4, exhaustive=True)
    assert mixed.measured_alone == list(range(1, int(RECORDS))), mixed.measured_alone
    assert all(e.fisher is not None for e in mixed.layers)  # some records carried back
    assert mixed.chosen == oracle.chosen == [0, 2, 3] and mixed.met


def test_saturated_answers_do_not_mislead_the_ranking(make_tiny, plans, tmp_path_factory):
    """Most answers near p = 1 (their gradients vanish): the plan still chooses the oracle's set."""
    release = edited_release(make_tiny(0), tmp_path_factory.mktemp("fx") / "saturated", lambda t: None, saturated)
    _agree(plans(release, 0.01), plans(release, 0.01, exhaustive=True))
    top = _answer_probs(release)
    assert np.mean(top > 0.99) >= 0.5, top


def _answer_probs(release: Path) -> np.ndarray:
    import torch

    from clef_flash.backbone.reference import StreamedTextModel
    from clef_flash.backbone.source import release_config
    from clef_flash.build.plan_weights import PlanConfig, _calibration
    from clef_flash.recipe import load_recipe
    from clef_flash.sources.pins import load_pins
    from clef_flash.sources.requests import default_requests, load_requests

    cfg = PlanConfig(release=release, recipe=load_recipe(RECIPE), recipe_path=RECIPE, pins_path=release / "pins.json",
                     out=release / "unused.json", records=int(RECORDS))
    cal = _calibration(cfg, release, load_pins(release / "pins.json"), load_requests(default_requests()), release_config(release), "cpu")
    ref = StreamedTextModel(release)
    with torch.inference_mode():
        return np.array([float(q.softmax(-1).max()) for r, ids in enumerate(cal.records)
                         for q in cal.logits(r, torch.from_numpy(ref.rows(ids))[None])])


def test_escalation_and_the_walk_down_with_an_oracle_of_sets():
    """``_first_order_k`` against made-up measurements: an estimate too kind escalates until a
    measured trial meets; too harsh, it walks down while the smaller set meets; either way the
    result meets and the set one smaller misses."""
    from types import SimpleNamespace

    from clef_flash.build.plan_weights import _first_order_k

    ranking = [5, 2, 7, 0]
    for estimate_k, true_k in [(1, 3), (3, 1), (2, 2), (0, 0), (0, 4), (4, 0)]:
        seen: list[list[int]] = []

        def trial(kept, true_k=true_k):
            seen.append(list(kept))
            return SimpleNamespace(passes=len(kept) >= true_k)
        k = _first_order_k(ranking, lambda kept, e=estimate_k: len(kept) >= e, trial)
        assert k == true_k, (estimate_k, true_k, seen)
        assert seen[0] == ranking[:estimate_k]


def test_a_set_estimate_adds_signed_changes_per_answer():
    from clef_flash.backbone.estimate import LayerEstimate, set_estimate

    e = {0: LayerEstimate(dp=[3e-4, -1e-4]), 1: LayerEstimate(dp=[-2e-4, -1e-4])}
    assert e[0].estimated_dp == 3e-4
    assert set_estimate(e, {0, 1}) == pytest.approx(2e-4)  # 1e-4 and -2e-4: cancelling, then adding
    assert set_estimate(e, set()) == 0.0


def test_each_questions_last_option_is_minus_the_others():
    """A question's probabilities sum to one: the sweep carries back all but its last option, whose
    change and Fisher term are those of minus the others' ``g * d``; a question of one option does
    not move. Every option in order."""
    from clef_flash.backbone.estimate import Answers

    rng = np.random.default_rng(0)
    gd = rng.normal(size=(3, 4, 2))  # the carried options: question 0's first, question 1's first two
    a = Answers([2, 3, 1])
    for k in range(3):
        a.add(k, gd[k])
    changes = a.changes()
    assert len(changes) == 6
    assert changes[0] == float(np.sum(gd[0])) and changes[1] == float(np.sum(-gd[0]))
    assert changes[2:4] == [float(np.sum(gd[1])), float(np.sum(gd[2]))]
    assert changes[4] == float(np.sum(-(gd[1] + gd[2]))) and changes[5] == 0.0
    assert a.fisher == max(float(np.sum(np.square(x))) for x in (gd[0], gd[1], gd[2], gd[1] + gd[2]))


def test_a_layer_run_alone_in_the_reverse_sweep_is_its_run_in_the_pass(make_tiny):
    """The sweep runs each layer again on its kept input: without the model's cache (which its first
    run filled: a linear-attention layer would start from its own final state) the output is the
    pass's bit for bit; with the cache handed back it is not."""
    import torch

    from clef_flash.backbone.estimate import LayerCalls, forward_pass
    from clef_flash.backbone.reference import StreamedTextModel
    from clef_flash.backbone.sensitivity import LayerOutputs
    from clef_flash.backbone.source import release_config

    release = make_tiny(0)
    types = list(release_config(release).layer_types)
    ref = StreamedTextModel(release)
    records = [np.random.default_rng(1).integers(0, 500, n) for n in (70, 131)]
    with LayerOutputs() as outputs:
        calls = LayerCalls(ref, types)
        forward_pass(ref, records, outputs, calls)
        for i in range(len(types)):
            with ref.layer_loaded(i) as layer, torch.no_grad():
                for r, ids in enumerate(records):
                    entering = outputs.entering(i, r)
                    x = (ref.embed(ids) if entering is None else torch.from_numpy(entering))[None]
                    got = layer(x, **calls.by_record[r][types[i]])[0].numpy()
                    assert np.array_equal(got, outputs.entering(i + 1, r)), (i, r)
        assert not any(k in kw for by in calls.by_record.values() for kw in by.values() for k in ("cache", "use_cache"))


@pytest.mark.parametrize("length,k_heads,v_heads,dim", [(5, 2, 4, 16), (130, 2, 4, 16), (200, 3, 3, 8), (64, 1, 2, 4)])
def test_the_carry_backs_delta_rule_is_transformers_bit_for_bit(length, k_heads, v_heads, dim):
    """The linear attention's scan the carry-back swaps in (its backward linear in the length) gives
    transformers' values, last state and gradients to the bit, at lengths a chunk does not divide,
    grouped heads among them; ``swapped`` puts it in a layer's module for the block alone."""
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    from clef_flash.backbone.delta_rule import chunk_gated_delta_rule, swapped

    def run(fn):
        g = torch.Generator().manual_seed(length)
        q, k = (torch.randn(2, length, k_heads, dim, generator=g) for _ in range(2))
        v = torch.randn(2, length, v_heads, dim + 2, generator=g)
        decay, beta = -torch.rand(2, length, v_heads, generator=g), torch.rand(2, length, v_heads, generator=g)
        ins = [t.requires_grad_(True) for t in (q, k, v, decay, beta)]
        out, state = fn(*ins[:3], g=ins[3], beta=ins[4], output_final_state=True, use_qk_l2norm_in_kernel=True)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return out, state, torch.autograd.grad((out * weights).sum() + state.sum(), ins)

    want, got = run(qwen.torch_chunk_gated_delta_rule), run(chunk_gated_delta_rule)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))
    layer = torch.nn.Module()
    layer.linear_attn = qwen.Qwen3_5GatedDeltaNet.__new__(qwen.Qwen3_5GatedDeltaNet)
    kept = qwen.torch_chunk_gated_delta_rule
    with swapped(layer):
        assert qwen.torch_chunk_gated_delta_rule is chunk_gated_delta_rule
    assert qwen.torch_chunk_gated_delta_rule is kept


def _plan_in_process(release: Path, out: Path, threads: int, cwd: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONHASHSEED": str(threads)}
    exe = Path(sys.executable).parent / "clef-export"
    res = subprocess.run([str(exe), "plan-weights", str(release), "--recipe", str(RECIPE), "--out", str(out),
                          "--budget-dp", "2e-4", "--records", "4", "--device", "cpu", "--estimate", "first-order"], env=env, cwd=cwd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    s = data.pop("seconds")  # the sweep's three parts (the 9B's projection scales each its own way) within it
    parts = [s["reverse_head"], s["reverse_own"], s["reverse_carry"]]
    assert min(parts) > 0 and sum(parts) <= s["reverse"] <= s["total"], s
    return data


def test_the_plan_is_the_same_on_a_rerun_and_at_another_thread_count(make_tiny, tmp_path):
    """Every figure but the timings, at one thread and at two, from two working directories."""
    release = make_tiny(0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _plan_in_process(release, tmp_path / "a" / "p.json", 1, tmp_path / "a")
    two = _plan_in_process(release, tmp_path / "b" / "p.json", 2, tmp_path / "b")
    assert one == two
    assert one["device"] == "cpu" and one["ranked_by"] == "first-order" and one["met"]


def test_device_and_estimate_options_are_checked_before_any_work(make_tiny, tmp_path):
    """A device this machine lacks, or an estimate that is not one, is refused by name (exit 2),
    nothing written."""
    import torch

    release = make_tiny(0)
    for name, present in (("cuda", torch.cuda.is_available()), ("mps", torch.backends.mps.is_available())):
        if present:
            continue
        out = tmp_path / f"{name}.json"
        res = runner.invoke(app, ["plan-weights", str(release), "--recipe", str(RECIPE), "--out", str(out), "--device", name])
        assert res.exit_code == 2 and f"--device {name}: torch" in res.output and "sees no" in res.output, res.output
        assert not out.exists()
    res = runner.invoke(app, ["plan-weights", str(release), "--recipe", str(RECIPE), "--out", str(tmp_path / "x.json"), "--device", "tpu"])
    assert res.exit_code == 2 and "--device must be auto, cpu, cuda or mps" in res.output
    res = runner.invoke(app, ["plan-weights", str(release), "--recipe", str(RECIPE), "--out", str(tmp_path / "x.json"), "--estimate", "guess"])
    assert res.exit_code == 2 and "--estimate must be auto or first-order, got 'guess'" in res.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("args, says", [
    (["--budget-dp", "0"], "--budget-dp must be in (0, 1], got 0.0"),
    (["--budget-dp", "-0.5"], "--budget-dp must be in (0, 1], got -0.5"),
    (["--budget-dp", "nan"], "--budget-dp must be in (0, 1], got nan"),
    (["--records", "0"], "--records must be >= 1"),
    (["--out", "{tmp}"], "{tmp}: is a folder; --out names the plan file to write"),
    (["--out", "{tmp}/missing/plan.json"], "{tmp}/missing: folder not found for --out"),
    (["--recipe", "{root}/conversion/head_bucket_fp16w32.toml"], "plan-weights takes a compressed backbone recipe"),
    (["--recipe", "{root}/conversion/backbone_pf64_fp16.toml"], "plan-weights takes a compressed backbone recipe"),
    (["--release", "{tmp}/no-release"], "{tmp}/no-release: release folder not found"),
])
def test_plan_weights_refuses_its_options_before_any_work(make_tiny, tmp_path, args, says):
    """Issue 48 item 3: each bad option is refused by name (exit 2) before the release is hashed or
    a record encoded (it was, once, after about 40 s of work), and no plan is written."""
    root = Path(__file__).resolve().parents[1]
    fill = lambda v: v.replace("{tmp}", str(tmp_path)).replace("{root}", str(root))  # noqa: E731
    opts = {"--recipe": str(RECIPE), "--out": str(tmp_path / "plan.json"), "--release": str(make_tiny(0))}
    extra = []
    for k, v in zip(args[::2], args[1::2]):
        if k in opts:
            opts[k] = fill(v)
        else:
            extra += [k, fill(v)]
    res = runner.invoke(app, ["plan-weights", opts.pop("--release"), *[x for kv in opts.items() for x in kv], *extra])
    assert res.exit_code == 2, res.output
    assert fill(says) in res.output, res.output
    assert "hashing" not in res.output and "plan:" not in res.output and "calibration records" not in res.output, res.output
    assert not (tmp_path / "plan.json").exists()


def test_weights_held_on_the_device_give_the_streamed_rows(make_tiny, monkeypatch):
    """Where the release fits on the device the plan holds its weights (read once); the rows are
    the streamed reference's bit for bit (the CPU stands in for the device here)."""
    from clef_flash.backbone import reference

    release = make_tiny(0)
    records = [np.random.default_rng(2).integers(0, 500, n) for n in (40, 90)]
    streamed = reference.StreamedTextModel(release)
    reads: list[str] = []
    real = reference._read
    monkeypatch.setattr(reference, "_read", lambda folder, t, *a: (reads.append(t.file), real(folder, t, *a))[1])
    held = reference.StreamedTextModel(release, hold=True)
    first = len(reads)
    rows = [held.rows(ids) for ids in records]
    once = len(reads)
    rows2 = [held.rows(ids) for ids in records]
    assert len(reads) == once > first  # the second pass reads nothing
    monkeypatch.setattr(reference, "_read", real)
    want = [streamed.rows(ids) for ids in records]
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(rows, rows2, want, strict=True))


def test_weights_held_in_16_bits_are_the_same_fp32_arithmetic(make_tiny):
    """The plan holds no linear's weight of a layer: each is read where its linear is called (the
    release's bf16 widened, or a compressed layer's dequantization: ``held_weights.OnUse``) and
    read again by the backward: the rows, with and without compressed layers, and the gradients
    carried back through a layer are the fp32 reference's bit for bit (the dequantization itself:
    ``test_compressed::test_the_planners_dequantized_weights_are_the_numpy_rules``; the carry-back
    reads by blocks of rows, one a matrix at this width: its own test below)."""
    import torch

    from clef_flash.backbone.contract import compressed_names, read_text_config, weight_names
    from clef_flash.backbone.estimate import LayerCalls, forward_pass
    from clef_flash.backbone.reference import StreamedTextModel
    from clef_flash.backbone.sensitivity import Dequantizer, LayerOutputs, rows_with
    from clef_flash.engine.quantize import Scheme
    from clef_flash.engine.streamed_weights import locate

    release = make_tiny(0)
    text = read_text_config(release)
    scheme = Scheme(8, 32)
    names = compressed_names(weight_names(text), scheme)
    records = [np.random.default_rng(3).integers(0, 500, n) for n in (37, 70)]
    wide, narrow = StreamedTextModel(release), StreamedTextModel(release, narrow=True)
    for scaled in (False, True):  # True: the dequantized values times 2**-k (k > 0 at tiny size)
        deq = Dequantizer(release, locate(release, weight_names(text)), scheme, names, scaled)
        for layers in (set(), {1}, {0, 3}):
            a, b = rows_with(wide, records, deq, layers), rows_with(narrow, records, deq, layers)
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), (scaled, layers)
    with narrow.layer_loaded(2) as layer:
        held = {n: (m.weight.device.type, m.held_read is not None) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert held and set(held.values()) == {("meta", True)}, held  # not held: read where the linear is called
    types = list(text.layer_types)
    with LayerOutputs() as outputs:
        calls = LayerCalls(wide, types)
        forward_pass(wide, records[:1], outputs, calls)
        x = torch.from_numpy(outputs.entering(2, 0))[None]
        g = torch.randn((3,) + tuple(x.shape[1:]), generator=torch.Generator().manual_seed(0))
        got = []
        for ref in (wide, narrow):
            with ref.layer_loaded(2) as layer:
                got.append(_carried_back(layer, wide.model.config, x, calls.by_record[0][types[2]], g))
    assert torch.equal(got[0], got[1])


def _carried_back(layer, config, x, kwargs, g):
    """Each option of ``g`` ([B, T, H]) carried back through ``layer`` on one forward."""
    import torch

    from clef_flash.backbone.estimate import carrying_back

    with carrying_back(layer, config, x, kwargs) as back:
        return torch.cat([back(g[o:o + 1]) for o in range(len(g))])


def test_the_carry_back_runs_a_layer_forward_once_a_record(make_tiny):
    """Every option's copy of a layer would run the same forward (the record's input, the same
    weights): the carry-back runs it once with the graph kept and one backward an option. Each
    option's gradient is the one its own forward gives, bit for bit, through a linear-attention and
    a full-attention layer; the graph goes with the block."""
    import torch

    from clef_flash.backbone.contract import read_text_config
    from clef_flash.backbone.estimate import LayerCalls, carrying_back, forward_pass
    from clef_flash.backbone.reference import StreamedTextModel
    from clef_flash.backbone.sensitivity import LayerOutputs

    release = make_tiny(0)
    text = read_text_config(release)
    types = list(text.layer_types)
    ref = StreamedTextModel(release, narrow=True)
    with LayerOutputs() as outputs:
        calls = LayerCalls(ref, types)
        forward_pass(ref, [np.random.default_rng(7).integers(0, 500, 60)], outputs, calls)
        for i in (1, 3):  # linear attention, full attention
            x = torch.from_numpy(outputs.entering(i, 0))[None]
            kwargs = calls.by_record[0][types[i]]
            g = torch.randn((3,) + tuple(x.shape[1:]), generator=torch.Generator().manual_seed(i))
            with ref.layer_loaded(i) as layer:
                forwards = []
                hook = layer.register_forward_hook(lambda *a: forwards.append(1))
                with carrying_back(layer, ref.model.config, x, kwargs) as back:
                    got = [back(g[o:o + 1]) for o in range(len(g))]
                    assert len(forwards) == 1, i
                hook.remove()
                alone = []
                for o in range(len(g)):  # each option on its own forward
                    with carrying_back(layer, ref.model.config, x, kwargs) as back:
                        alone.append(back(g[o:o + 1]))
            assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True)), i
            assert not torch.equal(got[0], got[1]), i


def test_the_carry_back_reads_a_streamed_weight_by_blocks_of_rows(make_tiny, monkeypatch):
    """In the carry-back no streamed linear's fp32 weight is read whole (``held_weights.in_blocks``:
    a block of rows at a time, here blocks of a few rows so that every matrix has several): the
    gradients are the unblocked ones' within fp32's rounding of a sum in another order, and the
    same bits on a rerun; outside the carry-back the whole matrix is read, as before."""
    import torch

    from clef_flash.backbone import held_weights
    from clef_flash.backbone.contract import read_text_config
    from clef_flash.backbone.estimate import LayerCalls, forward_pass
    from clef_flash.backbone.reference import StreamedTextModel
    from clef_flash.backbone.sensitivity import LayerOutputs

    release = make_tiny(0)
    text = read_text_config(release)
    types = list(text.layer_types)
    wide, narrow = StreamedTextModel(release), StreamedTextModel(release, narrow=True)
    monkeypatch.setattr(held_weights, "BLOCK_BYTES", 4 * 3 * text.hidden_size)  # 3 rows of a hidden width, in fp32
    records = [np.random.default_rng(5).integers(0, 500, 45)]
    with LayerOutputs() as outputs:
        calls = LayerCalls(wide, types)
        forward_pass(wide, records, outputs, calls)
        for i in (1, 3):  # linear attention, full attention
            x = torch.from_numpy(outputs.entering(i, 0))[None]
            g = torch.randn((2,) + tuple(x.shape[1:]), generator=torch.Generator().manual_seed(i))
            with wide.layer_loaded(i) as layer:
                want = _carried_back(layer, wide.model.config, x, calls.by_record[0][types[i]], g)
            got, blocks = [], []

            def whole():
                raise AssertionError("a streamed weight read whole in the carry-back")

            with narrow.layer_loaded(i) as layer:
                linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
                for m in linears:
                    def counted(m=m, every=m.held_blocks):
                        for r0, r1, w in every():
                            blocks.append((id(m), w.numel() * w.element_size()))
                            yield r0, r1, w
                    m.held_blocks, m.held_read = counted, whole
                for _ in range(2):
                    got.append(_carried_back(layer, wide.model.config, x, calls.by_record[0][types[i]], g))
            assert torch.equal(got[0], got[1]), i
            scale = float(want.abs().max())
            assert float((got[0] - want).abs().max()) <= 1e-5 * scale, (i, float((got[0] - want).abs().max()), scale)
            assert {m for m, _ in blocks} == {id(m) for m in linears}, i
            assert max(n for _, n in blocks) <= held_weights.BLOCK_BYTES and len(blocks) > 2 * 2 * len(linears), i  # forward and backward, twice


def test_the_head_parked_for_the_sweep_comes_back_the_same(tmp_path):
    """The reverse sweep parks the head's weights in the planner's folder (the head is called only
    for the sweep's first gradients): out of memory inside the block, the same tensors after it,
    16-bit ones still 16-bit, the same outputs; the file goes with the block."""
    import torch

    from clef_flash.backbone.held_weights import hold_narrow
    from clef_flash.backbone.sensitivity import LayerOutputs
    from clef_flash.build.plan_weights import Calibration

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        head[0].weight.copy_(torch.randn(32, 16, generator=gen).to(torch.bfloat16).float())
    hold_narrow(head)
    x = torch.randn(5, 16, generator=gen)
    before = {n: t.clone() for n, t in head.state_dict().items()}
    want = head(x)
    cal = Calibration([], [], head, None, "cpu")
    with LayerOutputs(tmp_path) as outputs:
        with cal.parked(outputs):
            assert {t.device.type for t in head.state_dict().values()} == {"meta"}
            assert (outputs.path / "head.pt").is_file()
        assert not (outputs.path / "head.pt").exists()
    after = head.state_dict()
    assert after.keys() == before.keys()
    assert all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]) for n in before)
    assert head[0].weight.dtype == torch.bfloat16 and not head[0].weight.requires_grad
    assert torch.equal(head(x), want)


def test_a_weight_is_held_narrow_only_where_that_is_exact():
    """``hold_narrow`` keeps a linear's weight in 16 bits only where every value survives the round
    trip; a MultiheadAttention's out_proj (read by the attention itself) stays fp32; the outputs
    and input gradients are the fp32 module's bit for bit."""
    import torch

    from clef_flash.backbone.held_weights import hold_narrow

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(32, 16, generator=gen).to(torch.bfloat16).float())  # bf16 values
        model[1].weight.copy_(torch.randn(8, 32, generator=gen))  # fp32 values: not exact in 16 bits
    attn = torch.nn.MultiheadAttention(16, 2)
    with torch.no_grad():
        attn.out_proj.weight.copy_(attn.out_proj.weight.to(torch.bfloat16).float())
    import copy

    want_model, want_attn = copy.deepcopy(model), copy.deepcopy(attn)
    assert hold_narrow(model) == 32 * 16 * 2 and hold_narrow(attn) == 0
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert attn.out_proj.weight.dtype == torch.float32
    x = torch.randn(5, 16, generator=gen)
    outs = []
    for m in (want_model, model):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        outs.append((y, torch.autograd.grad(y, xi, torch.ones_like(y))[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    q = torch.randn(3, 1, 16, generator=gen)
    assert torch.equal(attn(q, q, q)[0], want_attn(q, q, q)[0])
