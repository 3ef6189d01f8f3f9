"""The host's own request encoder (clef_flash.host.encode) held to the author's ``encode_record``
token for token and span for span: the project's request sets, and generated requests over every
question type, 1 ... 16 questions, unicode, empty and very long states, states as strings, objects
and arrays, options at the limits, and states cut to fit ``max_length``."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from clef_flash.host.encode import PromptTokenizer, encode, first_difference, render

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["desk", "leg", "refund", "réponse", "数据", "🙂", "naïve", "", " ", "\n", "\"quoted\"", "a\\b", "<|im_end|>", "0.5"]


@pytest.fixture(scope="module")
def release(tmp_path_factory, author_code) -> Path:
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    return write_release(tmp_path_factory.mktemp("enc") / "rel", config_name=MAKE_TINY_HEAD, seed=0, author_code=author_code,
                         backbone="qwen3_5", variant="tiny")


@pytest.fixture(scope="module")
def tokenizers(release):
    from transformers import AutoTokenizer

    return PromptTokenizer(release / "tokenizer.json"), AutoTokenizer.from_pretrained(release)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 2 else 3)
    if kind == 0:
        return _text(rng, rng.randrange(0, 6))
    if kind == 1:
        return rng.choice([0, 1, -3, 2.5, 1e-7, True, None])
    if kind == 2:
        return _text(rng, 2)
    if kind == 3:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {_text(rng, 1) + str(i): _value(rng, depth + 1) for i in range(rng.randrange(0, 4))}


def _question(rng: random.Random) -> dict:
    kind = rng.choice(["noul", "choice", "score"])
    q: dict = {"type": kind}
    if rng.random() < 0.8:
        q["instructions"] = rng.choice([_text(rng, 5), "", None, {"ask": _text(rng, 2)}])
    if kind == "noul" and rng.random() < 0.5:
        q["criteria"] = {k: _text(rng, 2) for k in rng.sample(["true", "false"], rng.randrange(1, 3))}
    if kind == "choice":
        n = rng.choice([2, 3, 5, 40])
        q["criteria"] = {f"{_text(rng, 1)}{i}": rng.choice([_text(rng, 3), None, {"why": _text(rng, 1)}]) for i in range(n)}
    if kind == "score":
        q["criteria"] = [rng.choice([_text(rng, 2), None]) for _ in range(rng.choice([2, 5, 10]))]
    return q


def _request(rng: random.Random, i: int) -> dict:
    n = rng.choice([1, 2, 3, 16])
    state = rng.choice([_text(rng, rng.randrange(0, 40)), "", _value(rng), [_value(rng) for _ in range(3)],
                        _text(rng, 2000)])
    return {"id": f"gen-{i}", "model": "clef-flash", "state": state,
            "questions": {f"{_text(rng, 1)}q{k}": _question(rng) for k in range(n)}}


def _held(author_module, tokenizers, body: dict, max_length: int = 16384) -> str | None:
    ours_tok, theirs_tok = tokenizers
    try:
        theirs = author_module.encode_record(theirs_tok, body, max_length=max_length)
    except ValueError:
        with pytest.raises(ValueError):
            encode(ours_tok, body, max_length=max_length)
        return None
    ours = encode(ours_tok, body, max_length=max_length)
    return first_difference(ours, theirs.input_ids, theirs.questions)


def test_the_request_sets_equal_the_authors(author_module, tokenizers):
    lines = [json.loads(x) for f in ("requests.jsonl", "requests-images.jsonl")
             for x in (ROOT / "conversion" / f).read_text().splitlines() if x.strip()]
    assert len(lines) >= 30
    for body in lines:
        body = {k: v for k, v in body.items() if k not in ("images", "media_kwargs")}
        assert _held(author_module, tokenizers, body) is None, body.get("id")


def test_generated_requests_equal_the_authors(author_module, tokenizers):
    rng = random.Random(20261205)
    cut = 0
    for i in range(150):
        body = _request(rng, i)
        assert _held(author_module, tokenizers, body) is None, json.dumps(body)[:300]
        # the state cut to fit: the author's max_length rule, 0 and 3 tokens of room past the schema
        state = len(tokenizers[0].pieces([render(body["state"])])[0])
        fixed = len(encode(tokenizers[0], {**body, "state": ""}).ids)  # an empty state renders to no token
        assert encode(tokenizers[0], body).state_cut == (fixed + state > 16384)
        for room in (0, 3):
            assert _held(author_module, tokenizers, body, max_length=fixed + room) is None, (i, room)
            assert encode(tokenizers[0], body, max_length=fixed + room).state_cut == (state > room)
            cut += state > room
    assert cut > 100


def test_image_prompt_equals_the_authors_processor(author_module, release):
    """With an image: the processor's prompt (N image pads after the prefix) equals ours given N."""
    import numpy as np
    from PIL import Image

    from clef_flash.sources.reference import image_text_processor

    from transformers import AutoTokenizer

    proc = image_text_processor(release, AutoTokenizer.from_pretrained(release))
    tok = PromptTokenizer(release / "tokenizer.json")
    im = Image.fromarray(np.full((96, 160, 3), 128, np.uint8))
    body = {"model": "clef", "state": {"a": [1, "ü"]}, "images": [im],
            "questions": {"ok": {"type": "noul"}, "level": {"type": "score", "criteria": ["lo", "hi"]}}}
    theirs = author_module.encode_record(proc.tokenizer, body, processor=proc)
    n = int(theirs.media["image_grid_thw"][0].prod()) // 4
    ours = encode(tok, body, image_tokens=n)
    assert first_difference(ours, theirs.input_ids, theirs.questions) is None
    assert ours.image.start == theirs.media["token_offset"] + 1 and ours.image.tokens == n


