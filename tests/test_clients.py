"""The ecosystem's clients at their own default batch sizes (issue 59), against ``serve`` on a tiny
release whose tokenizer spends about a token a word, as a real one does (synth's ``words``
tokenizer; the byte tokenizer's token a byte puts 64 questions past any model's 16,384 tokens), its
dist the README walkthrough's (the published head, the wide head, the decoder at 16,384 tokens).

A loopback proxy records every request a client sent and what it was answered. Each is answered
again by ``answer`` (equal), and checked by ``check-release`` against the author's ``systemone``
(within its bar), so what is proven is what the clients really send, at their defaults:
clef-compactor's ``clef-compact`` CLI and async client (64 chunks: one request of 64 nouls),
clef-router's compactor (20 documents: 20 four-level scores), clef-rag's paragraph screen on both
of its backends (12 paragraphs: 24 nouls), clef-evals' ``clef-eval run --async`` with a choice; and
beside them a request past what any client sends (64 questions, 192 options) and a state past
16,384 tokens, cut as the author cuts it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .serving import EXE, Recorder, Served

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
runner = CliRunner()
WORDS = ("desk leg cracked parcel refund order ticket card declined billing shipping delivery team customer "
         "arrived crushed returns charges message week day people system data model answer").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@pytest.fixture(scope="module")
def dist(tmp_path_factory, author_code) -> dict:
    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, WORDS_VOCAB, write_release

    root = tmp_path_factory.mktemp("clients")
    rel = write_release(root / "words_release", config_name=MAKE_TINY_HEAD, seed=0, author_code=author_code,
                        backbone="qwen3_5", variant="tiny", tokenizer="words", vocab=WORDS_VOCAB)
    pin_local(rel, name="words_release")
    r = runner.invoke(app, ["release", *(str(ROOT / "conversion" / f) for f in (
        "head_bucket_fp16w32.toml", "head_wide_fp16w32.toml", "backbone_pf64_fp16w32.toml")),
        "--source", str(rel), "--dist", str(root / "dist")])
    assert r.exit_code == 0, r.output[-3000:]
    return {"release": rel, "dist": root / "dist", "root": root}


@pytest.fixture(scope="module")
def runs(dist) -> dict:
    """Every client run once at its defaults through the recording proxy; what each returned."""
    import httpx

    served = Served(dist["dist"])
    proxy = Recorder(served.url)
    try:
        out = {"compactor_cli": _compactor_cli(proxy.url, dist["root"]), "compactor_async": _compactor_async(proxy.url),
               "router": _router(proxy.url), "rag": _rag(proxy.url), "evals": _evals(proxy.url, dist["root"]),
               "cut": httpx.post(proxy.url + "/v1/systemone", json=CUT, timeout=900).json()}
    finally:
        proxy.stop()
        code, log = served.stop()
    assert code == 0, log[-3000:]
    out["exchanges"], out["log"] = proxy.exchanges, log
    return out


# a state past the author's 16,384 tokens: cut to fit by the author and by the host alike
CUT = {"model": "clef-flash", "state": _text(random.Random(16384), 24000),
       "questions": {"a": {"type": "noul", "instructions": "Was the desk refunded?"},
                     "c": {"type": "choice", "criteria": {"q": "Billing.", "p": "Shipping."}}}}


def _chunks() -> list[str]:
    rng = random.Random(64)
    return [_text(rng, 18) for _ in range(64)]


def _env(url: str) -> dict:
    return {**os.environ, "CLEF_BASE_URL": url + "/client/v4", "CLEF_ACCOUNT_ID": "local", "CLEF_API_TOKEN": "local"}


def _compactor_cli(url: str, root: Path) -> dict:
    r = subprocess.run([BIN / "clef-compact", "--query", "Which desk order was refunded?", "--chunks", *_chunks(), "--json"],
                       capture_output=True, text=True, env=_env(url), timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout)


def _compactor_async(url: str) -> list:
    from clef_compactor.core import AsyncClefCompactor

    async def go():
        async with AsyncClefCompactor(account_id="local", api_token="local", base_url=url + "/client/v4") as c:
            return await c.score("Which desk order was refunded?", _chunks())

    return asyncio.run(go())


def _router(url: str):
    from clef_router import ClefRouter
    from clef_router.compactor import compact

    rng = random.Random(20)
    docs = [_text(rng, 30) for _ in range(20)]
    return compact("Which parcel arrived crushed?", docs, 200, router=ClefRouter(account_id="local", api_token="local",
                                                                                base_url=url + "/client/v4"))


def _rag(url: str) -> dict:
    from clef_rag.clef.client import ClefClient, ClefConfig
    from clef_rag.enrich.screen import screen_document
    from clef_rag.types import Document

    rng = random.Random(12)
    doc = Document(text="# Returns\n\n" + "\n\n".join(_text(rng, 25) for _ in range(12)) + "\n", doc_id="returns.md",
                   title="Returns")
    got = {}
    for backend, base in (("self-hosted", url), ("workers-ai", url + "/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare")):
        os.environ.setdefault("CLOUDFLARE_ACCOUNT_ID", "local")
        os.environ.setdefault("CLOUDFLARE_API_TOKEN", "local")

        async def go(cfg):
            async with ClefClient(cfg) as client:
                return await screen_document(client, doc)

        got[backend] = asyncio.run(go(ClefConfig(backend=backend, base_url=base, cache_dir=None, max_retries=0)))
    return got


def _evals(url: str, root: Path) -> dict:
    data = root / "eval.jsonl"
    items = [{"state": "The refund was charged twice on my card.", "instructions": "Is this a billing problem?", "gold": True},
             {"state": "Card declined at checkout, twice.", "instructions": "Which team owns this?",
              "criteria": {"billing": "Charges and refunds.", "shipping": "Delivery and parcels."}, "gold": "billing"}]
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    r = subprocess.run([BIN / "clef-eval", "run", str(data), "--async", "--json"], capture_output=True, text=True,
                       env=_env(url), timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_clients_take_every_answer_at_their_default_batch_sizes(runs):
    ex = runs["exchanges"]
    assert all(e["status"] == 200 for e in ex), [(e["path"], e["status"], str(e["response"])[:200]) for e in ex if e["status"] != 200]
    # one request each at its default batch, counting the answers that reached the client: on a busy
    # machine a client may time out and send the same body again (seen once in CI beside a 9B run)
    sizes = sorted(len(e["body"]["questions"]) for e in ex if e["delivered"])
    assert sizes.count(64) == 2 and 20 in sizes and sizes.count(24) == 2, sizes
    assert sum(e["path"] == "/v1/systemone" for e in ex) == 2  # clef-rag's self-hosted backend, and the cut state
    cli, scored = runs["compactor_cli"], runs["compactor_async"]
    assert len(cli["scores"]) == 64 and [round(s.score, 6) for s in scored] == [round(c["score"], 6) for c in cli["scores"]]
    assert len(runs["router"].kept) + len(runs["router"].cut) == 20
    for res in runs["rag"].values():
        assert res.requests == 1 and res.failed_batches == 0 and res.screened == 12
    assert runs["evals"]["gate_passed"] is True and runs["evals"].get("failures", 0) == 0, runs["evals"]


def test_each_request_ran_in_the_first_decoder_function_that_holds_it(runs, dist):
    """The walkthrough's decoder has ``main`` over 16,384 slots and ``main_ctx4096`` beside it: what
    fits 4,096 slots attends over those only (docs/host.md), the cut state runs in ``main``."""
    import re

    ran = [(fn, int(tokens)) for fn, tokens in re.findall(r"answered in [\d.]+ s \((main\w*), t\d+, (\d+) tokens", runs["log"])]
    assert len(ran) == sum(1 for e in runs["exchanges"] if e["status"] == 200), runs["log"][-2000:]
    assert all(fn == ("main_ctx4096" if -(-t // 64) * 64 <= 4096 else "main") for fn, t in ran), ran
    assert {fn for fn, _ in ran} == {"main_ctx4096", "main"} and ("main", 16384) in ran, ran
    from clef_flash.release.card import model_card, read_dist

    # the card tells a Mac host's author which function takes which records
    assert "Shorter functions on the same weights: `main_ctx4096` (4,096 slots)." in model_card(read_dist(dist["dist"]))


def test_what_the_clients_sent_is_answered_by_answer_equally_and_within_the_authors_bar(runs, dist):
    from .test_answer import _within_bar

    unique: dict[str, dict] = {}
    for e in runs["exchanges"]:
        unique.setdefault(json.dumps(e["body"], sort_keys=True), e["body"])
    # and past every client: 64 questions with 192 options (the published head takes 16 and 128)
    many = {"model": "clef-flash", "state": "Rate each issue.",
            "questions": {f"q{i:02d}": {"type": "score", "instructions": f"How bad is issue {i}?", "criteria": ["low", "mid", "high"]}
                          for i in range(64)}}
    unique[json.dumps(many, sort_keys=True)] = many
    reqs = dist["root"] / "sent.jsonl"
    reqs.write_text("".join(json.dumps({**b, "id": f"sent{i}"}) + "\n" for i, b in enumerate(unique.values())))
    r = subprocess.run([EXE, "answer", str(dist["dist"]), "--requests", str(reqs)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["id"] for x in lines] == [f"sent{i}" for i in range(len(unique))]
    by_body = dict(zip(unique, lines))
    for e in runs["exchanges"]:
        got = e["response"] if e["path"] == "/v1/systemone" else e["response"]["result"]
        want = {k: v for k, v in by_body[json.dumps(e["body"], sort_keys=True)].items() if k not in ("line", "id")}
        assert got == want, e["path"]
    transcript = dist["root"] / "check.json"
    # the author's answers (against the wide head on the author's rows: `answer` above ran the decoder asset)
    heads = sorted(dist["dist"].glob("*_head_wide_fp16w32"))
    c = runner.invoke(app, ["check-release", str(dist["release"]), "--bundle", str(heads[0]), "--requests", str(reqs),
                            "--transcript", str(transcript)])
    assert c.exit_code == 0, c.output[-3000:]
    t = json.loads(transcript.read_text())
    assert t["summary"]["encoder"] == {"compared": len(unique), "differ": 0}  # merges: the host's pieces are the author's
    by_id = {x["id"]: x for x in lines}
    assert sum(_within_bar(e, by_id[e["id"]]) for e in t["requests"]) >= 64 + 64 + 20 + 24
    assert len(lines[-1]["answers"]) == 64 and sum(len(a["probabilities"]) for a in lines[-1]["answers"].values()) == 192
    cut = next(e for e in t["requests"] if e.get("reference", {}).get("usage", {}).get("input_tokens") == 16384)
    assert cut["function"] == "t16384" and runs["cut"]["usage"]["input_tokens"] == 16384  # what was read, as the author says
