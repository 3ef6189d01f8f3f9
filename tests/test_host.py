"""The host library against the author's own functions, and its error cases."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clef_flash.head.host import HostInputError, Question, answers, head_inputs, lexical_rows, pick_bucket, question_probs


def test_pick_bucket_edges():
    assert [pick_bucket(t) for t in (1, 512, 513, 1024, 1025, 2048, 2049, 4096)] == [512, 512, 1024, 1024, 2048, 2048, 4096, 4096]
    with pytest.raises(HostInputError, match="largest bucket is 4096"):
        pick_bucket(4097)
    with pytest.raises(HostInputError, match="at least 1"):
        pick_bucket(0)


def _q(qspan=(0, 2), ospans=((2, 3), (3, 4)), t=1):
    return Question(question_type=t, question_span=qspan, option_spans=ospans)


@pytest.mark.parametrize(
    "questions, length, cause",
    [
        ([_q()] * 17, 10, "at most 16"),
        ([_q(ospans=tuple((i % 9, i % 9 + 1) for i in range(65)))] * 2, 10, "at most 128"),
        ([_q(ospans=((2, 3),))], 10, "at least 2"),
        ([_q(qspan=(5, 11))], 10, "outside"),
        ([_q(qspan=(-1, 2))], 10, "outside"),
        ([_q(ospans=((2, 3), (4, 4)))], 10, "empty"),
        ([_q(t=3)], 10, "type"),
        ([], 10, "no questions"),
    ],
)
def test_head_inputs_errors(questions, length, cause):
    hidden = np.zeros((length, 8), np.float32)
    with pytest.raises(HostInputError, match=cause):
        head_inputs(hidden, np.zeros(length, np.int64), questions, np.zeros((5, 8), np.float32))


def test_head_inputs_too_long():
    with pytest.raises(HostInputError, match="4096"):
        head_inputs(np.zeros((4097, 4), np.float32), np.zeros(4097, np.int64), [_q()], np.zeros((5, 4), np.float32))


def test_head_inputs_layout_and_dtypes():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((20, 8), dtype=np.float32)
    ids = rng.integers(0, 5, 20)
    qs = [_q((0, 4), ((4, 6), (6, 9)), 0), _q((9, 10), ((10, 12), (12, 13), (19, 20)), 2)]
    hi = head_inputs(hidden, ids, qs, rng.standard_normal((5, 8), dtype=np.float32))
    a = hi.arrays
    assert hi.bucket == 512 and hi.options == 5 and hi.layout == (slice(0, 2), slice(2, 5))
    assert a["type_ids"].dtype == np.int32 and all(v.dtype == np.float32 for k, v in a.items() if k != "type_ids")
    assert a["q_avg"][0, :4].tolist() == [0.25] * 4 and a["q_avg"][0].sum() == pytest.approx(1.0)
    assert a["o_avg"][4, 19] == 1.0 and a["g_avg"][0, 19] == 1.0 and a["g_avg"].sum() == 1.0
    assert a["member"][:2, :5].tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 1]] and a["member"].sum() == 5
    assert a["key_valid"].sum() == 20 and a["q_valid"].sum() == 2 and a["o_valid"].sum() == 5
    assert not a["hidden"][20:].any() and not a["lexical"][5:].any()


def test_lexical_rows_memmap_matches_author_mean(tmp_path):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((300, 16)).astype(np.float16)
    path = tmp_path / "lm_head_fp16.bin"
    table.tofile(path)
    mm = np.memmap(path, dtype=np.float16, mode="r", shape=(300, 16))
    ids = rng.integers(0, 300, 50)
    spans = [(0, 1), (3, 17), (40, 50)]
    got = lexical_rows(mm, ids, spans)
    t = torch.from_numpy(table.astype(np.float32))
    for i, (s, e) in enumerate(spans):
        ref = t[torch.from_numpy(ids[s:e])].double().mean(0).float().numpy()
        assert np.array_equal(got[i], ref)
    assert got.dtype == np.float32


def test_question_probs_equal_torch_softmax():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(10).astype(np.float32) * 5
    layout = (slice(0, 3), slice(3, 10))
    for p, sl in zip(question_probs(logits, layout), layout):
        ref = torch.from_numpy(logits[sl]).softmax(-1).numpy()
        assert np.abs(p - ref).max() <= 1e-7 and p.dtype == np.float32


def test_answers_equal_systemone_answer(author_module):
    rng = np.random.default_rng(3)
    request = {
        "noul_q": {"type": "noul", "instructions": "is it?"},
        "choice_q": {"type": "choice", "criteria": {"zeta": "z", "alpha": "a", "mid": "m"}},
        "score_q": {"type": "score", "criteria": ["bad", "ok", "good", "great"]},
        "tie_q": {"type": "choice", "criteria": {"b": "b", "a": "a"}},
    }
    qs, probs = [], []
    for qid, spec in request.items():
        option_ids = [k for k, _ in author_module.question_options(spec)]
        qs.append(Question(question_type=0, question_span=(0, 1), option_spans=(), option_ids=tuple(option_ids), question_id=qid))
        if qid == "tie_q":
            probs.append(np.array([0.5, 0.5], np.float32))
        else:
            probs.append(question_probs(rng.standard_normal(len(option_ids)).astype(np.float32) * 3, [slice(None)])[0])
    ours = answers(request, qs, probs)
    for q, p in zip(qs, probs):
        ref = author_module.systemone_answer(request[q.question_id], dict(zip(q.option_ids, p.tolist())))
        assert json.dumps(ours[q.question_id], sort_keys=True) == json.dumps(ref, sort_keys=True)
