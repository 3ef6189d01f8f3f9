"""Peak memory of a command and every process it starts, sampled from /proc.

    python benchmarks/memwatch.py [--interval S] -- CMD ...

Every ``interval`` seconds the process tree under the command is walked and each process's
``RssAnon`` + ``RssShmem`` (anonymous and shared memory: what the build itself holds) and
``VmRSS`` (that plus the pages of memory-mapped files, page cache the kernel can drop) are summed.
Prints one JSON line on stderr-free stdout: wall seconds, exit code, peak anonymous+shared MiB,
peak total RSS MiB, processes seen. The command's own stdout is written to ``--stdout FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssShmem", "VmRSS"):
                out[key] = int(rest.split()[0])  # kB
    except (OSError, ValueError, IndexError):
        pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            raw = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            kids.extend(int(x) for x in raw)
    except OSError:
        pass
    return kids


def tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(_children(pid))
    return seen


def watch(cmd: list[str], interval: float = 0.05, stdout=None, stderr=None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout or subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL)
    peak_anon = peak_rss = 0
    per_process: dict[int, int] = {}  # pid -> its own peak anonymous + shared kB
    while proc.poll() is None:
        anon = rss = 0
        for pid in tree(proc.pid):
            st = _status(pid)
            if st:
                mine = st.get("RssAnon", 0) + st.get("RssShmem", 0)
                per_process[pid] = max(per_process.get(pid, 0), mine)
                anon += mine
                rss += st.get("VmRSS", 0)
        peak_anon, peak_rss = max(peak_anon, anon), max(peak_rss, rss)
        time.sleep(interval)
    return {"wall": time.perf_counter() - t0, "rc": proc.returncode, "peak_anon_shmem_mib": peak_anon / 1024,
            "peak_rss_mib": peak_rss / 1024, "processes": len(per_process),
            "per_process_peak_mib": sorted((round(v / 1024, 1) for v in per_process.values()), reverse=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--stdout", type=Path)
    ap.add_argument("--stderr", type=Path, help="the command's progress lines (default: discarded)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    with open(a.stdout or os.devnull, "wb") as out, open(a.stderr or os.devnull, "wb") as err:
        print(json.dumps(watch(cmd, a.interval, out, err)))
    sys.exit(0)


if __name__ == "__main__":
    main()
