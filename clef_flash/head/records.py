"""What the gate feeds both sides: records (hidden rows, token ids, questions), seeded at the
edges of each bucket or recorded in an ``.npz``, and the author's own logits for a record."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import contract
from ..errors import IntegrityError
from .host import Question

# rows of the random lexical table the gate gives both sides (ids are drawn below this)
LEXICAL_VOCAB = 1024


@dataclass(frozen=True)
class Record:
    hidden: np.ndarray  # [L, H] f32
    ids: np.ndarray  # [L] int64
    questions: tuple[Question, ...]


def random_records(n: int, bucket: int, lower: int, hidden_size: int, vocab: int, seed: int,
                   q_pad: int = contract.Q_PAD, o_pad: int = contract.O_PAD) -> list[Record]:
    """Seeded records for one bucket covering the edges: T at the bucket's lower and upper edge,
    1 and ``q_pad`` questions, 2 and ``o_pad`` options, every type, spans touching 0 and T."""
    rng = np.random.default_rng([seed, bucket])
    records = []
    for i in range(n):
        if i == 0:
            length, nq, total = bucket, q_pad, o_pad
        elif i == 1:
            length, nq, total = lower + 1, 1, 2
        else:
            length = int(rng.integers(lower + 1, bucket + 1))
            nq = int(rng.integers(1, q_pad + 1))
            total = int(rng.integers(2 * nq, o_pad + 1)) if 2 * nq <= o_pad else 2 * nq
        # option counts: at least 2 each, summing to total
        counts = np.full(nq, 2)
        for _ in range(total - 2 * nq):
            counts[rng.integers(0, nq)] += 1
        span_max = max(1, min(12, length // 4))

        def span(length: int = length, span_max: int = span_max) -> tuple[int, int]:
            s = int(rng.integers(0, length))
            e = min(length, s + int(rng.integers(1, span_max + 1)))
            return (s, e)

        questions = []
        for q in range(nq):
            qs = (0, min(length, span_max)) if q == 0 else span()
            opts = [span() for _ in range(int(counts[q]))]
            if q == nq - 1:
                opts[-1] = (length - 1, length)  # a span at T's upper edge
            questions.append(Question(
                question_type=int(q % 3 if i < 2 else rng.integers(0, 3)),
                question_span=qs,
                option_spans=tuple(opts),
                option_ids=tuple(str(k) for k in range(len(opts))),
                question_id=f"q{q}",
            ))
        hidden = rng.standard_normal((length, hidden_size), dtype=np.float32)
        ids = rng.integers(0, vocab, size=length)
        records.append(Record(hidden=hidden, ids=ids, questions=tuple(questions)))
    return records


def load_recorded(path: Path) -> list[Record]:
    """Recorded records: an ``.npz`` with ``hidden_<i>``, ``ids_<i>`` and ``questions_<i>`` (JSON)."""
    data = np.load(path, allow_pickle=False)
    records = []
    i = 0
    while f"hidden_{i}" in data:
        qs = json.loads(str(data[f"questions_{i}"]))
        records.append(Record(
            hidden=np.asarray(data[f"hidden_{i}"], np.float32),
            ids=np.asarray(data[f"ids_{i}"], np.int64),
            questions=tuple(Question(
                question_type=int(q["type"]), question_span=tuple(q["question_span"]),
                option_spans=tuple(tuple(s) for s in q["option_spans"]),
                option_ids=tuple(q.get("option_ids") or [str(k) for k in range(len(q["option_spans"]))]),
                question_id=str(q.get("id", f"q{j}")),
            ) for j, q in enumerate(qs)),
        ))
        i += 1
    if not records:
        raise IntegrityError(f"{path}: no records (expected hidden_0, ids_0, questions_0)")
    return records


def author_logits(module, head, record: Record, table) -> list[np.ndarray]:
    import torch

    qs = tuple(
        module.EncodedQuestion(question_id=q.question_id, question_type=q.question_type,
                               question_span=tuple(q.question_span), option_spans=tuple(q.option_spans),
                               option_ids=tuple(q.option_ids))
        for q in record.questions
    )
    rec = module.EncodedRecord(input_ids=tuple(int(x) for x in record.ids), questions=qs, record_id="gate")
    length = len(record.ids)
    with torch.inference_mode():
        out = head(torch.from_numpy(record.hidden)[None], torch.from_numpy(record.ids)[None],
                   torch.ones(1, length, dtype=torch.long), [rec], table)[0]
    return [o.float().numpy() for o in out]
