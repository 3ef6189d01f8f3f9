"""`clef-export check-release`: a tiny random release in clef-finetune's layout with a real tiny
Qwen3.5 backbone and tokenizer (the project's own writer of that layout), its head exported, and the
shipped path answering the project's request set like the author's `systemone` on the same rows;
the red arms, the integrity and usage errors, and the request set's coverage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.check import BARS, DISAGREE, EQUAL, NEAR_TIE, ROUNDED, compare_question, default_requests, load_requests
from clef_flash.cli import app
from clef_flash.errors import UsageError

from .conftest import build_bundle

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _tiny_release(root: Path, author_code: Path, seed: int, name: str) -> tuple[Path, Path]:
    """A release folder (real tiny backbone), pinned, and the bundle built from its head."""
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    rel = write_release(root / "release", config_name=MAKE_TINY_HEAD, seed=seed, author_code=author_code, backbone="qwen3_5")
    r = invoke("pin", rel, "--name", name)
    assert r.exit_code == 0, r.output
    bundle = build_bundle(rel, root / "out", verify=True)
    return rel, bundle


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory, author_code):
    return _tiny_release(tmp_path_factory.mktemp("tiny-release"), author_code, 0, "tiny_release")


@pytest.fixture(scope="module")
def other_release(tmp_path_factory, author_code):
    return _tiny_release(tmp_path_factory.mktemp("other-release"), author_code, 1, "other_release")


def _summary(r) -> dict:
    assert r.stdout.lstrip().startswith("{"), r.output[-2000:]
    return json.loads(r.stdout)


def test_the_shipped_head_answers_the_request_set_like_the_author(tmp_path, tiny_release):
    rel, bundle = tiny_release
    out = tmp_path / "transcript.json"
    r = invoke("check-release", rel, "--bundle", bundle, "--transcript", out, "--json")
    assert r.exit_code == 0, r.output[-3000:]
    s = _summary(r)
    t = json.loads(out.read_text())
    n_requests = len(load_requests(default_requests()))
    # progress on stderr as plain lines (not a terminal here), stdout only the JSON
    assert f"reference: the author's systemone (requests): {n_requests}/{n_requests} in" in r.stderr, r.stderr[-2000:]
    assert f"head asset (calls): {s['checked']}/{s['checked']} in" in r.stderr
    assert s["requests"] == n_requests and s["checked"] >= 24
    assert s["checked"] + s["does_not_fit"] == n_requests
    assert s["disagreements"] == 0 and s["max_abs_dp"] <= BARS["float32"][0]
    assert s["answers_equal"] + s["near_ties"] + s["rounded_digits"] == s["questions"] > 24
    assert s["usage_equal"] == s["checked"]
    assert all(n > 0 for n in s["functions_used"].values()), s["functions_used"]  # every bucket hit
    # what does not fit is listed with its reason, never cut
    why = {e["id"]: e["why"] for e in t["does_not_fit"]}
    assert "largest bucket is 4096" in why["too-long-4097"]
    assert "17 questions; at most 16 fit" in why["too-many-questions-17"]
    assert "130 options; at most 128 fit" in why["too-many-options-130"]
    # the answers themselves: for an equal question, the shipped answer is the author's, field for field
    for e in t["requests"]:
        if "compare" not in e:
            continue
        for qid, c in e["compare"].items():
            if c["status"] == EQUAL:
                assert e["shipped"]["answers"][qid] == e["reference"]["answers"][qid]
    assert t["bar"]["reason"] and t["table"]["built"] is True and t["versions"]["transformers"] != "missing"


def test_the_author_streamed_a_layer_at_a_time_answers_as_the_whole_model(tmp_path, tiny_release, monkeypatch):
    """``--stream on`` (what ``auto`` takes for the 9B): the author's ``systemone`` on transformers'
    own text model with one layer's weights read where it runs, and the lm_head rows read from the
    file: the same answers as the whole model the author loads, and no layer's weight left behind."""
    rel, bundle = tiny_release
    got = {}
    for mode in ("off", "on"):
        out = tmp_path / f"{mode}.json"
        r = invoke("check-release", rel, "--bundle", bundle, "--stream", mode, "--transcript", out)
        assert r.exit_code == 0, r.output[-3000:]
        got[mode] = json.loads(out.read_text())
    assert "backbone streamed a layer at a time" in r.stderr
    on, off = ({e["id"]: e for e in got[m]["requests"]} for m in ("on", "off"))
    assert len(on) == len(off) and sum("reference" in e for e in on.values()) >= 24
    for k, e in off.items():  # the same arithmetic in the same order: equal, not near
        assert on[k].get("reference") == e.get("reference"), k
    assert any(c["detail"].startswith("streamed") for c in got["on"]["checks"] if c["check"] == "author's model")
    # the stand-in takes what the author's model reads of it, and refuses what it does not hold
    import torch

    from clef_flash.check.streamed_reference import FileRows, StreamedBackbone, streams

    assert streams(rel, "auto") is False and streams(rel, "on") is True  # a tiny release is loaded whole
    b = StreamedBackbone(rel, torch.float32, "cpu")
    assert isinstance(b.get_output_embeddings().weight, FileRows) and list(b.parameters()) == []
    ids = torch.tensor([[5, 9, 300, 7]])
    rows = b.get_output_embeddings().weight[ids[0, 1:3]]
    assert rows.dtype == torch.float32 and rows.shape == (2, 64)
    out = b.model.language_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
    assert out.last_hidden_state.shape == (1, 4, 64) and torch.isfinite(out.last_hidden_state).all()
    assert all(p.device.type == "meta" for p in b.model.language_model.streamed.model.layers.parameters())
    with pytest.raises(ValueError, match="text requests only"):
        b.model.language_model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.zeros(1))
    r = invoke("check-release", rel, "--bundle", bundle, "--stream", "sometimes")
    assert r.exit_code == 2 and "--stream must be auto, on or off" in r.output
    # an image request beside a text one: listed as not run, with why, and the text one checked
    reqs = tmp_path / "mixed.jsonl"
    image = json.loads((ROOT / "conversion" / "requests-images.jsonl").read_text().splitlines()[0])
    image["images"] = [str(ROOT / "conversion" / image["images"][0])]
    reqs.write_text(json.dumps(image) + "\n" + (ROOT / "conversion" / "requests-answer.jsonl").read_text().splitlines()[0] + "\n")
    r = invoke("check-release", rel, "--bundle", bundle, "--stream", "on", "--requests", reqs, "--transcript", tmp_path / "mixed.json")
    assert r.exit_code == 0, r.output[-3000:]
    t = json.loads((tmp_path / "mixed.json").read_text())
    assert t["summary"]["checked"] == 1 and [d["why"] for d in t["does_not_fit"]] == [
        "the author's model is streamed a layer at a time (check-release --stream): text requests only"]


