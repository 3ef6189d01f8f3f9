"""The ``clef-export`` entry point: the signal handlers first, before anything heavy is imported
(typer, rich, torch), so Ctrl-C is exit 130 from the first moment of the command; then the CLI."""

from __future__ import annotations


def main() -> None:
    from .interrupts import install

    install()
    from .cli import main as cli_main

    try:
        cli_main()
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)


def _leave(code) -> None:
    """Exit with ``code`` once the command has unwound, without the interpreter's teardown. The
    command's own clean-up is done (its staged folders and temp files removed on the way out,
    nothing half-written) and the ``atexit`` hooks run here; what is skipped is finalising the
    runtime's native objects, which can abort the process after its answer is written: SIGABRT from
    the Swift runtime ("C++ exception handling detected ...") at teardown, seen after a normal exit 4
    of ``answer`` on a clean clone's CI and after 3 of 32 interrupts of a backbone gate under load."""
    import atexit
    import os
    import sys

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # SystemExit("message"): as Python says it, exit 1
        code = 1
    atexit._run_exitfuncs()  # noqa: SLF001 (the hooks Python's own exit would run: temp folders, pools)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
