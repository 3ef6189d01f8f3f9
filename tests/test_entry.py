"""The entry point leaves with the command's exit code after the ``atexit`` hooks, and without the
interpreter's teardown, where finalising the runtime's native objects can abort a finished command
(docs/failures.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROGRAM = """
import atexit, sys
class Native:
    def __del__(self):
        print("finalised at teardown", flush=True)
held = Native()
atexit.register(lambda: print("atexit hook ran", flush=True))
sys.argv = ["clef-export"] + {argv!r}
from clef_flash.entry import main
main()
"""


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["verify-hashes", "/nonexistent/release"], 2)])
def test_the_entry_runs_atexit_keeps_the_code_and_skips_teardown(argv, code):
    r = subprocess.run([sys.executable, "-c", _PROGRAM.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-1000:]
    assert "atexit hook ran" in r.stdout
    assert "finalised at teardown" not in r.stdout


def test_a_plain_interpreter_does_finalise_at_teardown():
    """The check above can fail: without the entry's exit the same object is finalised."""
    r = subprocess.run([sys.executable, "-c", _PROGRAM.split("sys.argv")[0]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "finalised at teardown" in r.stdout and "atexit hook ran" in r.stdout
