"""A SystemOne request's prompt as the Clef head reads it: token ids, each question's instruction
span, each option's span in the option order the answers use, the question types, and where an
image's tokens go. Written from the facts of the author's ``encode_record`` (its layout, its piece
by piece tokenization, its option order, its state truncation); ``check-release`` and the tests hold
it equal to the author's token for token and span for span.

Each piece below is tokenized on its own, so no token runs across two pieces: a host in another
language must do the same (``host-vectors.jsonl`` gives every piece's ids)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..head.host import Question

SYSTEM = ("Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of "
          "that field's allowed options.")
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
SCHEMA = "\n\nSCHEMA FIELDS:\n"
OPTIONS = "\nALLOWED OPTIONS:\n"
END_FIELD = "END FIELD\n"
TYPE_IDS = {"noul": 0, "choice": 1, "score": 2}
NOUL_OPTIONS = {"true": "The proposition is true or the answer is yes.",
                "false": "The proposition is false or the answer is no."}
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
MAX_LENGTH = 16384  # the author's systemone default: the state is cut to fit it, nothing else is


class RecordTooLong(ValueError):
    """A request whose fixed part (prompt, image, schema) exceeds ``MAX_LENGTH``: no model answers it."""


def render(value: Any) -> str:
    """A state, an instruction or an option as prompt text: a string as it is, anything else as
    compact JSON with sorted keys and unescaped unicode."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def options_of(question: dict[str, Any]) -> list[tuple[str, Any]]:
    """(option id, description) in the order the head scores them: noul true then false (the
    request's criteria replacing the default descriptions), choice by option id, score by level."""
    kind = question["type"]
    if kind == "noul":
        described = {**NOUL_OPTIONS, **(question.get("criteria") or {})}
        return [(k, described[k]) for k in ("true", "false")]
    if kind == "choice":
        return sorted((str(k), v) for k, v in question["criteria"].items())
    return [(str(i), v) for i, v in enumerate(question["criteria"])]


class PromptTokenizer:
    """The release's ``tokenizer.json`` through the ``tokenizers`` library (what transformers' fast
    tokenizer runs): each text encoded without added special tokens; the special tokens written in
    a text are matched as the added tokens they are."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        from ..errors import IntegrityError

        self.path = Path(path)
        if not self.path.is_file():
            raise IntegrityError(f"{self.path}: missing (the release's tokenizer)")
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the tokenizers library raises its own plain Exception
            raise IntegrityError(f"{self.path}: not a tokenizer the tokenizers library reads ({str(exc)[:160]})") from None
        model = json.loads(self._tok.to_str()).get("model", {})
        self._merges = model.get("type") != "BPE" or bool(model.get("merges"))  # a byte-level vocabulary alone merges nothing
        added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self._margin = max([len(t) for t in added] + [16]) + 1

    def pieces(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def leading(self, text: str, count: int) -> list[int]:
        """The first ``count`` ids of ``text``'s tokenization (all of them when it has fewer),
        tokenizing a prefix of ``text`` only (``sure_ids``), so a state of megabytes costs what its
        kept tokens cost."""
        n = max(4 * count, 1024) + self._margin
        while n < len(text):
            sure = self.sure_ids(text, n)
            if sure is None:
                break
            if len(sure) >= count:
                return sure[:count]
            n *= 2
        return self.pieces([text])[0][:count]

    def sure_ids(self, text: str, n: int) -> list[int] | None:
        """The ids of ``text[:n]``'s tokenization that are ``text``'s own, or None where that is not
        known. No token crosses a pre-token (word), and a cut changes at most the word it falls in
        and the one before it (a run of spaces gives its last space to the next word); an added
        token cut in two lies within ``_margin`` characters of the cut. A tokenizer that keeps a
        long text one word and merges bytes across it has no such bound: None."""
        enc = self._tok.encode(text[:n], add_special_tokens=False)
        safe = n - self._margin  # tokens ending at or before it: no added token is cut there
        first_unsure = next((i for i, (_, end) in enumerate(enc.offsets) if end > safe), len(enc.ids))
        if not self._merges:
            return enc.ids[:first_unsure]  # bytes are tokens: each character's are its own
        words = enc.word_ids
        if first_unsure >= len(enc.ids) or words[first_unsure] is None:
            return None  # no word to stand on at the cut
        unsure_word = words[first_unsure]
        kept = next((i for i in range(first_unsure) if words[i] is not None and words[i] >= unsure_word - 1), first_unsure)
        if kept == 0 and unsure_word <= 1:
            return None  # one word so far: a byte-merging tokenizer's cut is not known to hold
        return enc.ids[:kept]

    def token_id(self, token: str) -> int:
        got = self._tok.token_to_id(token)
        if got is None:
            raise ValueError(f"{self.path}: the tokenizer has no {token} token")
        return int(got)


@dataclass(frozen=True)
class ImagePlace:
    start: int  # the first image token's index
    tokens: int  # N, the merged grid's tokens


@dataclass(frozen=True)
class Encoded:
    ids: tuple[int, ...]
    questions: tuple[Question, ...]  # spans in ``ids``, option ids in the head's order
    image: ImagePlace | None = None
    state_cut: bool = False  # the state was cut to fit MAX_LENGTH (the author does the same); usage.input_tokens says what was read

    @property
    def global_position(self) -> int:
        """The token the head's global summary reads: the prompt's last."""
        return len(self.ids) - 1


def _texts(body: dict[str, Any]) -> tuple[list[str], list[tuple[str, int, list[str]]]]:
    """The schema's pieces in order, and per question (id, type id, its option ids)."""
    texts, layout = [SCHEMA], []
    for n, (qid, q) in enumerate(body["questions"].items(), start=1):
        texts.append(f"\nFIELD {n}\nID: {qid}\nTYPE: {q['type']}\nINSTRUCTION: ")
        instructions = q.get("instructions")
        texts.append(render(str(qid) if instructions is None or instructions == "" else instructions))
        texts.append(OPTIONS)
        ids = []
        for k, (oid, description) in enumerate(options_of(q), start=1):
            meaning: dict[str, Any] = {"option_id": oid}
            if description is not None:
                meaning["description"] = description
            texts += [f"OPTION {k}: ", render(meaning), "\n"]
            ids.append(oid)
        texts.append(END_FIELD)
        layout.append((str(qid), TYPE_IDS[q["type"]], ids))
    return texts, layout


