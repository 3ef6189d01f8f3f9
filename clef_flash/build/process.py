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

from ..formats.runtime_compile import failure
from ..errors import ClefError, IntegrityError, NumericError, OutputError, ToolchainError, UsageError
from ..progress import PLAIN_MARK as PROGRESS_MARK

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
    """``run_export`` with the plan's deferred shards hashed beside it: in a thread here
    (``engine.shard_hashes.BackgroundHashes``, stopped if the export fails), or, where the job has
    ``hash_shards``, by the worker, which returns them as ``shards`` (a compressed backbone: its
    process making codes ahead reads each shard once for both). A shard that fails its pin fails
    the build here, named. ``p.files`` becomes every checked digest in ``order`` (the plan's)."""
    import time

    from ..engine.shard_hashes import BackgroundHashes
    from ..sources.pinned_files import compare
    from ..progress import plural

    worker_hashes = bool(job.get("hash_shards"))
    hashes = BackgroundHashes(p.source, p.deferred) if p.deferred and not worker_hashes else None
    try:
        timings = run_export(asset_dir, job, log)
    except BaseException:
        if hashes is not None:
            hashes.stop()
        raise
    if p.deferred:
        t0 = time.perf_counter()
        got = timings.pop("shards", {}) if worker_hashes else hashes.digests()
        missing = [n for n in p.deferred if n not in got]
        if missing:  # the worker's protocol broke: nothing lands unchecked
            raise IntegrityError(f"{p.source / missing[0]}: not hashed by the export" +
                                 (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        compare(p.source, p.pins, got)
        found = {**p.files, **got}
        p.files = {n: found[n] for n in order}
        p.info["files"] = p.files
        log(f"{plural(len(p.deferred), 'shard')} matched their pins (hashed beside the export"
            + (" by its worker" if worker_hashes else "") + f"; {time.perf_counter() - t0:.1f} s waited)")
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
            elif line.startswith(PROGRESS_MARK):  # the worker's progress (a plain line every few seconds)
                log(line[len(PROGRESS_MARK):])
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
    if proc.wait() != 0:  # a full disk (its words, or a mapped write's SIGBUS) is the output's error
        raise failure(proc.returncode, "\n".join(other), asset_dir.parent, "the asset", "export worker")
    return json.loads(out.strip().splitlines()[-1])


def root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
