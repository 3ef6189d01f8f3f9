"""The export worker: the child process that runs one model's ``export_job`` (``JOBS``, by the
job's ``model``) and reports in the protocol ``process`` reads. It dies with its parent."""

from __future__ import annotations

import json
import os
import sys

from ..errors import ClefError, OutputError
from . import backbone, head, plan_weights, vision
from ..interrupts import die_with_parent
from .process import PARENT_ENV, root_cause

JOBS = {m.MODEL: m.export_job for m in (head, backbone, vision)}
JOBS[plan_weights.PLAN_JOB] = plan_weights.plan_job  # a build's fp16_layers = "auto"


def _main(job_text: str) -> int:
    def log(msg: str) -> None:
        print(f"LOG {msg}", file=sys.stderr, flush=True)

    try:
        job = json.loads(job_text)
        try:
            result = JOBS[job["model"]](job, log)
        except OSError as exc:
            raise OutputError(f"{job['asset_dir']}: cannot write the asset ({root_cause(exc)})") from exc
    except ClefError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130  # the parent was interrupted too (same process group): it reports, in one line
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    import signal

    # Ctrl-C reaches the whole process group: the parent reports it once and kills this worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the worker ends when the command that started it ends, a SIGKILL included: a killed build leaves
    # no worker writing into its staged folder, and its unlinked scratch file goes with it
    die_with_parent(PARENT_ENV)
    status = _main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is written and closed by now; skip tearing down torch, coreai and ~900 MB of
    # objects one by one (about 2 s), the OS takes the memory back at once
    os._exit(status)
