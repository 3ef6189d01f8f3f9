"""The README's walkthrough runs as written: every `clef-export` line of its walkthrough block, in
order, from a fresh folder that has a checkout's `conversion/` beside it (as a clone's root has),
the publish step against a loopback fake Hub. So the walkthrough cannot go stale: a renamed bundle,
a missing step (the head bundle it later uses) or a mismatched pair (the backbone checked and the
one released) fails here. The README also carries no figure that no test checks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

README = ROOT / "README.md"
CLIENT = re.compile(r"^(\w+=\S+ )+clef-eval run ")  # the ecosystem's evaluator, pointed at `serve`
BLOCK = re.compile(r"<!-- walkthrough: tests/test_readme.py runs it -->\n```[a-z]*\n(.*?)```", re.S)


def walkthrough() -> list[str]:
    blocks = BLOCK.findall(README.read_text(encoding="utf-8"))
    assert len(blocks) == 1, "the README has one walkthrough block"
    lines = [x.strip() for x in blocks[0].splitlines()]
    return [x for x in lines if x and not x.startswith("#")]


def test_the_walkthrough_is_all_clef_export_commands():
    cmds = walkthrough()
    assert len(cmds) >= 6 and all(c.startswith("clef-export ") or CLIENT.match(c) for c in cmds), cmds
    # the steps the issue found missing or mismatched
    joined = "\n".join(cmds)
    assert "build --source" in joined and "check-release" in joined and "release " in joined and "publish " in joined
    checked = re.search(r"check-release .*--backbone build/\S+_decode_(\w+)_pf64\b", joined).group(1)
    released = re.search(r"clef-export release .*conversion/backbone_pf64_(\w+)\.toml", joined).group(1)
    assert checked == released, f"check-release checks the {checked} backbone, release ships the {released} one"


def _wait_ready(port: str, proc) -> None:
    import time
    import urllib.request

    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, "serve exited before it was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("serve was not ready in 300 s")


def test_the_readme_walkthrough_runs_as_written(tmp_path, author_code):
    from .fakehub import FakeHubRepos

    work = tmp_path / "work"
    work.mkdir()
    (work / "conversion").symlink_to(ROOT / "conversion")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               CLEF_AUTHOR_CODE=str(Path(author_code).resolve()), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_fake_token")
    with FakeHubRepos() as hub:
        env["HF_ENDPOINT"] = hub.endpoint
        background = []
        try:
            for cmd in walkthrough():
                if cmd.endswith(" &"):  # `serve`: started, then waited for as its ready line says
                    background.append(subprocess.Popen(["bash", "-c", f"exec {cmd[:-2]}"], cwd=work, env=env,
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    _wait_ready(re.search(r"--port (\d+)", cmd).group(1), background[-1])
                    continue
                r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
                assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
                if "clef-eval run" in cmd:
                    assert "gate: PASSED" in r.stdout, r.stdout[-2000:]
        finally:
            for p in background:
                p.send_signal(15)
                assert p.wait(timeout=120) == 0, "serve drains and exits 0 on SIGTERM"
        repo = re.search(r"publish \S+ --repo (\S+)", "\n".join(walkthrough())).group(1)
        record = json.loads((work / "dist" / "publish-record.json").read_text())
        assert record["commit"] == hub.commits(repo)[-1]
        card = hub.files(repo, record["commit"])["README.md"].decode()  # the two heads, and the order a host tries them in
        assert "Several heads: a request runs in the first of `my_ft_head_bucket_fp16w32`, `my_ft_head_wide_fp16w32`" in card
    assert (work / "check.json").is_file() and json.loads((work / "check.json").read_text())["summary"]["ok"]
    answers = [json.loads(x) for x in (work / "answers.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["refund", "route", "triage"] and all("answers" in a for a in answers)
    on_torch = [json.loads(x) for x in (work / "answers-torch.jsonl").read_text().splitlines()]
    for a, b in zip(answers, on_torch, strict=True):  # the torch engine: the same answers to the 4 digits shown
        assert a["usage"] == b["usage"] and {q: v.get("choice") for q, v in a["answers"].items()} == \
            {q: v.get("choice") for q, v in b["answers"].items()}
        assert all(abs(v[k] - b["answers"][q][k]) <= 1e-4 + 1e-12 for q, v in a["answers"].items()
                   for k in ("noul", "score", "confidence") if k in v)


def test_the_readme_states_no_unchecked_counts():
    """Figures that drift (test counts, wheel sizes, minutes) live in docs/ with their date, not on
    the landing page."""
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"\b\d+ tests\b|\b[\d,]+ bytes\b|\b\d+ KB\b", text), "a figure no test checks"
