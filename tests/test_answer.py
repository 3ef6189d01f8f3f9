"""Running what was shipped (issue 46): a tiny release's dist/ (head, decoder, tower, table)
answering with its assets alone through ``answer`` and ``serve``: equal to each other and within
check-release's bar of the author's; spoken to by clef-evals' ClefClient and ``clef-eval run`` and
by clef-router; every bad input a one-line error naming its line or field, the rest answered."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

from .serving import EXE, Served

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "conversion" / "requests-images.jsonl"
runner = CliRunner()


def _png(w: int = 64, h: int = 48) -> str:
    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng([w, h])
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _body(i: int, **extra) -> dict:
    return {"id": f"r{i}", "model": "clef-flash", "state": {"ticket": i, "text": "Desk came with a cracked leg ✓"},
            "questions": {"escalate": {"type": "noul", "instructions": "Escalate now?"},
                          "team": {"type": "choice", "instructions": "Owning team?",
                                   "criteria": {"billing": "Charges.", "shipping": "Delivery.", "returns": None}},
                          "severity": {"type": "score", "instructions": "How bad?", "criteria": ["low", "mid", "high"]}},
            **extra}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, author_code) -> dict:
    """The tiny release (real tiny Qwen3.5 backbone and tower), its dist/ from `release`, and
    check-release's transcript over the image requests through the same bundles."""
    from clef_flash.sources.pinning import pin_local
    from clef_flash.synth.release import MAKE_TINY_HEAD, write_release

    root = tmp_path_factory.mktemp("shipped")
    rel = write_release(root / "tiny_release", config_name=MAKE_TINY_HEAD, seed=0, author_code=author_code,
                        backbone="qwen3_5", variant="tiny")
    pin_local(rel, name="tiny_release")
    dist = root / "dist"
    # the README's walkthrough's heads: the published one and the wide one (64 questions, 512 options,
    # 16,384 tokens); its decoder at the published port's 4,096 slots, where a chunk costs a third of one
    # over 16,384 at tiny size (records past 4,096 tokens: tests/test_clients.py, on the walkthrough's own)
    recipe = (ROOT / "conversion" / "backbone_pf64_fp16w32.toml").read_text()
    short = root / "backbone_pf64_fp16w32.toml"
    short.write_text(recipe.replace("context = 16384", "context = 4096").replace("short_contexts = [4096]", "")
                  .replace("long_record = 4161", ""))
    r = runner.invoke(app, ["release", str(ROOT / "conversion" / "head_bucket_fp16w32.toml"), str(ROOT / "conversion" / "head_wide_fp16w32.toml"),
                            str(short), str(ROOT / "conversion" / "vision_fp16w32.toml"), "--source", str(rel), "--dist", str(dist)])
    assert r.exit_code == 0, r.output[-3000:]
    bundles = {json.loads(m.read_text())["kind"]: m.parent for m in dist.glob("*/metadata.json") if "_head_wide_" not in m.parent.name}
    bundles["wide-head"] = next(dist.glob("*_head_wide_fp16w32"))
    transcript = root / "check.json"
    r = runner.invoke(app, ["check-release", str(rel), "--bundle", str(bundles["decision-head"]), "--backbone",
                            str(bundles["decision-backbone"]), "--vision", str(bundles["vision-tower"]), "--requests",
                            str(IMAGES), "--transcript", str(transcript)])
    assert r.exit_code == 0, r.output[-3000:]
    return {"release": rel, "dist": dist, "bundles": bundles, "check": json.loads(transcript.read_text())}


def _answer(dist: Path, requests: Path, *extra, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "answer", str(dist), "--requests", str(requests), *map(str, extra)], capture_output=True,
                          text=True, timeout=600, env=env)


def _lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


# ---------------------------------------------------------------- answer


def test_answer_equals_the_authors_within_check_releases_bar(shipped):
    r = _answer(shipped["dist"], IMAGES)
    assert r.returncode == 4, r.stderr[-3000:]  # the poster over the tower's cap is listed as failed
    got = {x["id"]: x for x in _lines(r.stdout)}
    assert list(got) == [json.loads(x)["id"] for x in IMAGES.read_text().splitlines() if x.strip()], "input order"
    t = shipped["check"]
    assert t["summary"]["encoder"] == {"compared": 6, "differ": 0}
    compared = 0
    for e in t["requests"]:
        if "function" not in e:
            assert got[e["id"]]["error"]["status"] == 422 and "cap" in got[e["id"]]["error"]["message"]
            assert f"requests-images.jsonl:{e['line']}: images[0]" in r.stderr
            continue
        compared += _within_bar(e, got[e["id"]])
    assert compared >= 8


