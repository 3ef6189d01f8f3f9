"""A decoder asset with functions by context (issue 59): ``main`` over the recipe's whole context and
``main_ctx{N}`` over each of its ``short_contexts``, on the same weights. A record runs in the first
function whose slots hold its chunks, so a short request does not attend over the long context's
slots; every function is described, proven by the gate, and gives the rows ``main`` gives."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .test_backbone import _release

runner = CliRunner()
SHORT = (128, 192)  # 192: the three-chunk record fills it, so its positions-late arm needs the next
CONTEXT = 512


@pytest.fixture(scope="module")
def three(tmp_path_factory, author_code) -> dict:
    """A tiny fp32 decoder over 512 slots with functions over 128 and 192 beside it, built and gated."""
    root = tmp_path_factory.mktemp("decoder-functions")
    rel = _release(root, author_code, "tiny", 0, "tiny_release")
    recipe = root / "three.toml"
    recipe.write_text(f'model = "backbone"\nname = "{{release}}_decode_fp32_pf64"\nchunk = 64\ncontext = {CONTEXT}\n'
                      f'short_contexts = {list(SHORT)}\ncompute = "fp32"\n')
    res = runner.invoke(app, ["build", str(recipe), "--source", str(rel), "--out", str(root / "out"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    bundle = root / "out" / json.loads(res.stdout)["name"]
    v = runner.invoke(app, ["verify", str(bundle), "--source", str(rel), "--json"])
    assert v.exit_code == 0, v.output[-3000:]
    return {"bundle": bundle, "release": rel, "verify": json.loads(v.stdout)}


def test_each_function_is_described_with_its_own_slots(three):
    from clef_flash.backbone.bundle import descriptor_checks
    from clef_flash.backbone.manifest import BackboneManifest, functions_of

    m = BackboneManifest.model_validate_json((three["bundle"] / "metadata.json").read_text())
    assert [(f.name, f.context) for f in functions_of(m)] == [("main_ctx128", 128), ("main_ctx192", 192), ("main", 512)]
    asset = next(three["bundle"].glob("*.aimodel"))
    for compiled in (True, False):
        checks = descriptor_checks(asset, m, compiled=compiled)
        assert all(ok for _, ok, _ in checks), [c for c in checks if not c[1]]
        slots = sorted(name for name, _, _ in checks if " state keyCache " in name)
        assert slots == ["main state keyCache [1, 1, 2, 512, 16] fp32", "main_ctx128 state keyCache [1, 1, 2, 128, 16] fp32",
                         "main_ctx192 state keyCache [1, 1, 2, 192, 16] fp32"], slots
    # a manifest that names a function the asset lacks fails the descriptor check
    wrong = m.model_copy(deep=True)
    wrong.interface.short_functions[0].function = "main_ctx64"
    failed = [name for name, ok, _ in descriptor_checks(asset, wrong, compiled=False) if not ok]
    assert failed and failed[0].startswith("functions = [main, main_ctx192, main_ctx64]"), failed


def test_the_gate_runs_a_record_in_every_function(three):
    records = three["verify"]["records"]
    assert {r["function"] for r in records if r["arm"] == "main"} == {"main_ctx128", "main_ctx192", "main"}, records
    for r in records:  # the first function whose slots hold the record's chunks, on the runtime and the torch engine
        need = -(-r["tokens"] // 64) * 64 + (r["arm"] == "positions_late")  # that arm writes one slot past its chunks
        want = next((f"main_ctx{c}" for c in SHORT if c >= need), "main")
        assert r["function"] == want, r
    late = next(r for r in records if r["arm"] == "positions_late")
    assert (late["tokens"], late["function"]) == (160, "main") and late["rel_max_abs_d"] > 1e-2, late  # it ran, and failed the bar
    assert {r["arm"] for r in records} >= {"main", "torch engine", "state_reset", "positions_late"}


def test_a_function_no_record_ran_fails_the_gate():
    from clef_flash.gate.backbone import BackboneReport, RecordResult

    def report(functions_ran):
        results = [RecordResult(name=f"r{i}", tokens=1, calls=1, rel_max_abs_d=0.0, min_row_cosine=1.0, function=f)
                   for i, f in enumerate(functions_ran)]
        return BackboneReport(bundle=Path("b"), checks=[], transcript={}, compute="fp32", results=results,
                              functions=("main_ctx128", "main"))

    assert report(["main"]).result_failures() == ["function main_ctx128 ran no gate record: it would ship unproven"]
    assert report(["main_ctx128", "main"]).result_failures() == []


def test_a_short_record_runs_in_the_short_function_and_gives_mains_rows(three):
    """The runtime's runner picks by the record's chunks; the rows equal ``main``'s over 512 slots."""
    from clef_flash.backbone.host import run_record
    from clef_flash.backbone.manifest import BackboneManifest, functions_of
    from clef_flash.backbone.runtime import runner as decoder_runner

    m = BackboneManifest.model_validate_json((three["bundle"] / "metadata.json").read_text())
    asset = next(three["bundle"].glob("*.aimodel"))
    shapes = {n: tuple(s.shape) for n, s in m.interface.states.items()}
    fns = functions_of(m)
    ids = np.random.default_rng(7).integers(0, m.language.vocab_size, size=150)

    async def rows(functions):
        async with decoder_runner(asset, functions, shapes, "fp32", 64) as (call, new_states):
            picked = [new_states(t).function.name for t in (1, 128, 129, 192, 193, 512, 513)]
            return picked, await run_record(call, new_states, ids, 64, m.language.pad_token_id)

    picked, short = asyncio.run(rows(fns))
    assert picked == ["main_ctx128", "main_ctx128", "main_ctx192", "main_ctx192", "main", "main", "main"]
    only_main, whole = asyncio.run(rows(fns[-1:]))
    assert set(only_main) == {"main"}
    assert short.shape == whole.shape == (150, m.language.hidden_size)
    assert np.abs(short - whole).max() <= 1e-5 * np.abs(whole).max()
    with pytest.raises(ValueError, match="more than the context of 512"):
        asyncio.run(_too_long(asset, fns, shapes, m.language.pad_token_id))


async def _too_long(asset, fns, shapes, pad):
    from clef_flash.backbone.host import run_record
    from clef_flash.backbone.runtime import runner as decoder_runner

    async with decoder_runner(asset, fns, shapes, "fp32", 64) as (call, new_states):
        await run_record(call, new_states, np.zeros(CONTEXT + 1, dtype=np.int64), 64, pad)
