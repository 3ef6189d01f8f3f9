"""The host side, numpy only: the arrays a host builds to call the head, and what it does with
the logits. This is the spec that a Swift or Python host copies.

How it works: docs/modules.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .contract import BUCKETS, INPUT_ORDER, O_PAD, Q_PAD
from ..progress import plural


class HostInputError(ValueError):
    """A record that cannot be laid out for the head (too long, too many options, bad span)."""


class QuestionLike(Protocol):
    question_type: int
    question_span: tuple[int, int]
    option_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Question:
    """A minimal ``EncodedQuestion``: what the head needs of one question."""

    question_type: int
    question_span: tuple[int, int]
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...] = ()
    question_id: str = ""


@dataclass(frozen=True)
class HostInputs:
    arrays: dict[str, np.ndarray]  # the ten inputs, graph dtypes, in INPUT_ORDER
    layout: tuple[slice, ...]  # each question's slice of the option axis
    bucket: int
    length: int  # real tokens
    options: int = field(default=0)  # real options


def pick_bucket(length: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket >= ``length``."""
    if length < 1:
        raise HostInputError(f"record has {length} tokens; at least 1 is needed")
    for b in sorted(buckets):
        if length <= b:
            return b
    raise HostInputError(f"record has {length} tokens; the largest bucket is {max(buckets)}")


def check_fits(length: int, questions: Sequence[QuestionLike], *, q_pad: int = Q_PAD, o_pad: int = O_PAD,
               buckets: Sequence[int] = BUCKETS) -> int:
    """The bucket a record of ``length`` tokens and these questions runs in; ``HostInputError``
    naming every reason when it does not fit (the host never cuts a record)."""
    problems = []
    bucket = 0
    try:
        bucket = pick_bucket(length, buckets)
    except HostInputError as exc:
        problems.append(str(exc))
    if not questions:
        problems.append("record has no questions")
    if len(questions) > q_pad:
        problems.append(f"record has {plural(len(questions), 'question')}; at most {q_pad} fit")
    n_options = sum(len(q.option_spans) for q in questions)
    if n_options > o_pad:
        problems.append(f"record has {n_options} options; at most {o_pad} fit")
    problems.extend(f"question {qi} has {len(q.option_spans)} option(s); at least 2 are needed"
                    for qi, q in enumerate(questions) if len(q.option_spans) < 2)
    if problems:
        raise HostInputError("; ".join(problems))
    return bucket


def _check_span(span: tuple[int, int], length: int, what: str) -> tuple[int, int]:
    start, end = int(span[0]), int(span[1])
    if not (0 <= start < end <= length):
        raise HostInputError(f"{what} span [{start}, {end}) is empty or outside [0, {length})")
    return start, end


