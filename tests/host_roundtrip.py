"""``make check``'s host step: the release's dist/ answers the project's request sets through
``answer`` and through ``serve`` (spoken to by clef-evals' own ClefClient), the two equal, and each
answer within check-release's bar of the author's (its transcript's reference answers).

    python -m tests.host_roundtrip DIST --check TRANSCRIPT.json [--check ...]

Exits non-zero at the first difference, naming the request and the field."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXE = str(Path(sys.executable).parent / "clef-export")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a: dict, b: dict, bar: float, where: str) -> None:
    for qid, want in a.items():
        got = b[qid]
        assert got["type"] == want["type"] and got.get("choice") == want.get("choice"), f"{where} {qid}: {got} vs {want}"
        for k in ("noul", "score", "confidence"):
            if k in want:
                assert abs(got[k] - want[k]) <= bar + 1e-4, f"{where} {qid}.{k}: {got[k]} vs {want[k]} (bar {bar})"


def main(argv: list[str]) -> int:
    import base64

    import httpx
    from clef_evals.client import ClefClient
    from clef_evals.config import ClefConfig

    dist = Path(argv[0])
    checks = [Path(argv[i + 1]) for i, a in enumerate(argv) if a == "--check"]
    port = _port()
    serve = subprocess.Popen([EXE, "serve", str(dist), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=None)  # its lines to ours
    try:
        deadline = time.time() + 300
        while True:
            assert serve.poll() is None and time.time() < deadline, "serve did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        env = {"CLEF_BASE_URL": f"http://127.0.0.1:{port}/client/v4", "CLEF_ACCOUNT_ID": "local", "CLEF_API_TOKEN": "local",
               "CLEF_MODEL": "@cf/cloudflare/clef-flash", "CLEF_MAX_RETRIES": "0", "CLEF_TIMEOUT": "600"}
        client = ClefClient(ClefConfig.from_env(env))
        total = 0
        for check in checks:
            t = json.loads(check.read_text())
            requests = Path(t["requests_file"])
            r = subprocess.run([EXE, "answer", str(dist), "--requests", str(requests)], capture_output=True, text=True)
            answered = {x["line"]: x for x in map(json.loads, r.stdout.splitlines())}
            fitted = [e for e in t["requests"] if "function" in e]
            assert r.returncode == (0 if len(fitted) == len(t["requests"]) else 4), r.stderr[-2000:]
            bodies = {n: json.loads(x) for n, x in enumerate(requests.read_text().splitlines(), 1) if x.strip()}
            for e in fitted:
                mine = answered[e["line"]]
                _close(e["reference"]["answers"], mine["answers"], t["bar"]["max_abs_dp"], f"{check.name} {e['id']} answer")
                body = bodies[e["line"]]
                images = None
                if body.get("images"):
                    data = (requests.parent / body["images"][0]).read_bytes()
                    images = [{"content_type": "image/png", "base64": base64.b64encode(data).decode()}]
                res = client._run_once({**body, "images": images} if images else body)  # the client's own POST and parser
                for qid, want in mine["answers"].items():
                    got = res.answers[qid]
                    same = (got.probability == want["noul"]) if want["type"] == "noul" else \
                        (got.choice == want["choice"] and got.probabilities == want["probabilities"]) if want["type"] == "choice" else \
                        (got.score == want["score"])
                    assert same, f"{check.name} {e['id']} {qid}: serve {got} vs answer {want}"
                assert res.usage.input_tokens == mine["usage"]["input_tokens"] == e["reference"]["usage"]["input_tokens"]
                total += 1
            print(f"{check.name}: {len(fitted)} requests answered by `answer` and `serve` alike, within {t['bar']['max_abs_dp']:g} "
                  f"of the author's", file=sys.stderr)
        assert total > 0, "nothing compared"
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0, f"serve exited {code} on SIGTERM"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