@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_ctrl_c_in_check_release_is_exit_130_and_nothing_written(tmp_path, tiny_release, delay):
    """Issue 48 item 5: Ctrl-C from the first moment of check-release (once 1.5 s in printed a
    KeyboardInterrupt traceback and exited 1) is exit 130, one line, no transcript."""
    import signal
    import subprocess
    import time

    rel, bundle = tiny_release
    out = tmp_path / "transcript.json"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "clef-export"), "check-release", str(rel), "--bundle", str(bundle),
                             "--transcript", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert [x for x in err.splitlines() if "interrupted" in x] == ["interrupted: nothing was written"], err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("arm", ["spans", "lexical"])
def test_red_arm_fails(tiny_release, arm):
    rel, bundle = tiny_release
    r = invoke("check-release", rel, "--bundle", bundle, "--red", arm, "--json")
    assert r.exit_code == 4, r.output[-2000:]
    s = _summary(r)
    assert s["disagreements"] > 0 and s["max_abs_dp"] > BARS["float32"][0]
    assert "FAIL" in r.stderr


def test_a_given_table_is_used_and_one_of_another_release_is_refused(tmp_path, tiny_release, other_release):
    rel, bundle = tiny_release
    other_rel, other_bundle = other_release
    for src, dest in ((rel, tmp_path / "mine"), (other_rel, tmp_path / "other")):
        r = invoke("lm-head-table", "--source", src, "--out", dest)
        assert r.exit_code == 0, r.output
    r = invoke("check-release", rel, "--bundle", bundle, "--table", tmp_path / "mine" / "lm_head_fp16.bin",
               "--requests", tmp_path / "few.jsonl")
    assert r.exit_code == 2 and "few.jsonl: requests file not found" in r.output
    lines = default_requests().read_text().splitlines()
    (tmp_path / "few.jsonl").write_text("\n".join(lines[:3]) + "\n")
    r = invoke("check-release", rel, "--bundle", bundle, "--table", tmp_path / "mine" / "lm_head_fp16.bin",
               "--requests", tmp_path / "few.jsonl", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    assert _summary(r)["checked"] == 3
    r = invoke("check-release", rel, "--bundle", bundle, "--table", tmp_path / "other" / "lm_head_fp16.bin",
               "--requests", tmp_path / "few.jsonl")
    assert r.exit_code == 3 and "not this release's model.safetensors" in r.output, r.output[-2000:]
    # a bundle of another head: refused before anything runs
    r = invoke("check-release", rel, "--bundle", other_bundle, "--requests", tmp_path / "few.jsonl")
    assert r.exit_code == 3 and "the bundle was built from another head" in r.output, r.output[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_requests_and_missing_extra_are_one_line_errors(tmp_path, tiny_release, monkeypatch):
    rel, bundle = tiny_release
    good = json.loads(default_requests().read_text().splitlines()[0])
    cases = {
        "notjson.jsonl": ("{\"model\": 1\n", "notjson.jsonl:1: not JSON"),
        "notype.jsonl": (json.dumps({**good, "questions": {"x": {"type": "rank"}}}), "notype.jsonl:1: question 'x': type"),
        "image.jsonl": ("\n" + json.dumps({**good, "images": ["cat.png"]}), "image.jsonl:2: image cat.png not found"),
        "video.jsonl": (json.dumps({**good, "videos": ["a.mp4"]}), "video.jsonl:1: requests with videos are not supported"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        r = invoke("check-release", rel, "--bundle", bundle, "--requests", tmp_path / name)
        assert r.exit_code == 2 and message in r.output, (name, r.output)
        assert len(r.stderr.strip().splitlines()) == 1
    r = invoke("check-release", rel, "--bundle", bundle, "--dtype", "float16")
    assert r.exit_code == 2 and "--dtype must be one of" in r.output
    # without the reference extra: exit 5 and what to install
    monkeypatch.setitem(sys.modules, "transformers", None)
    r = invoke("check-release", rel, "--bundle", bundle)
    assert r.exit_code == 5 and "pip install 'clef-export[reference]'" in r.output, r.output
    (tmp_path / "empty.jsonl").write_text(json.dumps({**good, "questions": {}}))
    with pytest.raises(UsageError, match="empty.jsonl:1: at least one question"):
        load_requests(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------- comparing one question


def _choice_answers(p: dict[str, float]) -> dict:
    best = max(p, key=p.__getitem__)
    return {"type": "choice", "choice": best, "confidence": round(p[best], 4),
            "probabilities": {k: round(v, 4) for k, v in p.items()}}


SPEC = {"type": "choice", "criteria": {"a": None, "b": None, "c": None}}
IDS = ("a", "b", "c")


def _cmp(p_ref, p_got, bar=1e-5):
    ref, got = dict(zip(IDS, p_ref)), dict(zip(IDS, p_got))
    return compare_question(SPEC, _choice_answers(ref), _choice_answers(got), np.array(p_ref, np.float32),
                            np.array(p_got, np.float32), IDS, bar)


def test_compare_equal_rounded_near_tie_and_disagree():
    assert _cmp([0.5, 0.3, 0.2], [0.5, 0.3, 0.2])["status"] == EQUAL
    # a value on the other side of a 4th-decimal edge, every probability within the bar
    c = _cmp([0.50005, 0.29995, 0.2], [0.500049, 0.299951, 0.2])
    assert c["status"] == ROUNDED and c["fields_differ"] == ["probabilities"]
    # two options within the bar of each other: the choice flips, reported, not failed
    c = _cmp([0.400003, 0.399997, 0.2], [0.399998, 0.400002, 0.2])
    assert c["status"] == NEAR_TIE and c["tie"]["reference"] == "a" and c["tie"]["shipped"] == "b"
    # the same flip with a probability moved beyond the bar fails
    c = _cmp([0.45, 0.35, 0.2], [0.35, 0.45, 0.2])
    assert c["status"] == DISAGREE and "max |d p|" in c["why"] and "chose 'b'" in c["why"]
    # a difference no probability noise explains (the legend) fails even with equal probabilities
    ref = {"type": "score", "score": 1.0, "confidence": 0.5, "legend": {"0": "x", "1": "y"}, "probabilities": {"0": 0.5, "1": 0.5}}
    got = {**ref, "legend": {"0": "x", "1": "z"}}
    c = compare_question({"type": "score", "criteria": ["x", "y"]}, ref, got, np.array([0.5, 0.5]), np.array([0.5, 0.5]),
                         ("0", "1"), 1e-5)
    assert c["status"] == DISAGREE and "legend" in c["why"]


# ---------------------------------------------------------------- the request set


def test_the_request_set_covers_what_it_should(author_module):
    """conversion/requests.jsonl (written by conversion/scripts/make_requests.py): every type, choices of 2
    to 10 options, scores of 3 to 7 levels, 1 to 16 questions, text and JSON states, and requests
    within a few tokens of each bucket's upper edge and just over the one below, once encoded by the
    author's encode_record with the tiny release's byte-level tokenizer."""
    from clef_flash.head.contract import BUCKETS
    from clef_flash.head.host import HostInputError, check_fits
    from clef_flash.synth.release import byte_tokenizer

    tok = byte_tokenizer()
    reqs = load_requests(default_requests())
    fitting, choices, levels, counts, states, lengths = 0, set(), set(), set(), set(), []
    for req in reqs:
        enc = author_module.encode_record(tok, req.body)
        try:
            check_fits(len(enc.input_ids), enc.questions)
        except HostInputError:
            continue
        fitting += 1
        lengths.append(len(enc.input_ids))
        counts.add(len(req.body["questions"]))
        states.add(type(req.body["state"]).__name__)
        for q in req.body["questions"].values():
            if q["type"] == "choice":
                choices.add(len(q["criteria"]))
            elif q["type"] == "score":
                levels.add(len(q["criteria"]))
    types = {q["type"] for req in reqs for q in req.body["questions"].values()}
    assert fitting >= 24 and len(reqs) - fitting >= 3
    assert types == {"noul", "choice", "score"}
    assert set(range(2, 11)) <= choices and set(range(3, 8)) <= levels
    assert {1, 16} <= counts and len(counts) >= 6
    assert {"str", "dict"} <= states
    for lower, upper in zip((0, *BUCKETS), BUCKETS):
        assert any(upper - 8 <= n <= upper for n in lengths), f"nothing just under {upper}"
        if lower:
            assert lower + 1 in lengths, f"nothing just over {lower}"
