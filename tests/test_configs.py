"""Any head configuration the author's class accepts, and any recipe the recipe schema accepts,
end to end: the graph against the author's head in eager fp32, then built, saved and run through
the Core AI runtime by `clef-export build` (its gate) and `verify`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from clef_flash.sources.author import HeadConfig, build_head
from clef_flash.cli import app
from clef_flash.head.graph import ClefHeadGraph
from clef_flash.head.host import head_inputs
from clef_flash.head.records import author_logits, random_records
from clef_flash.synth.release import synth_state, write_synth

BAR = 1e-5
CONFIGS = {
    # clef-finetune make-tiny's head (no dropout key in its file)
    "make-tiny": {"hidden_size": 64, "width": 32, "routing_layers": 1, "layers": 1, "heads": 2, "feedforward": 64},
    # a backbone wider than clef-flash's (hidden 5120), the head kept small
    "hidden-5120": {"hidden_size": 5120, "width": 64, "routing_layers": 1, "layers": 2, "heads": 4, "feedforward": 128},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graph_matches_the_author_at_other_configurations(author_module, name):
    cfg = {**CONFIGS[name], "dropout": 0.0}
    head = build_head(author_module, HeadConfig.model_validate(cfg), synth_state(cfg, 2, author_module), torch.float32,
                      "synthetic")
    graph = ClefHeadGraph(head)
    hidden = cfg["hidden_size"]
    table = np.random.default_rng(3).standard_normal((97, hidden), dtype=np.float32)
    worst = 0.0
    for bucket, lower in ((512, 0), (4096, 2048)):
        for rec in random_records(3, bucket, lower, hidden, 97, seed=bucket):
            ref = np.concatenate(author_logits(author_module, head, rec, torch.from_numpy(table)))
            arrays = head_inputs(rec.hidden, rec.ids, rec.questions, table, bucket).arrays
            with torch.inference_mode():
                out = graph(*[torch.from_numpy(arrays[k]) for k in graph.input_names]).numpy()
            worst = max(worst, float(np.abs(out[: len(ref)] - ref).max()))
            assert np.all(out[len(ref):] == 0.0)
    assert worst <= BAR, worst


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_other_configurations_through_the_saved_asset(tmp_path, author_code, name):
    src = tmp_path / "src"
    write_synth(src, config_name={**CONFIGS[name], "dropout": 0.0}, seed=4, author_code=author_code)
    r = CliRunner().invoke(app, ["build", "--source", str(src), "--out", str(tmp_path / "out"), "--verify-records", "2",
                                 "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.stdout)
    assert manifest["head"]["inputs"]["hidden"] == f"[T, {CONFIGS[name]['hidden_size']}] f32"
    verify = json.loads((tmp_path / "out" / manifest["name"] / "build-record.json").read_text())["verify"]
    assert verify["ok"] and max(verify["max_abs_dp"].values()) <= BAR
    print(f"\n{name}: max |d logit| {max(verify['max_abs_dlogit'].values()):.2e}, "
          f"max |d p| {max(verify['max_abs_dp'].values()):.2e}")


def test_a_recipe_with_other_buckets_and_pads(tmp_path, tiny_source):
    """Buckets 256 / 768 / 3072 / 6144 (t6144 in three key blocks), Q 8, O 64: built and verified,
    the manifest stating those pads, the gate's records padded to them."""
    recipe = tmp_path / "odd.toml"
    recipe.write_text('name = "{release}_odd"\nbuckets = [256, 768, 3072, 6144]\nq_pad = 8\no_pad = 64\n'
                      'weights = "fp16w32"\nformat = "aimodel"\n[verify]\nrecords = 2\n')
    r = CliRunner().invoke(app, ["build", str(recipe), "--source", str(tiny_source), "--out", str(tmp_path / "out"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.stdout)
    assert manifest["name"] == "clef_flash_odd" and manifest["head"]["functions"] == ["t256", "t768", "t3072", "t6144"]
    assert "(256, 768, 3072, 6144), Q to 8, O to 64;" in manifest["head"]["host_pad_rule"]
    r = CliRunner().invoke(app, ["verify", str(tmp_path / "out" / "clef_flash_odd"), "--source", str(tiny_source),
                                 "--records", "2", "--json"])
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)
    assert [f["function"] for f in t["functions"]] == ["t256", "t768", "t3072", "t6144"]
    assert max(q for f in t["functions"] for q in [e["questions"] for e in f["per_record"]]) == 8
    assert max(o for f in t["functions"] for o in [e["options"] for e in f["per_record"]]) == 64