def _within_bar(entry: dict, mine: dict) -> int:
    """``mine`` (a SystemOne response) against a check-release transcript entry's author answer:
    the author's usage, each choice, and each number within one unit of its 4th digit; how many questions."""
    ref = entry["reference"]
    assert {k: mine["usage"][k] for k in ref["usage"]} == ref["usage"]  # the author's counts; total_tokens is Workers AI's
    assert mine["usage"]["total_tokens"] == mine["usage"]["input_tokens"] + mine["usage"]["output_tokens"]
    assert list(mine["answers"]) == list(ref["answers"]), entry["id"]
    for qid, want in ref["answers"].items():
        have = mine["answers"][qid]
        assert have["type"] == want["type"] and have.get("choice") == want.get("choice"), (entry["id"], qid)
        for k in ("noul", "score", "confidence"):
            if k in want:  # rounded to 4 digits by both; the bar is far below one unit of the 4th
                assert abs(have[k] - want[k]) <= 1e-4 + 1e-12, (entry["id"], qid, k)
    return len(ref["answers"])


def test_answer_imports_no_torch_transformers_or_author_code(shipped, tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps(_body(0)) + "\n")
    code = ("import sys, json; from pathlib import Path; from clef_flash.host.answer import AnswerConfig, answer_file; "
            f"res = answer_file(AnswerConfig(dist={str(shipped['dist'])!r}, requests=Path({str(reqs)!r}))); "
            "bad = sorted(m for m, mod in sys.modules.items() if m.split('.')[0] in ('torch', 'transformers') "
            "or 'joint_schema_model' in (getattr(mod, '__file__', None) or '')); print(json.dumps([bad, res.lines]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    bad, lines = json.loads(out.stdout.strip().splitlines()[-1])
    assert bad == [] and json.loads(lines[0])["answers"]["team"]["type"] == "choice"


def test_bad_lines_are_listed_and_the_rest_answered(shipped, tmp_path):
    img = "data:image/png;base64," + _png()
    lines = [
        json.dumps(_body(1)),
        "{not json",
        json.dumps({**_body(2), "questions": {"x": {"type": "ranking"}}}),
        json.dumps({**_body(3), "questions": {"x": {"type": "choice", "criteria": {f"o{i}": None for i in range(514)}}}}),
        json.dumps({**_body(4), "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}),
        json.dumps(_body(5, images=[img, img])),
        json.dumps(_body(6, videos=["clip.mp4"])),
        json.dumps(_body(7, images=["data:image/png;base64," + base64.b64encode(b"not a png at all").decode()])),
        json.dumps(_body(8, images=["https://example.invalid/cat.png"])),
        json.dumps(_body(9, images=[{"content_type": "image/png", "base64": _png(40, 30)}])),
        json.dumps(_body(10, images=[img])),
    ]
    reqs = tmp_path / "bad.jsonl"
    reqs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "answers.jsonl"
    r = _answer(shipped["dist"], reqs, "--out", out)
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stdout == ""
    got = _lines(out.read_text())
    assert [x.get("line") for x in got] == list(range(1, 12))
    fields = {x["line"]: (x["error"]["field"], x["error"]["status"]) for x in got if "error" in x}
    assert fields == {2: ("body", 400), 3: ("questions.x.type", 400), 4: ("questions", 422), 5: ("questions", 422),
                      6: ("images", 422), 7: ("videos", 400), 8: ("images[0]", 400), 9: ("images[0]", 400)}
    for n in fields:
        assert f"bad.jsonl:{n}: " in r.stderr
    # the widest head's limits (the walkthrough's wide head: 64 questions, 512 options)
    assert "514 options; at most 512" in got[3]["error"]["message"] and "65 questions; at most 64" in got[4]["error"]["message"]
    assert all("answers" in got[n - 1] for n in (1, 10, 11))


def test_out_is_refused_before_work_and_never_half_written(shipped, tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(_body(i)) + "\n" for i in range(40)))
    out = tmp_path / "a.jsonl"
    out.write_text("keep\n")
    r = _answer(shipped["dist"], reqs, "--out", out)
    assert r.returncode == 2 and "already exists" in r.stderr and out.read_text() == "keep\n"
    out.unlink()
    p = subprocess.Popen([EXE, "answer", str(shipped["dist"]), "--requests", str(reqs), "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    err = ""
    while "answering" not in err and time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        err += line
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    assert p.returncode == 130, err + rest
    assert not out.exists() and not list(tmp_path.glob(".a.jsonl*"))


def test_a_dist_that_fails_its_sums_or_mixes_releases_is_refused(shipped, tmp_path):
    dist = tmp_path / "dist"
    shutil.copytree(shipped["dist"], dist)
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps(_body(0)) + "\n")
    sidecar = dist / "host" / "lm_head_fp16.json"
    sidecar.write_text(sidecar.read_text().replace('"rows_checked"', '"rows_checked" ', 1))
    r = _answer(dist, reqs)
    assert r.returncode == 3 and f"{sidecar}: sha256 differs from SHA256SUMS's" in r.stderr
    shutil.rmtree(dist)
    shutil.copytree(shipped["dist"], dist)
    # a tower of another release: its manifest names another model.safetensors (and SHA256SUMS lists it)
    import hashlib

    meta = next(p for p in dist.glob("*/metadata.json") if json.loads(p.read_text())["kind"] == "vision-tower")
    m = json.loads(meta.read_text())
    m["source"]["files"]["model.safetensors"] = "0" * 64
    meta.write_text(json.dumps(m, indent=2))
    sums = dist / "SHA256SUMS"
    rel = meta.relative_to(dist).as_posix()
    sums.write_text("".join(f"{hashlib.sha256(meta.read_bytes()).hexdigest()}  {rel}\n" if line.endswith(f"  {rel}") else line + "\n"
                            for line in sums.read_text().splitlines()))
    r = _answer(dist, reqs)
    assert r.returncode == 3 and "bundles of different releases" in r.stderr and "model.safetensors" in r.stderr
    (dist / "notes.txt").write_text("top-level extras (a card, a record) are not the release's files\n")
    extra = next(dist.glob("*_head_*")) / "stray.txt"
    extra.write_text("x")
    r = _answer(dist, reqs)
    assert r.returncode == 3 and f"{extra}: not listed in" in r.stderr


def test_answer_a_published_release_by_commit(shipped, tmp_path):
    from .fakehub import FakeHubRepos

    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps(_body(0)) + "\n")
    files = {p.relative_to(shipped["dist"]).as_posix(): p.read_bytes() for p in shipped["dist"].rglob("*") if p.is_file()}
    local = _answer(shipped["dist"], reqs)
    assert local.returncode == 0, local.stderr[-2000:]
    with FakeHubRepos() as hub:
        hub.create("you/tiny-coreai", files={**files, "README.md": b"a card\n"})
        commit = hub.commits("you/tiny-coreai")[-1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf"))
        r = _answer(f"you/tiny-coreai@{commit}", reqs, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _lines(r.stdout) == _lines(local.stdout)
        r = _answer("you/tiny-coreai@" + "0" * 40, reqs, env=env)
        assert r.returncode == 3 and f"you/tiny-coreai@{'0' * 40}: " in r.stderr
    r = _answer("you/tiny-coreai@main", reqs)
    assert r.returncode == 2 and "OWNER/NAME@COMMIT" in r.stderr


# ---------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def served(shipped):
    s = Served(shipped["dist"])
    yield s
    s.stop()


def test_serve_speaks_clef_evals_and_clef_router_and_equals_answer(shipped, served, tmp_path, monkeypatch):
    from clef_evals.client import ClefClient
    from clef_evals.config import ClefConfig
    from clef_evals.models import Choice, Noul, Score
    from clef_router import ClefRouter

    bodies = [_body(i) for i in range(3)] + [_body(3, images=[{"content_type": "image/png", "base64": _png(80, 60)}])]
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps({**b, "model": "clef"}) + "\n" for b in bodies))
    want = {x["id"]: x for x in _lines(_answer(shipped["dist"], reqs).stdout)}
    env = {"CLEF_BASE_URL": served.url + "/client/v4", "CLEF_ACCOUNT_ID": "local", "CLEF_API_TOKEN": "unused",
           "CLEF_MODEL": "@cf/cloudflare/clef", "CLEF_MAX_RETRIES": "0"}
    client = ClefClient(ClefConfig.from_env(env))
    for b in bodies:
        q = b["questions"]
        got = client.run(b["state"], {"escalate": Noul(instructions=q["escalate"]["instructions"]),
                                      "team": Choice(instructions=q["team"]["instructions"], criteria=q["team"]["criteria"]),
                                      "severity": Score(instructions=q["severity"]["instructions"], criteria=q["severity"]["criteria"])},
                         images=b.get("images"))
        w = want[b["id"]]
        assert got.usage.input_tokens == w["usage"]["input_tokens"]
        assert got.answers["escalate"].probability == w["answers"]["escalate"]["noul"]
        assert got.answers["team"].choice == w["answers"]["team"]["choice"]
        assert got.answers["team"].probabilities == w["answers"]["team"]["probabilities"]
        assert got.answers["severity"].score == w["answers"]["severity"]["score"]
    router = ClefRouter(account_id="local", api_token="unused", base_url=served.url + "/client/v4", model_selector="clef-flash")
    d = router.decide(bodies[0]["state"], bodies[0]["questions"])  # clef-router's own parser took the envelope
    assert d.model == "clef-flash" and d.usage.input_tokens == want["r0"]["usage"]["input_tokens"]
    assert d.raw_response["result"]["answers"] == want["r0"]["answers"] and set(d.answers) == {"escalate", "team", "severity"}
    route = router.route("Refund my order please")  # its own routing questions, answered by the shipped model
    assert route.tier in ("cheap", "frontier") and route.decision.usage.input_tokens > 100 and route.decision.answers
    # the route without /client/v4, and the raw envelope
    import httpx

    r = httpx.post(served.url + "/accounts/x/ai/run/@cf/cloudflare/clef-flash", json=bodies[1], timeout=120)
    env_ = r.json()
    assert r.status_code == 200 and env_["success"] is True and env_["errors"] == [] and env_["messages"] == []
    assert env_["result"]["answers"] == want["r1"]["answers"] and env_["result"]["model"] == "clef-flash"
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ready" and set(h["bundles"]) == {f"{p.name}/metadata.json" for p in shipped["bundles"].values()}


def test_clef_eval_run_against_serve(served, tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in [
        {"state": "The refund was sent twice.", "instructions": "Is this a billing problem?", "gold": True},
        {"state": "The parcel never arrived.", "instructions": "Is this a billing problem?", "gold": False},
        {"state": "Card declined at checkout.", "instructions": "Which team?", "criteria": {"billing": "Charges", "shipping": "Delivery"},
         "gold": "billing"},
    ]))
    env = {**os.environ, "CLEF_BASE_URL": served.url + "/client/v4", "CLEF_ACCOUNT_ID": "local", "CLEF_API_TOKEN": "unused",
           "CLEF_MAX_RETRIES": "0"}
    exe = str(Path(sys.executable).parent / "clef-eval")
    r = subprocess.run([exe, "run", str(data), "--json", "--min-accuracy", "0", "--max-ece", "1"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["gate_passed"] is True and res.get("failures", 0) == 0
    r = subprocess.run([exe, "run", str(data), "--json", "--min-accuracy", "1.01"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 1


def test_serve_errors_each_with_its_status_and_keeps_serving(shipped, served):
    import httpx

    url = served.url + "/client/v4/accounts/a/ai/run/@cf/cloudflare/clef"
    cases = [
        (httpx.post(url, content=b"{nope", timeout=60), 400, "body: not JSON"),
        (httpx.post(url, json={**_body(0), "questions": {"x": {"type": "ranking"}}}, timeout=60), 400, "questions.x.type"),
        (httpx.post(url, json={"state": "x", "questions": {"a": {"type": "noul"}}}, timeout=60), 400, "model"),
        (httpx.post(url, json=_body(0, images=["/etc/passwd"]), timeout=60), 400, "images[0]"),
        (httpx.post(url, json=_body(0, images=["http://127.0.0.1:1/x.png"]), timeout=60), 400, "never fetched"),
        (httpx.post(served.url + "/client/v4/accounts/a/ai/run/@cf/cloudflare/llama", json=_body(0), timeout=60), 404, "not found"),
        (httpx.post(served.url + "/chat/completions", json=_body(0), timeout=60), 404, "no such route"),  # /v1/...: the bare form
        (httpx.post(url, json={**_body(0), "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, timeout=60), 422,
         "65 questions; at most 64"),
        (httpx.post(url, content=b"x" * (33 * 1024 * 1024), timeout=60), 413, "body: over"),
    ]
    for r, status, text in cases:
        body = r.json()
        assert r.status_code == status and body["success"] is False and body["result"] is None, (status, body)
        assert body["errors"][0]["code"] == status and text in body["errors"][0]["message"], (status, body)
    ok = httpx.post(url, json=_body(0), timeout=120)
    assert ok.status_code == 200 and ok.json()["success"] is True


def test_serve_token_bind_queue_and_drain(shipped):
    import concurrent.futures

    import httpx

    r = runner.invoke(app, ["serve", str(shipped["dist"]), "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "needs --token" in r.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = runner.invoke(app, ["serve", str(shipped["dist"]), "--port", str(taken.getsockname()[1])])
        assert r.exit_code == 2 and "cannot listen on 127.0.0.1" in r.output, r.output
    s = Served(shipped["dist"], "--token", "s3cret", "--queue", "1")
    try:
        url = s.url + "/client/v4/accounts/a/ai/run/@cf/cloudflare/clef"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url, json=_body(0), headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["success"] is False
        auth = {"Authorization": "Bearer s3cret"}
        long_body = {**_body(0), "state": "word " * 600}  # a few decoder chunks: the queue fills behind it
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda _: httpx.post(url, json=long_body, headers=auth, timeout=300), range(6)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 429 in codes, codes  # Workers AI's "out of capacity", which the clients back off on
        assert all(r.headers.get("retry-after") == "1" for r in rs if r.status_code == 429)
        # SIGTERM while a request is in flight: it is answered, then the server exits 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: httpx.post(url, json=long_body, headers=auth, timeout=300))
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
            r = fut.result()
        assert r.status_code == 200 and r.json()["success"] is True
        s.proc.wait(timeout=120)  # it drains and exits by itself (a second signal would stop it now: exit 130)
    finally:
        code, err = s.stop()
    assert code == 0, err[-3000:]


def test_check_release_fails_when_the_host_encoder_drifts_by_a_token(shipped, tmp_path, monkeypatch):
    """check-release runs the project's encoder beside the author's on every request: shifted by one
    token id, it fails naming the request and the token; as shipped, it passes (the fixture)."""
    from dataclasses import replace

    import clef_flash.host.encode as enc

    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(_body(i)) + "\n" for i in range(2)))
    real = enc.encode

    def drifted(*a, **kw):
        e = real(*a, **kw)
        return replace(e, ids=e.ids[:7] + (e.ids[7] + 1,) + e.ids[8:])

    monkeypatch.setattr(enc, "encode", drifted)
    r = runner.invoke(app, ["check-release", str(shipped["release"]), "--bundle", str(shipped["bundles"]["decision-head"]),
                            "--requests", str(reqs)])
    assert r.exit_code == 4, r.output[-3000:]
    assert "r0 (line 1): the host's encoder differs from the author's at token 7: ours" in r.output
    assert "host encoder = author's" in r.output and "0/2 requests" in r.output


# ---------------------------------------------------------------- host-vectors.jsonl


def _relist(dist: Path, path: Path) -> None:
    import hashlib

    rel = path.relative_to(dist).as_posix()
    sums = dist / "SHA256SUMS"
    sums.write_text("".join(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}\n" if line.endswith(f"  {rel}") else line + "\n"
                            for line in sums.read_text().splitlines()))


def test_every_release_ships_host_vectors_and_this_host_passes_them(shipped):
    from clef_flash.release.card import model_card, read_dist

    path = shipped["dist"] / "host" / "host-vectors.jsonl"
    lines = _lines(path.read_text())
    assert lines[0]["kind"] == "clef-host-vectors" and all(t["reason"] for t in lines[0]["tolerances"].values())
    ids = [x["id"] for x in lines[1:]]
    assert ids == ["noul", "choice", "score", "mixed", "image"]
    assert {q["type"] for x in lines[1:] for q in x["encode"]["questions"]} == {0, 1, 2}
    assert lines[-1]["image"]["patches"]["sha256"] and lines[-1]["encode"]["image"]["tokens"] > 0
    assert "host/host-vectors.jsonl" in (shipped["dist"] / "SHA256SUMS").read_text()
    assert "host/host-vectors.jsonl" in model_card(read_dist(shipped["dist"]))
    r = runner.invoke(app, ["answer", str(shipped["dist"]), "--vectors"])
    assert r.exit_code == 0, r.output[-3000:]
    assert "host vectors agree: 5 requests, 32 steps" in r.output


def test_host_vectors_fail_a_drifted_host_and_an_edited_file_but_not_within_tolerance(shipped, tmp_path, monkeypatch):
    from dataclasses import replace

    import clef_flash.host.encode as enc

    dist = tmp_path / "dist"
    shutil.copytree(shipped["dist"], dist)
    path = dist / "host" / "host-vectors.jsonl"
    lines = _lines(path.read_text())

    def write(edit) -> None:
        new = json.loads(json.dumps(lines))
        edit(new)
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in new))
        _relist(dist, path)

    def bump(d: float):
        def edit(new):
            new[2]["probabilities"]["team"][0] += d
        return edit

    write(bump(0.01))  # within the file's own 0.02
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 0, r.output[-3000:]
    write(bump(0.05))
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 4 and "FAIL choice: probabilities: max |d p| 5.00e-02" in r.output, r.output[-3000:]

    def hidden(new):
        row = new[1]["decoder"]["rows"]["global"]
        row["first"][3] += 0.05 * row["max_abs"]
    write(hidden)
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 4 and "FAIL noul: hidden rows" in r.output, r.output[-3000:]

    def function(name):
        def edit(new):
            for line in new[1:]:
                if name is None:
                    del line["decoder"]["function"]  # a file written before the decoder's functions by context
                else:
                    line["decoder"]["function"] = name
        return edit
    write(function("main_ctx1024"))  # a host that would run the records in another decoder function
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 4 and "the decoder ran main, the file's main_ctx1024" in r.output, r.output[-3000:]
    write(function(None))
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 0, r.output[-3000:]
    write(lambda new: None)
    real = enc.encode
    import clef_flash.host.model as model

    monkeypatch.setattr(model, "encode", lambda *a, **kw: (lambda e: replace(e, ids=e.ids[:7] + (e.ids[7] + 1,) + e.ids[8:]))(real(*a, **kw)))
    r = runner.invoke(app, ["answer", str(dist), "--vectors"])
    assert r.exit_code == 4 and "FAIL mixed: token ids: first difference at token 7" in r.output, r.output[-3000:]


# ---------------------------------------------------------------- past the published head's pads (issue 59)


def test_the_host_runs_the_cheapest_head_that_fits(shipped):
    from clef_flash.host.dist import open_dist
    from clef_flash.host.model import ClefHost
    from clef_flash.host.requests import RequestError

    host = ClefHost(open_dist(shipped["dist"]))  # not entered: no asset is loaded to choose
    assert [(h.q_pad, h.o_pad, max(h.buckets)) for h in host.heads] == [(16, 128, 4096), (64, 512, 16384)]
    narrow, wide_ = (h.bundle.name for h in host.heads)
    assert (host.head_for(700, 3, 7).bundle, host.head_for(700, 3, 7).function) == (narrow, "t1024")
    assert (host.head_for(4096, 16, 128).bundle, host.head_for(4096, 16, 128).function) == (narrow, "t4096")
    assert (host.head_for(4097, 2, 4).bundle, host.head_for(4097, 2, 4).function) == (wide_, "t8192")
    assert (host.head_for(600, 17, 34).bundle, host.head_for(600, 17, 34).function) == (wide_, "t1024")
    assert host.head_for(600, 3, 129).bundle == wide_
    assert (host.head_for(16384, 64, 512).bundle, host.head_for(16384, 64, 512).function) == (wide_, "t16384")
    with pytest.raises(RequestError, match="no head of this release takes them"):
        host.head_for(16385, 2, 4)


def test_serve_refuses_past_the_widest_head_on_both_routes(served):
    import httpx

    past = {"model": "clef", "state": "x", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}
    for url in (served.url + "/v1/systemone", served.url + "/client/v4/accounts/a/ai/run/@cf/cloudflare/clef"):
        r = httpx.post(url, json=past, timeout=60)
        assert r.status_code == 422 and "65 questions; at most 64" in r.text, r.text[:300]
