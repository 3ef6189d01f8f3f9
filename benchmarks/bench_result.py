"""The end every bench shares: its results written to ``benchmarks/results/NAME``, a summary on
stdout (the long lists left out), each failure on stderr, exit 1 when there is one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG = ("stderr_tail", "layers", "trials")


def finish(result: dict, name: str, failures: list[str]) -> None:
    out = ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in LONG} if isinstance(v, dict) else v
                      for k, v in result.items()}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    failures = [f"{k}: exit {v['rc']}" for k, v in result.items() if isinstance(v, dict) and v.get("rc")] + failures
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    if failures:
        sys.exit(1)
