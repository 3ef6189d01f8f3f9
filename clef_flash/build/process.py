"""The parent side of the export worker: start it, relay its progress, map its errors.

Why a process: its memory (torch, the converter, ~1 GB at the real size) goes back to the OS when
it ends, and a crash or a kill in native code cannot leave the parent half-done. Protocol: the
job is one JSON argument (its ``model`` picks the model's ``export_job`` in ``worker``); progress
lines ``LOG <text>`` and one ``ERROR <ClefError class> <message>`` on stderr; the timings as one
JSON line on stdout. Errors come back as the same typed error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from ..errors import ClefError, IntegrityError, NumericError, OutputError, ToolchainError, UsageError

PARENT_ENV = "CLEF_EXPORT_PARENT_PID"
_ERRORS = {cls.__name__: cls for cls in (UsageError, IntegrityError, NumericError, ToolchainError, OutputError, ClefError)}


def run_export(asset_dir: Path, job: dict, log: Callable[[str], None] = lambda msg: None) -> dict:
    """Run the worker on ``job`` (its ``model`` picks the model's ``export_job``); returns the job's
    timings. The converter's temporary resource files go beside the asset (``TMPDIR`` = a folder in
    the staged bundle, on the output's disk, removed when the worker ends and with the staged bundle
    on every exit path; never a tmpfs, where they would be shared memory)."""
    cmd = [sys.executable, "-m", "clef_flash.build.worker", json.dumps(job)]
    scratch = Path(asset_dir).parent / ".work"
    scratch.mkdir(exist_ok=True)
    try:
        return _run_worker(cmd, {**os.environ, "TMPDIR": str(scratch), PARENT_ENV: str(os.getpid())}, asset_dir, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_export_hashing(p, asset_dir: Path, job: dict, order: list[str], log: Callable[[str], None] = lambda msg: None) -> dict:
    """``run_export`` with the plan's deferred shards hashed beside it (``backbone.files.BackgroundHashes``,
    stopped if the export fails); a shard that fails its pin fails the build here, named. ``p.files``
    becomes every checked digest in ``order`` (the plan's)."""
    import time

    from ..backbone.files import BackgroundHashes
    from ..progress import plural

    hashes = BackgroundHashes(p.source, p.pins, p.deferred) if p.deferred else None
    try:
        timings = run_export(asset_dir, job, log)
    except BaseException:
        if hashes is not None:
            hashes.stop()
        raise
    if hashes is not None:
        t0 = time.perf_counter()
        found = {**p.files, **hashes.result()}
        p.files = {n: found[n] for n in order}
        p.info["files"] = p.files
        log(f"{plural(len(p.deferred), 'shard')} matched their pins (hashed beside the export; "
            f"{time.perf_counter() - t0:.1f} s waited)")
    return timings


def _run_worker(cmd: list[str], env: dict[str, str], asset_dir: Path, log: Callable[[str], None]) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    other: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip()
            if line.startswith("LOG "):
                log(line[4:])
            elif line.strip() and not line.startswith("ODIE"):
                other = (other + [line])[-3:]
            if line.startswith("ERROR "):
                kind, _, msg = line[6:].partition(" ")
                proc.wait()
                raise _ERRORS.get(kind, ToolchainError)(msg)
        out = proc.stdout.read() if proc.stdout else ""
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.wait() != 0:
        last = other[-1] if other else "no message"
        for cause in ("No space left on device", "Read-only file system"):
            if cause in last:
                raise OutputError(f"{asset_dir.parent}: cannot write the asset ({cause})")
        raise ToolchainError(f"export worker exited with status {proc.returncode}: {last}")
    return json.loads(out.strip().splitlines()[-1])


def root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
