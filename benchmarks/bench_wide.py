"""What the wide shapes cost a request (issue 59), in-process (``ClefHost``, each asset loaded once),
per stage (encode / vision / decoder / head / host), median of ``--repeat``:

1. a 16-question / 2,000-token request on each ``--dist`` given (``make bench-wide``: the published
   head alone with the decoder at 4,096 tokens; both heads with it; both heads with the decoder at
   16,384 and no shorter function; the README walkthrough's dist, whose decoder has a 4,096-slot
   function beside its 16,384): what the wide head being there costs a request that fits the
   published one, what a longer context costs every chunk, and what the shorter function saves;
2. a 64-question / about 9,000-token request on the last dist (it needs the wide head), its time
   split by stage.

Writes ``benchmarks/results/wide-<name>.json``."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_result import finish  # noqa: E402


def body(questions: int, tokens: int, tokenizer) -> dict:
    """``questions`` three-level scores over a state grown until the prompt is ``tokens`` long."""
    from clef_flash.host.encode import encode

    qs = {f"q{i:02d}": {"type": "score", "instructions": f"How bad is issue {i}?", "criteria": ["low", "mid", "high"]}
          for i in range(questions)}
    b = {"model": "clef-flash", "state": "", "questions": qs}
    fixed = len(encode(tokenizer, b).ids)
    b["state"] = "x" * max(0, tokens - fixed)  # the tiny tokenizers spend a token on each x or fewer
    while len(encode(tokenizer, b).ids) < tokens:
        b["state"] += " x" * (tokens - len(encode(tokenizer, b).ids))
    return b


async def timed(dist_path: Path, dist, bodies: list[dict], repeat: int) -> list[dict]:
    from clef_flash.host.model import ClefHost

    rows = []
    async with ClefHost(dist) as host:
        for b in bodies:
            runs = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                a = await host.answer(b)
                runs.append({**a.seconds, "total": time.perf_counter() - t0})
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"dist": dist_path.name if dist_path.name != "dist" else str(dist_path), "questions": len(b["questions"]),
                         "tokens": len(a.encoded.ids), "head": a.head, "function": a.bucket, "decoder": a.decoder,
                         "median_s": med, "repeat": repeat})
            print(f"{dist_path}: {len(b['questions'])} questions, {len(a.encoded.ids)} tokens -> {a.decoder}, {a.head} {a.bucket}: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()), file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dist", type=Path, nargs="+", required=True)
    ap.add_argument("--name", default="tiny")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from clef_flash.host.dist import open_dist
    from clef_flash.host.encode import PromptTokenizer

    rows = []
    for d in args.dist:
        dist = open_dist(d)  # outside the event loop: it runs one of its own
        tok = PromptTokenizer(dist.tokenizer)
        rows += asyncio.run(timed(d, dist, [body(16, 2000, tok)], args.repeat))
    rows += asyncio.run(timed(d, dist, [body(64, 9000, tok)], max(1, args.repeat // 2)))
    finish({"name": args.name, "rows": rows}, f"wide-{args.name}.json", [])


if __name__ == "__main__":
    main()
