"""`make bench-9b-run`: the synthetic 9B proven and answering on this machine (issue 61), in one run.

1. the synthetic 9B release (``synth-release --size 9b``, random bf16, 16 GB), written once into
   ``--release`` and pinned, reused when there;
2. ``release`` of the head and the int8 decoder (fp16 compute): both builds with their gates (the
   decoder's numeric check through the torch engine: two records of 512 tokens against the release's
   reference), the lm_head table and the host vectors through the engine that finishes; watched as a
   process tree (wall, peak anonymous + shared memory every 50 ms), its own stage lines kept;
3. ``answer`` of one request of about 1,000 tokens from that dist (the default engine: torch here),
   watched, its stage split;
4. ``serve``: seconds to ``ready``, one request answered, ``/health``'s engine, the peak memory.

Writes ``benchmarks/results/9b-run-latest.json``; every figure is against this run's own machine
(a GPU's figures come from the device run, docs/performance.md). About 80 GB of free disk.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_result import finish  # noqa: E402
from memwatch import watch  # noqa: E402

EXE = Path(sys.executable).parent / "clef-export"
HEAD = ROOT / "conversion" / "head_bucket_fp16w32.toml"
INT8 = ROOT / "conversion" / "backbone_pf64_int8.toml"
TARGETS = {"release_s": 25 * 60, "answer_s": 6 * 60, "peak_bytes": 1.5e9}


def watched(cmd: list[str], log: Path) -> dict:
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as errs:
        w = watch(cmd, 0.05, out, errs)
    err = log.with_suffix(".err").read_text(errors="replace")
    return {"rc": w["rc"], "wall": round(w["wall"], 1), "peak_anon_shmem_mib": round(w["peak_anon_shmem_mib"], 1),
            "peak_rss_mib": round(w["peak_rss_mib"], 1), "stdout": log.with_suffix(".out").read_text(errors="replace"),
            "stderr_tail": err[-6000:], "lines": [x for x in err.splitlines() if x.startswith(("·", "built", "verified", "released"))]}


def request(tokens: int) -> dict:
    """A request of about ``tokens`` tokens of state (the synthetic release's tokenizer: about one a character)."""
    words = " ".join(f"item{i} arrived late and the box was open" for i in range(tokens // 8))
    return {"id": "long", "model": "clef-flash", "state": words[: tokens],
            "questions": {"refund": {"type": "noul", "instructions": "Should we refund?"},
                          "team": {"type": "choice", "instructions": "Owning team?",
                                   "criteria": {"billing": "Charges.", "shipping": "Delivery.", "returns": None}}}}


def serve_once(dist: Path, body: dict, work: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import httpx

    log = open(work / "serve.err", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(EXE), "serve", str(dist), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    peak = 0.0
    out: dict = {}
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        out["ready_s"] = round(time.perf_counter() - t0, 1)
        out["health"] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        t1 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/accounts/local/ai/run/@cf/cloudflare/clef-flash", json=body, timeout=3600)
        out["request_s"] = round(time.perf_counter() - t1, 1)
        out["status"] = r.status_code
        out["usage"] = r.json().get("result", {}).get("usage")
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    finally:
        proc.send_signal(signal.SIGTERM)
        out["rc"] = proc.wait(timeout=600)
        log.close()
    out["peak_rss_mib"] = round(peak, 1)
    return out


SLICE_SCRIPT = """
import json, sys, time
import numpy as np
from pathlib import Path
from clef_flash.backbone.shipped import hidden_rows, read_backbone
bundle = Path(sys.argv[1])
m = json.loads((bundle / "metadata.json").read_text())
bb = read_backbone(bundle, m["language"]["hidden_size"])
rng = np.random.default_rng(0)
records = [rng.integers(0, m["language"]["vocab_size"], size=n) for n in (65, 150)]
out = {}
for engine in ("torch", "coreai"):
    t0 = time.perf_counter()
    out[engine] = hidden_rows(bb, records, engine=engine)
    out[engine + "_s"] = round(time.perf_counter() - t0, 1)
rel = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(out["torch"], out["coreai"])]
cos = [float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min()) for a, b in zip(out["torch"], out["coreai"])]
print(json.dumps({"tokens": [65, 150], "rel_max_abs_d": rel, "min_row_cosine": cos, "torch_s": out["torch_s"], "coreai_s": out["coreai_s"]}))
"""


def slice_check(slice_release: Path, work: Path) -> dict:
    """The int8w32 decoder of the real-width 4-layer slice: the torch engine against the runtime on two
    records (65 and 150 tokens), the held-to-the-runtime figure at real width."""
    out = work / "slice"
    b = watched([str(EXE), "build", str(ROOT / "conversion" / "backbone_pf64_int8w32.toml"), "--source", str(slice_release),
                 "--out", str(out), "--overwrite", "--no-verify", "--json"], work / "slice-build")
    if b["rc"] != 0:
        return {"build": b}
    bundle = out / json.loads(b["stdout"])["name"]
    w = watched([sys.executable, "-c", SLICE_SCRIPT, str(bundle)], work / "slice-engine")
    return {"build_s": b["wall"], "engine_vs_runtime": json.loads(w["stdout"].strip().splitlines()[-1]) if w["rc"] == 0 else None,
            "rc": w["rc"], "peak_anon_shmem_mib": w["peak_anon_shmem_mib"], "stderr_tail": w["stderr_tail"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--release", type=Path, default=ROOT / ".cache" / "synth-9b")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-9b-run")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--slice", type=Path, help="the pinned real-width slice: the engine against the runtime there first")
    ap.add_argument("--only-slice", action="store_true")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": {"cpus": __import__("os").cpu_count()}}
    failures: list[str] = []
    if a.slice is not None:
        print("slice: the torch engine against the runtime at real width", file=sys.stderr)
        result["slice"] = slice_check(a.slice, a.work)
        print(f"  {result['slice'].get('engine_vs_runtime')}", file=sys.stderr)
        if a.only_slice:
            finish(result, "9b-run-slice-latest.json", [] if result["slice"].get("rc") == 0 else ["slice check failed"])
            return
    if not (a.release / "pins.json").is_file():
        author = ROOT / ".cache" / "author" / "joint_schema_model.py"
        result["synth"] = watched([str(EXE), "synth-release", str(a.release), "--size", "9b", "--seed", "0",
                                   "--author-code", str(author), "--overwrite"], a.work / "synth")
        subprocess.run([str(EXE), "pin", str(a.release), "--name", "synth_9b", "--overwrite"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dist = a.work / "dist"
    print("release: head + int8 decoder + host vectors", file=sys.stderr)
    result["release"] = watched([str(EXE), "release", str(HEAD), str(INT8), "--source", str(a.release), "--dist", str(dist),
                                 "--overwrite"], a.work / "release")
    if result["release"]["rc"] != 0:
        finish(result, "9b-run-latest.json", ["release failed"])
    reqs = a.work / "long.jsonl"
    body = request(a.tokens)
    reqs.write_text(json.dumps(body) + "\n")
    print(f"answer: one request of about {a.tokens} tokens", file=sys.stderr)
    result["answer"] = watched([str(EXE), "answer", str(dist), "--requests", str(reqs)], a.work / "answer")
    print("serve: start-up, one request, /health", file=sys.stderr)
    result["serve"] = serve_once(dist, body, a.work)
    r, ans = result["release"], result["answer"]
    checks = [("release within 25 minutes", r["wall"] <= TARGETS["release_s"], r["wall"]),
              ("release peak anon+shmem within 1.5 GB", r["peak_anon_shmem_mib"] * 2**20 <= TARGETS["peak_bytes"], r["peak_anon_shmem_mib"]),
              ("answer of the long request within 6 minutes", ans["wall"] <= TARGETS["answer_s"], ans["wall"])]
    result["checks"] = [{"check": c, "ok": ok, "value": v} for c, ok, v in checks]
    for c, ok, v in checks:
        print(f"  {'pass' if ok else 'MISS'}  {c} ({v})", file=sys.stderr)
    finish(result, "9b-run-latest.json", failures)


if __name__ == "__main__":
    main()
