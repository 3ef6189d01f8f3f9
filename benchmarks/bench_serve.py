"""`make bench-serve`: running what was shipped (issue 46), on a release's dist/.

1. ``answer``'s time per request, split into encode / vision / decoder / head / host (the host
   in-process, each asset loaded once), over the project's request sets (text and image);
2. ``serve`` started: seconds to ready, memory held (the server's process tree, anonymous + shared);
3. the server's overhead over ``answer``: the same bodies one at a time over HTTP, each latency
   against that body's in-process time (target <= 5 % or <= 20 ms, whichever is larger);
4. ``--clients`` concurrent clef-evals async clients x ``--per-client`` requests over a few distinct
   bodies: every response equal to ``answer``'s for its body (none lost, duplicated or mixed up),
   p50 / p95 latency, requests per second;
5. memory over ``--soak`` requests: the server's memory after the first 10 % and at the end
   (target growth <= 5 %).

Writes ``benchmarks/results/serve-<name>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from memwatch import _status, tree  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"


def held_mib(pid: int) -> float:
    return sum(s.get("RssAnon", 0) + s.get("RssShmem", 0) for s in map(_status, tree(pid))) / 1024


def bodies_of(files: list[Path]) -> list[tuple[dict, Path]]:
    out = []
    for f in files:
        out += [(json.loads(x), f.parent) for x in f.read_text().splitlines() if x.strip()]
    return out


async def in_process(dist, bodies):
    from clef_flash.host.model import ClefHost
    from clef_flash.host.requests import RequestError

    rows = []
    async with ClefHost(dist) as host:
        for body, base in bodies:
            t0 = time.perf_counter()
            try:
                a = await host.answer(body, base)
            except RequestError:
                continue
            rows.append({"id": body.get("id"), "tokens": len(a.encoded.ids), "image": a.encoded.image is not None,
                         "seconds": {**a.seconds, "total": time.perf_counter() - t0}, "response": a.response})
    return rows


def inline(body: dict, base: Path) -> dict:
    """A body with its image file as {content_type, base64} (what a client sends)."""
    import base64

    if not body.get("images"):
        return body
    data = (base / body["images"][0]).read_bytes()
    return {**body, "images": [{"content_type": "image/png", "base64": base64.b64encode(data).decode()}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(dist: Path, port: int) -> tuple[subprocess.Popen, float]:
    import httpx

    t0 = time.perf_counter()
    log = ROOT / "benchmarks" / "results" / "serve.log"  # its per-request lines: a pipe nobody reads would fill and stop it
    log.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([str(EXE), "serve", str(dist), "--port", str(port), "--queue", "4096"],
                         stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)
    while True:
        if p.poll() is not None:
            raise SystemExit(log.read_text()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return p, time.perf_counter() - t0
        except httpx.HTTPError:
            time.sleep(0.05)


def questions_of(body: dict):
    from clef_evals.models import Choice, Noul, Score

    out = {}
    for qid, q in body["questions"].items():
        if q["type"] == "noul":
            c = q.get("criteria") or {}
            out[qid] = Noul(instructions=q.get("instructions", ""), criteria_true=c.get("true"), criteria_false=c.get("false"))
        elif q["type"] == "choice":
            out[qid] = Choice(instructions=q.get("instructions", ""), criteria=q["criteria"])
        else:
            out[qid] = Score(instructions=q.get("instructions", ""), criteria=q["criteria"])
    return out


async def concurrent(url: str, bodies: list[dict], expected: list[dict], clients: int, per_client: int) -> dict:
    import httpx
    from clef_evals.client import ClefClient
    from clef_evals.config import ClefConfig

    cfg = ClefConfig.from_env({"CLEF_BASE_URL": url + "/client/v4", "CLEF_ACCOUNT_ID": "bench", "CLEF_API_TOKEN": "bench",
                               "CLEF_MODEL": "@cf/cloudflare/clef-flash", "CLEF_MAX_RETRIES": "0", "CLEF_TIMEOUT": "600"})
    latencies, wrong, seen = [], [], 0

    async def one_client(c: int) -> None:
        nonlocal seen
        async with ClefClient(cfg, async_http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1))) as client:
            for k in range(per_client):
                i = (c * per_client + k) % len(bodies)
                b = bodies[i]
                r = await client.arun(b["state"], questions_of(b), images=b.get("images"))
                latencies.append(r.latency_ms)
                seen += 1
                want = expected[i]["answers"]
                got = {q: a for q, a in r.answers.items()}
                for qid, w in want.items():
                    a = got[qid]
                    ok = (a.probability == w["noul"]) if w["type"] == "noul" else \
                        (a.choice == w["choice"] and a.probabilities == w["probabilities"]) if w["type"] == "choice" else \
                        (a.score == w["score"])
                    if not ok:
                        wrong.append((c, k, qid))

    t0 = time.perf_counter()
    await asyncio.gather(*[one_client(c) for c in range(clients)])
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"clients": clients, "per_client": per_client, "answered": seen, "wrong": len(wrong), "wall_s": wall,
            "requests_per_s": seen / wall, "p50_ms": latencies[len(latencies) // 2],
            "p95_ms": latencies[int(len(latencies) * 0.95) - 1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dist", type=Path, required=True)
    ap.add_argument("--name", default="tiny")
    ap.add_argument("--requests", type=Path, nargs="*", default=[ROOT / "conversion" / "requests.jsonl",
                                                                   ROOT / "conversion" / "requests-images.jsonl"])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=50)
    ap.add_argument("--soak", type=int, default=1000)
    ap.add_argument("--distinct", type=int, default=8, help="distinct bodies the clients cycle over")
    args = ap.parse_args()
    import httpx

    from clef_flash.host.dist import open_dist

    dist = open_dist(args.dist)
    bodies = bodies_of(args.requests)
    rows = asyncio.run(in_process(dist, bodies))
    split = {k: statistics.median(r["seconds"][k] for r in rows) for k in rows[0]["seconds"]}
    print(f"answer, {len(rows)} requests: median per request " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in split.items()),
          file=sys.stderr)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, ready = start(args.dist, port)
    result = {"dist": str(args.dist), "name": args.name, "answer": {"requests": len(rows), "median_s": split, "rows": rows},
              "serve": {"ready_s": ready, "held_mib_ready": held_mib(proc.pid)}}
    try:
        by_id = {b.get("id"): (b, base) for b, base in bodies}
        over = []
        with httpx.Client(timeout=600) as client:
            for r in rows:
                body, base = by_id[r["id"]]
                t0 = time.perf_counter()
                res = client.post(url + "/client/v4/accounts/bench/ai/run/@cf/cloudflare/clef-flash", json=inline(body, base))
                dt = time.perf_counter() - t0
                assert res.status_code == 200 and res.json()["result"]["answers"] == r["response"]["answers"], r["id"]
                over.append({"id": r["id"], "http_s": dt, "answer_s": r["seconds"]["total"], "overhead_s": dt - r["seconds"]["total"]})
        med = statistics.median(o["overhead_s"] for o in over)
        rel = statistics.median(o["overhead_s"] / o["answer_s"] for o in over)
        result["overhead"] = {"median_s": med, "median_rel": rel, "rows": over,
                              "target": "<= 5 % or <= 20 ms, whichever is larger",
                              "met": med <= max(0.02, 0.05 * statistics.median(o["answer_s"] for o in over))}
        print(f"serve overhead over answer: median {med * 1000:.1f} ms ({rel * 100:.1f} %)", file=sys.stderr)
        text = [(b, base) for b, base in bodies if not b.get("images")]
        fitted = {r["id"] for r in rows}
        distinct = [inline(b, base) for b, base in bodies if b.get("id") in fitted][: args.distinct]
        expected = [next(r["response"] for r in rows if r["id"] == b.get("id")) for b in distinct]
        conc = asyncio.run(concurrent(url, distinct, expected, args.clients, args.per_client))
        result["concurrent"] = conc
        print(f"{args.clients} clients x {args.per_client}: {conc['answered']} answered, {conc['wrong']} wrong, "
              f"p50 {conc['p50_ms']:.0f} ms, p95 {conc['p95_ms']:.0f} ms, {conc['requests_per_s']:.2f} req/s", file=sys.stderr)
        soak_body = inline(*text[0]) if text else distinct[0]
        marks = {}
        with httpx.Client(timeout=600) as client:
            for n in range(1, args.soak + 1):
                res = client.post(url + "/accounts/bench/ai/run/@cf/cloudflare/clef", json={**soak_body, "state": f"{soak_body['state']} #{n}"})
                assert res.status_code == 200
                if n % max(1, args.soak // 10) == 0:
                    marks[n] = held_mib(proc.pid)
        first, last = marks[max(1, args.soak // 10)], marks[args.soak]
        result["soak"] = {"requests": args.soak, "held_mib": marks, "growth": (last - first) / first, "target": "<= 5 %",
                          "kib_per_request": (last - first) * 1024 / (args.soak - max(1, args.soak // 10))}
        print(f"memory over {args.soak} requests: {first:.0f} -> {last:.0f} MiB ({(last - first) / first * 100:+.1f} %)",
              file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGTERM)
        result["serve"]["exit"] = proc.wait(timeout=120)
        out = ROOT / "benchmarks" / "results" / f"serve-{args.name}.json"  # what was measured, even after a failure
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
