"""The host arrays from the author's own encode_record, and recorded records in the gate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from clef_flash.sources.author import HeadConfig, build_head
from clef_flash.head.contract import INPUT_ORDER, TINY_CONFIG
from clef_flash.head.graph import ClefHeadGraph
from clef_flash.head.host import answers, head_inputs, question_probs
from clef_flash.synth.release import synth_state


class CharTokenizer:
    """A stand-in tokenizer: one id per character (what encode_record needs of one)."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [1 + (ord(c) % 250) for c in text]

        return Out()


REQUEST = {
    "model": "clef-flash",
    "state": {"ticket": "printer on floor 3 is jammed again", "priority": "?"},
    "questions": {
        "is_hardware": {"type": "noul", "instructions": "Is this a hardware problem?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"it": "IT desk", "facilities": "Facilities", "hr": "HR"}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "critical"]},
    },
}


def test_encode_record_spans_through_host_match_author(author_module):
    cfg = dict(TINY_CONFIG)
    head = build_head(author_module, HeadConfig.model_validate(cfg), synth_state(cfg, 0, author_module), torch.float32, "x")
    encoded = author_module.encode_record(CharTokenizer(), REQUEST)
    ids = np.array(encoded.input_ids)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((len(ids), cfg["hidden_size"]), dtype=np.float32)
    table = rng.standard_normal((256, cfg["hidden_size"]), dtype=np.float32)
    hi = head_inputs(hidden, ids, encoded.questions, table)
    assert hi.length == len(ids) and hi.bucket == 2048 and 1024 < hi.length <= 2048  # one char per token
    with torch.inference_mode():
        ours = ClefHeadGraph(head)(*[torch.from_numpy(hi.arrays[k]) for k in INPUT_ORDER]).numpy()
        batch = author_module.collate_records([encoded], 0, torch.device("cpu"))
        ref = head(torch.from_numpy(hidden)[None], batch["input_ids"], batch["attention_mask"], [encoded], torch.from_numpy(table))[0]
    assert np.abs(ours[: hi.options] - torch.cat(ref).numpy()).max() <= 1e-5
    probs = question_probs(ours, hi.layout)
    got = answers(REQUEST["questions"], encoded.questions, probs)
    want = {
        q.question_id: author_module.systemone_answer(REQUEST["questions"][q.question_id],
                                                      dict(zip(q.option_ids, lg.float().softmax(-1).tolist())))
        for q, lg in zip(encoded.questions, ref)
    }
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_verify_reads_recorded_records(tmp_path, tiny_bundle, tiny_source):
    rng = np.random.default_rng(5)
    arrays = {}
    for i, length in enumerate((40, 700)):
        arrays[f"hidden_{i}"] = rng.standard_normal((length, 64), dtype=np.float32)
        arrays[f"ids_{i}"] = rng.integers(0, 1024, length)
        arrays[f"questions_{i}"] = json.dumps([
            {"id": "a", "type": 1, "question_span": [0, 5], "option_spans": [[5, 8], [8, 9], [length - 2, length]]},
            {"id": "b", "type": 0, "question_span": [10, 12], "option_spans": [[12, 14], [14, 20]]},
        ])
    rec = tmp_path / "records.npz"
    np.savez(rec, **arrays)
    transcript = tmp_path / "t.json"
    exe = Path(sys.executable).parent / "clef-export"
    r = subprocess.run([str(exe), "verify", str(tiny_bundle), "--source", str(tiny_source), "--pins",
                        str(tiny_source / "pins.json"), "--recorded", str(rec), "--transcript", str(transcript)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    t = json.loads(transcript.read_text())
    per_fn = {f["function"]: f["records"] for f in t["functions"]}
    assert per_fn == {"t512": 1, "t1024": 1, "t2048": 0, "t4096": 0}
    assert t["records_per_function"] == "recorded"


def test_missing_toolchain_is_exit_5(tmp_path, tiny_source):
    fake = tmp_path / "fake" / "coreai_torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('coreai_torch is not installed', name='coreai_torch')\n")
    exe = Path(sys.executable).parent / "clef-export"
    env = {"PYTHONPATH": str(tmp_path / "fake"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(exe), "build", "--source", str(tiny_source), "--pins", str(tiny_source / "pins.json"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert r.returncode == 5, r.stderr[-1500:]
    assert "coreai-torch / coreai-core are required" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "clef_flash_head_bucket_fp16w32").exists()
