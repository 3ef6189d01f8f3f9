"""``main.mlirb`` of the streamed route, byte for byte against the converter's own route, at a slice.

The streamed route (what ``build`` runs) hands the converter the small tensors' mapped fp16 arrays
as resources and each large one as a placeholder (``export.constants_from_buffers``), then writes
``main.mlirb`` once with every large tensor converted from the release into its place
(``mlirb.inflate``); the converter's own route converts every tensor first and lets the converter
copy every constant the way it does for a model whose weights sit in memory. Same graph, same weights: the two
``main.mlirb`` files must be byte-identical. Each route runs in its own process (``memwatch``
samples its peak anonymous + shared memory).

    python benchmarks/bench_identity.py --slice .cache/slice-9b-4 [--compute fp16] [--work build]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(source: Path, out: Path, compute: str, buffers: bool) -> dict:
    from clef_flash.backbone.export import export_job
    from clef_flash.backbone.source import release_config
    from clef_flash.digest import sha256_file

    text = release_config(source)
    job = {"model": "backbone", "source": str(source), "asset_dir": str(out / "main.aimodel"),
           "text_config": text.as_dict(), "chunk": 64, "context": 4096, "compute": compute, "buffers": buffers,
           "description": {"author": "bench", "license": "bench", "description": "identity bench"}}
    timings = export_job(job, lambda m: print(f"· {m}", file=sys.stderr, flush=True))
    mlirb = out / "main.aimodel" / "main.mlirb"
    return {"buffers": buffers, "sha256": sha256_file(mlirb), "bytes": mlirb.stat().st_size, **timings}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slice", type=Path, required=True)
    ap.add_argument("--compute", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--work", type=Path, default=ROOT / "build")
    ap.add_argument("--one", choices=["buffers", "own"])  # internal: run one route in this process
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.slice, a.out, a.compute, a.one == "buffers")))
        return 0
    rows = []
    a.work.mkdir(parents=True, exist_ok=True)
    for route in ("buffers", "own"):
        with tempfile.TemporaryDirectory(dir=a.work, prefix=f".identity-{route}-") as tmp:
            cmd = [sys.executable, str(ROOT / "benchmarks" / "memwatch.py"), "--stdout", str(Path(tmp) / "out.json"), "--",
                   sys.executable, __file__, "--slice", str(a.slice), "--compute", a.compute, "--one", route, "--out", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return r.returncode
            rows.append({"route": route, **json.loads((Path(tmp) / "out.json").read_text()), "memwatch": r.stdout.strip()})
            print(f"{route}: {rows[-1]['sha256']} {rows[-1]['bytes']:,} bytes; {r.stdout.strip()}", file=sys.stderr)
    same = rows[0]["sha256"] == rows[1]["sha256"]
    print(json.dumps({"identical": same, "rows": rows}, indent=2))
    return 0 if same else 4


if __name__ == "__main__":
    sys.exit(main())