def encode(tokenizer: PromptTokenizer, body: dict[str, Any], image_tokens: int | None = None,
           max_length: int = MAX_LENGTH) -> Encoded:
    """The request's prompt (``image_tokens``: the image's N when the request has one; the body's
    own image field is not read here). ``ValueError`` when the schema alone exceeds ``max_length``."""
    texts, layout = _texts(body)
    image_texts = ["\n"] if image_tokens is not None else []
    ids = tokenizer.pieces([PREFIX, SUFFIX, *image_texts, *texts])
    prefix, suffix = ids[0], ids[1]
    image: list[int] = []
    if image_tokens is not None:
        start, pad, end = (tokenizer.token_id(t) for t in IMAGE_TOKENS)
        image = [start] + [pad] * image_tokens + [end] + ids[2]
    schema_pieces = ids[2 + len(image_texts):]
    schema: list[int] = []
    spans: list[tuple[int, int]] = []  # every piece's span in the schema, in order
    for piece in schema_pieces:
        spans.append((len(schema), len(schema) + len(piece)))
        schema += piece
    head = len(prefix) + len(image)
    fixed = head + len(schema) + len(suffix)
    if fixed > max_length:
        raise RecordTooLong(f"the schema needs {fixed} tokens before the state; at most {max_length} fit")
    room = max_length - fixed
    # one token past the room says whether the state was cut, without tokenizing all of it
    state = tokenizer.leading(render(body["state"]), room + 1)
    kept = state[:room]
    at = head + len(kept)  # where the schema starts
    questions, p = [], 1  # piece 0 is the schema's title
    for qid, type_id, option_ids in layout:
        q_span = spans[p + 1]
        o_spans = tuple((at + spans[p + 3 + 3 * k + 1][0], at + spans[p + 3 + 3 * k + 1][1]) for k in range(len(option_ids)))
        questions.append(Question(question_type=type_id, question_span=(at + q_span[0], at + q_span[1]),
                                  option_spans=o_spans, option_ids=tuple(option_ids), question_id=qid))
        p += 3 + 3 * len(option_ids) + 1
    place = ImagePlace(start=len(prefix) + 1, tokens=image_tokens) if image_tokens is not None else None
    return Encoded(ids=tuple(prefix + image + kept + schema + suffix), questions=tuple(questions), image=place,
                   state_cut=len(state) > len(kept))


def first_difference(ours: Encoded, ids: Sequence[int], questions: Sequence[Any]) -> str | None:
    """Where ``ours`` first differs from another encoder's ids and questions (the author's
    ``EncodedRecord``'s fields), in one line; None when equal token for token and span for span."""
    theirs = [int(x) for x in ids]
    for i, (a, b) in enumerate(zip(ours.ids, theirs)):
        if a != b:
            return f"token {i}: ours {a}, theirs {b}"
    if len(ours.ids) != len(theirs):
        return f"{len(ours.ids)} tokens, theirs {len(theirs)} (equal up to token {min(len(ours.ids), len(theirs))})"
    if len(ours.questions) != len(questions):
        return f"{len(ours.questions)} questions, theirs {len(questions)}"
    for a, b in zip(ours.questions, questions):
        mine = (a.question_id, a.question_type, tuple(a.question_span), tuple(map(tuple, a.option_spans)), tuple(a.option_ids))
        other = (str(b.question_id), int(b.question_type), tuple(b.question_span), tuple(map(tuple, b.option_spans)),
                 tuple(b.option_ids))
        for name, x, y in zip(("id", "type", "instruction span", "option spans", "option ids"), mine, other):
            if x != y:
                return f"question {a.question_id!r}: {name} ours {x}, theirs {y}"
    return None