def test_first_difference_names_the_token(tokenizers):
    from dataclasses import replace

    body = {"model": "m", "state": "x", "questions": {"a": {"type": "noul"}}}
    ours = encode(tokenizers[0], body)
    ids = list(ours.ids)
    ids[5] += 1
    assert first_difference(ours, ids, ours.questions).startswith("token 5: ours")
    assert first_difference(ours, list(ours.ids)[:-1], ours.questions).endswith(f"(equal up to token {len(ids) - 1})")
    moved = [replace(ours.questions[0], question_span=(ours.questions[0].question_span[0] + 1, ours.questions[0].question_span[1]))]
    assert "instruction span" in first_difference(ours, ours.ids, moved)
    assert first_difference(ours, ours.ids, ours.questions) is None


def test_the_encoder_imports_no_torch():
    import subprocess

    code = ("import sys, clef_flash.host.encode, clef_flash.host.model, clef_flash.host.server, clef_flash.host.answer; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# Qwen's pre-tokenizer split (letters, single digits, punctuation, newlines, spaces): what the real
# tokenizer cuts words by, with an NFC normalizer and byte-level BPE merges learnt below
HARD = WORDS + ["   ", "\n\n", " \n ", "12345", "e\u0301", "<|im_start|>", "<|im", "don't", "\t", "..."]


@pytest.fixture(scope="module")
def merging_tokenizer(tmp_path_factory) -> PromptTokenizer:
    """A byte-level BPE with merges over Qwen's split and added tokens, trained here (seeded text)."""
    from clef_flash.synth.release import qwen_style_bpe

    rng = random.Random(7)
    corpus = ["".join(rng.choice(HARD) + rng.choice(["", " "]) for _ in range(200)) for _ in range(200)]
    tok = qwen_style_bpe(corpus, 800, ["<|im_start|>", "<|im_end|>", "<|image_pad|>"])
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return PromptTokenizer(path)


def _long_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(HARD) + rng.choice(["", " ", "  "]) for _ in range(n))


@pytest.mark.parametrize("which", ["bytes", "merges"])
def test_a_long_state_is_cut_before_tokenizing_to_the_whole_texts_ids(which, tokenizers, merging_tokenizer):
    """``leading`` tokenizes a prefix only, and its ids are the whole text's first ones: many texts
    built of what moves a tokenizer's words (spaces, newlines, digits, combining marks, emoji, added
    tokens cut in two), at many counts."""
    tok = tokenizers[0] if which == "bytes" else merging_tokenizer
    assert tok._merges == (which == "merges")
    rng = random.Random(20261207)
    short_cuts = 0
    for i in range(120):
        text = _long_text(rng, rng.choice([50, 400, 3000, 12000]))
        whole = tok.pieces([text])[0]
        for count in (1, 7, rng.randrange(1, 3000), len(whole) - 1, len(whole) + 5):
            if count < 1:
                continue
            got = tok.leading(text, count)
            assert got == whole[:count], (i, count, len(text))
            short_cuts += count < len(whole) and len(text) > 4 * count + 1024 + tok._margin
    assert short_cuts > 100  # the prefix path ran, not only the whole-text fallback


@pytest.mark.parametrize("which", ["bytes", "merges"])
def test_the_ids_kept_at_a_cut_are_the_whole_texts(which, tokenizers, merging_tokenizer):
    """The rule at the cut itself: at every kind of place a text is cut (inside a run of spaces, a
    word, a number, an added token), the ids ``sure_ids`` keeps are the whole text's first ones,
    and it keeps all but the last few words."""
    tok = tokenizers[0] if which == "bytes" else merging_tokenizer
    rng = random.Random(11)
    checked = 0
    for i in range(60):
        text = _long_text(rng, 600)
        whole = tok.pieces([text])[0]
        for n in rng.sample(range(tok._margin + 40, len(text) - 1), 40):
            sure = tok.sure_ids(text, n)
            assert sure is not None and sure == whole[: len(sure)], (i, n)
            assert len(tok.pieces([text[: n - tok._margin - 30]])[0]) <= len(sure) + 12, (i, n)  # not much thrown away
            checked += 1
    assert checked == 2400


def test_a_state_of_megabytes_is_read_in_time_its_kept_tokens_take(tokenizers):
    """An 8 MB state is cut from a prefix: the kept ids equal the whole text's, and the encoder
    tokenizes no more than a few times the kept characters (counted, not timed)."""
    tok = tokenizers[0]
    calls = []
    inner = tok._tok

    class Counting:  # every text handed to the tokenizer, its length kept
        def __getattr__(self, name):
            return getattr(inner, name)

        def encode(self, text, **kw):
            calls.append(len(text))
            return inner.encode(text, **kw)

        def encode_batch(self, texts, **kw):
            calls.extend(len(t) for t in texts)
            return inner.encode_batch(texts, **kw)

    body = {"model": "clef", "state": "state " * 1_400_000, "questions": {"ok": {"type": "noul"}}}
    whole = encode(tok, body, max_length=2048)
    tok._tok = Counting()
    try:
        cut = encode(tok, body, max_length=2048)
    finally:
        tok._tok = inner
    assert cut == whole and cut.state_cut and len(cut.ids) == 2048
    assert calls and max(calls) < 64 * 1024, calls