def lexical_rows(table: Any, ids: Sequence[int] | np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Mean of ``table`` rows of each span's ids, accumulated in f64, returned f32 ``[n, H]``.

    ``table`` is any ``[V, H]`` array: the 2 GB fp16 ``lm_head_fp16.bin`` as a ``numpy.memmap``
    included (only the rows named are read).
    """
    ids = np.asarray(ids)
    out = np.zeros((len(spans), table.shape[1]), dtype=np.float32)
    for i, (start, end) in enumerate(spans):
        rows = np.asarray(table[ids[start:end]], dtype=np.float64)
        out[i] = rows.mean(axis=0)
    return out


def head_inputs(
    hidden: np.ndarray,
    ids: Sequence[int] | np.ndarray,
    questions: Sequence[QuestionLike],
    table: Any,
    bucket: int | None = None,
    *,
    q_pad: int = Q_PAD,
    o_pad: int = O_PAD,
    buckets: Sequence[int] = BUCKETS,
) -> HostInputs:
    """The ten arrays of one record, padded to ``bucket`` (T), ``q_pad`` (Q) and ``o_pad`` (O)."""
    hidden = np.asarray(hidden)
    length, hidden_size = hidden.shape
    ids = np.asarray(ids)
    if ids.shape != (length,):
        raise HostInputError(f"ids has shape {ids.shape}; hidden has {length} rows")
    bucket = check_fits(length, questions, q_pad=q_pad, o_pad=o_pad, buckets=buckets) if bucket is None else bucket
    if length > bucket:
        raise HostInputError(f"record has {length} tokens; bucket {bucket} is too small")
    check_fits(length, questions, q_pad=q_pad, o_pad=o_pad, buckets=buckets)
    if table.shape[1] != hidden_size:
        raise HostInputError(f"table rows have {table.shape[1]} values; hidden rows have {hidden_size}")

    a = {
        "hidden": np.zeros((bucket, hidden_size), np.float32),
        "key_valid": np.zeros((bucket,), np.float32),
        "q_avg": np.zeros((q_pad, bucket), np.float32),
        "o_avg": np.zeros((o_pad, bucket), np.float32),
        "g_avg": np.zeros((1, bucket), np.float32),
        "lexical": np.zeros((o_pad, hidden_size), np.float32),
        "member": np.zeros((q_pad, o_pad), np.float32),
        "type_ids": np.zeros((q_pad,), np.int32),
        "q_valid": np.zeros((q_pad,), np.float32),
        "o_valid": np.zeros((o_pad,), np.float32),
    }
    a["hidden"][:length] = hidden
    a["key_valid"][:length] = 1.0
    a["g_avg"][0, length - 1] = 1.0
    layout: list[slice] = []
    spans: list[tuple[int, int]] = []
    o = 0
    for qi, q in enumerate(questions):
        if int(q.question_type) not in (0, 1, 2):
            raise HostInputError(f"question {qi}: type {q.question_type} is not noul 0, choice 1 or score 2")
        s, e = _check_span(q.question_span, length, f"question {qi}")
        a["q_avg"][qi, s:e] = 1.0 / (e - s)
        a["type_ids"][qi] = int(q.question_type)
        a["q_valid"][qi] = 1.0
        start = o
        for oi, span in enumerate(q.option_spans):
            s, e = _check_span(span, length, f"question {qi} option {oi}")
            a["o_avg"][o, s:e] = 1.0 / (e - s)
            a["member"][qi, o] = 1.0
            a["o_valid"][o] = 1.0
            spans.append((s, e))
            o += 1
        layout.append(slice(start, o))
    a["lexical"][:o] = lexical_rows(table, ids, spans)
    arrays = {name: a[name] for name in INPUT_ORDER}
    return HostInputs(arrays=arrays, layout=tuple(layout), bucket=bucket, length=length, options=o)


def question_probs(logits: np.ndarray, layout: Sequence[slice]) -> list[np.ndarray]:
    """Per question, the fp32 softmax over its own options (in the author's option order)."""
    logits = np.asarray(logits, dtype=np.float32)
    out = []
    for sl in layout:
        x = logits[sl]
        e = np.exp(x - x.max(), dtype=np.float32)
        out.append((e / e.sum(dtype=np.float32)).astype(np.float32))
    return out


def answers(
    request_questions: Mapping[str, Mapping[str, Any]],
    questions: Sequence[Any],
    probs: Sequence[np.ndarray],
) -> dict[str, dict[str, Any]]:
    """The SystemOne answer of each question, as the author's ``systemone_answer`` gives it.

    ``request_questions`` is the request's ``questions`` object (type, criteria); ``questions``
    carry ``question_id`` and ``option_ids`` in the author's option order.
    """
    result: dict[str, dict[str, Any]] = {}
    for q, p in zip(questions, probs, strict=True):
        spec = request_questions[q.question_id]
        pr = dict(zip(q.option_ids, np.asarray(p, np.float32).tolist(), strict=True))
        kind = spec["type"]
        if kind == "noul":
            result[q.question_id] = {"type": "noul", "noul": round(pr["true"], 4)}
        elif kind == "choice":
            options = [str(o) for o in spec["criteria"]]
            best = options[0]
            for o in options[1:]:  # first of equals wins, as max() does
                if pr[o] > pr[best]:
                    best = o
            result[q.question_id] = {
                "type": "choice",
                "choice": best,
                "confidence": round(pr[best], 4),
                "probabilities": {o: round(pr[o], 4) for o in options},
            }
        elif kind == "score":
            levels = [str(i) for i in range(len(spec["criteria"]))]
            total: float | int = 0
            for i, level in enumerate(levels):
                total = total + i * pr[level]
            result[q.question_id] = {
                "type": "score",
                "score": round(total, 4),
                "confidence": round(max(pr[level] for level in levels), 4),
                "legend": dict(zip(levels, spec["criteria"], strict=True)),
                "probabilities": {level: round(pr[level], 4) for level in levels},
            }
        else:
            raise HostInputError(f"{q.question_id}: type must be noul, choice, or score")
    return result
