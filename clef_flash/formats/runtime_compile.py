"""The Core AI runtime's load of an asset, its compile made by a child process.

On Linux the runtime first compiles the asset into a folder (a compiled fp32 copy of the weights,
written through a memory map), then loads that folder. A memory-mapped write that finds the disk
full is a SIGBUS, which no Python handler can turn into an error: in the command's own process it
killed the build (exit -7, no message, its staged folder and lock left). So the compile runs in a
child (``python -m clef_flash.formats.runtime_compile ASSET FOLDER``); its death by SIGBUS on a full
disk, or its own "No space left", is an ``OutputError`` naming the folder, the command unwinds and
nothing lands. The compile's memory goes back to the OS with the child, and Ctrl-C stops it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import OutputError, ToolchainError

PARENT_ENV = "CLEF_EXPORT_RUNTIME_PARENT_PID"
# the OS's words, and the converter's own for a full disk
DISK_WORDS = (("No space left on device", "No space left on device"), ("Read-only file system", "Read-only file system"),
              ("enough space", "No space left on device"))
# a disk with less than this free when a mapped write died is taken as full: the write that failed
# wanted a page, and another process may free a little meanwhile
FULL_BELOW = 64 << 20
_POLL_S = 0.05  # how often the wait looks for Ctrl-C


def _compiles_here() -> bool:
    """Whether ``executable()`` compiles into a folder first (Linux, or macOS without the OS's runtime)."""
    from coreai.authoring import asset as authoring

    return sys.platform != "darwin" or not authoring._use_os_coreai  # noqa: SLF001 (the asset's own test)


@contextlib.asynccontextmanager
async def executable(asset: Path, scratch: Path | None = None):
    """The loaded ``AIModel`` of ``asset``, as ``AIModelAsset.executable()`` gives it, compiled by a
    child into a folder of this process's own under ``scratch`` (default: the temp folder)."""
    from coreai.authoring.asset import AIModelAsset

    from ..tmpdirs import owned_tempdir

    with owned_tempdir(scratch) as folder:
        if not _compiles_here():
            async with AIModelAsset.load(Path(asset)).executable() as model:
                yield model
            return
        from coreai.runtime import AIModel

        compiled = folder / "model.aimodelx"
        compiled.mkdir()
        await compile_in_child(Path(asset), compiled)
        yield await AIModel.load(path=str(compiled), specialization_options=None)


async def compile_in_child(asset: Path, out: Path) -> None:
    """``out`` filled with the runtime's compiled form of ``asset`` by a child process; its failure
    mapped: a full disk -> ``OutputError`` naming ``out``'s folder, anything else -> ``ToolchainError``.
    A signal (``interrupts``) kills the child and raises ``Interrupted``."""
    from ..interrupts import Interrupted, interrupted

    env = {**os.environ, "TMPDIR": str(out.parent), PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-m", __name__, str(asset), str(out)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait = asyncio.ensure_future(asyncio.to_thread(proc.communicate))
    try:
        while not wait.done():
            if interrupted():
                raise Interrupted()
            await asyncio.wait({wait}, timeout=_POLL_S)
        _, err = wait.result()
    except BaseException:
        proc.kill()
        await asyncio.wait({wait})
        raise
    if proc.returncode != 0:
        raise failure(proc.returncode, err or "", out.parent.parent)


def failure(returncode: int, stderr: str, folder: Path, what: str = "the runtime's compiled copy",
            who: str = "the Core AI compile") -> OutputError | ToolchainError:
    """What a child's non-zero exit means for the command (this compile's, or the export worker's):
    a full disk or a read-only one -> ``OutputError`` naming ``folder``, anything else the toolchain's."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    ours = [ln[len("ERROR "):] for ln in lines if ln.startswith("ERROR ")]
    last = ours[-1] if ours else lines[-1] if lines else "no message"
    for words, said in DISK_WORDS:
        if words in last:
            return OutputError(f"{folder}: cannot write {what} ({said})")
    if returncode == -signal.SIGBUS:
        free = _free_bytes(folder)
        if free is not None and free < FULL_BELOW:
            return OutputError(f"{folder}: cannot write {what} (No space left on device: {free:,} bytes free "
                               "when a mapped write failed)")
        return ToolchainError(f"{who} died of SIGBUS, {free:,} bytes free at {folder}" if free is not None
                              else f"{who} died of SIGBUS ({folder} is gone)")
    return ToolchainError(f"{who} exited with status {returncode}: {last}")


def _free_bytes(folder: Path) -> int | None:
    probe = next((p for p in [Path(folder), *Path(folder).parents] if p.exists()), None)
    return shutil.disk_usage(probe).free if probe is not None else None


def _child(asset: str, out: str) -> int:
    from coreai.authoring.asset import AIModelAsset

    try:
        # the same lowering ``AIModelAsset.executable()`` runs before its load (coreai's own method)
        AIModelAsset.load(Path(asset))._write_odix(Path(out))  # noqa: SLF001
    except OSError as exc:
        print(f"ERROR {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # the compiler's own error, reported as the toolchain's
        print(f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from ..interrupts import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports Ctrl-C and kills this child
    die_with_parent(PARENT_ENV)
    status = _child(sys.argv[1], sys.argv[2])  # the runtime's own lines go to the parent's pipe
    sys.stderr.flush()
    os._exit(status)
