"""The export worker: a child process that loads the verified head, builds ``ClefHeadGraph`` and
has the recipe's backend convert and save it.

Why a process: its memory (torch, the converter, ~1 GB at the real size) goes back to the OS when
it ends, and a crash or a kill in native code cannot leave the parent half-done. Protocol: the
job is one JSON argument; progress lines ``LOG <text>`` and one ``ERROR <ClefError class> <message>``
on stderr; the timings as one JSON line on stdout. Errors come back as the same typed error.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .errors import ClefError, IntegrityError, NumericError, OutputError, ToolchainError, UsageError
from .recipe import Recipe

PARENT_ENV = "CLEF_EXPORT_PARENT_PID"
_ERRORS = {cls.__name__: cls for cls in (UsageError, IntegrityError, NumericError, ToolchainError, OutputError, ClefError)}


def run_export(source: Path, pins_path: Path, recipe: Recipe, asset_dir: Path,
               log: Callable[[str], None] = lambda msg: None, job: dict | None = None) -> dict:
    """Run the worker; returns its timings (``build``, ``export``, ``save`` seconds, ``hidden_size``).
    ``job`` replaces the head's job (the backbone's: ``model: backbone``). The converter's temporary
    resource files go beside the asset (``TMPDIR`` = a folder in the staged bundle, on the output's
    disk, removed when the worker ends and with the staged bundle on every exit path; never a tmpfs,
    where they would be shared memory)."""
    job = job or {"source": str(source), "pins": str(pins_path), "recipe": recipe.model_dump(mode="json"),
                  "asset_dir": str(asset_dir)}
    cmd = [sys.executable, "-m", "clef_flash.worker", json.dumps(job)]
    scratch = Path(asset_dir).parent / ".work"
    scratch.mkdir(exist_ok=True)
    try:
        return _run_worker(cmd, {**os.environ, "TMPDIR": str(scratch), PARENT_ENV: str(os.getpid())}, asset_dir, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]


def _main(job_text: str) -> int:
    import torch

    from . import contract
    from .author import load_head
    from .backends import backend
    from .graph import ClefHeadGraph, cast_weights
    from .pins import load_pins
    from .provenance import asset_description

    def log(msg: str) -> None:
        print(f"LOG {msg}", file=sys.stderr, flush=True)

    try:
        job = json.loads(job_text)
        if job.get("model") == "backbone":
            from .backbone.export import export_job

            try:
                result = export_job(job, log)
            except OSError as exc:
                raise OutputError(f"{job['asset_dir']}: cannot write the asset ({_root_cause(exc)})") from exc
            print(json.dumps(result))
            return 0
        recipe = Recipe.model_validate(job["recipe"])
        pins = load_pins(Path(job["pins"]))
        fmt = backend(recipe.format)
        fmt.import_toolchain()
        log("loading the author's head from verified bytes")
        t0 = time.perf_counter()
        dtype = torch.float16 if recipe.weights == "fp16w32" else torch.float32
        _module, config, head = load_head(Path(job["source"]), pins, dtype)
        head = cast_weights(head, recipe.weights)
        contract.check_contract(recipe.shape_contract, config.hidden_size)
        graph = ClefHeadGraph(head).eval()
        t_build = time.perf_counter() - t0
        asset_dir = Path(job["asset_dir"])
        t0 = time.perf_counter()
        try:
            program = fmt.convert(graph, recipe, config.hidden_size, asset_dir, log)
        except ClefError:
            raise
        except OSError as exc:
            raise OutputError(f"{asset_dir}: cannot write the asset ({_root_cause(exc)})") from exc
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolchainError(f"export of {recipe.name} failed: {type(exc).__name__}: {first}") from exc
        t_export = time.perf_counter() - t0
        del graph, head
        gc.collect()  # the weights go before the backend saves (save_asset clones the module)
        t0 = time.perf_counter()
        log(f"saving {asset_dir.name}")
        try:
            fmt.save(program, asset_dir, asset_description(pins), log)
        except ClefError:
            raise
        except (OSError, RuntimeError) as exc:  # the native writers report a full disk as RuntimeError
            raise OutputError(f"{asset_dir}: cannot write the asset ({_root_cause(exc)})") from exc
        except Exception as exc:
            raise ToolchainError(f"saving {asset_dir.name} failed: {type(exc).__name__}: {_root_cause(exc)}") from exc
        t_save = time.perf_counter() - t0
    except ClefError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(json.dumps({"build": t_build, "export": t_export, "save": t_save, "hidden_size": config.hidden_size}))
    return 0


def _die_with_parent() -> None:
    """The worker ends when the command that started it ends, a SIGKILL included (Linux:
    ``PR_SET_PDEATHSIG``), so a killed build leaves no worker writing into its staged folder (the
    next build of that bundle sweeps the folder) and its unlinked scratch file goes with it."""
    parent = os.environ.get(PARENT_ENV)
    if not sys.platform.startswith("linux") or not parent:
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent was gone before the call: end now
        os._exit(1)


if __name__ == "__main__":
    _die_with_parent()
    status = _main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is written and closed by now; skip tearing down torch, coreai and ~900 MB of
    # objects one by one (about 2 s), the OS takes the memory back at once
    os._exit(status)
