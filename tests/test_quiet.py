"""The Core AI runtime's own lines stay off the terminal unless --verbose (captured at fd 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = Path(sys.executable).parent / "clef-export"

PROBE = r"""
import os, sys
from clef_flash import quiet
quiet.set_verbose({verbose})
with quiet.native_stderr():
    os.write(2, b"ODIE native line\n")
    print("our progress line", file=sys.stderr)
print("kept:", quiet.captured(), file=sys.stderr)
try:
    with quiet.native_stderr():
        os.write(2, b"ODIE why it failed\n")
        raise RuntimeError("boom")
except RuntimeError:
    pass
"""


def _probe(verbose: bool) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE.format(verbose=verbose)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_native_lines_are_captured_and_kept_ours_pass_through():
    err = _probe(False)
    lines = err.splitlines()
    assert "ODIE native line" not in lines and "our progress line" in lines
    assert "kept: ['ODIE native line']" in lines
    # a failing block shows what the runtime said, after the fact
    assert "the Core AI runtime said:" in lines and "  ODIE why it failed" in lines


def test_verbose_lets_them_through():
    lines = _probe(True).splitlines()
    assert "ODIE native line" in lines and "our progress line" in lines and "kept: []" in lines


def test_verify_shows_no_runtime_lines_unless_verbose(tiny_bundle, tiny_source):
    args = [str(EXE), "verify", str(tiny_bundle), "--source", str(tiny_source), "--records", "1"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "ODIE" not in quiet.stderr + quiet.stdout and "verified" in quiet.stdout
    loud = subprocess.run([str(EXE), "--verbose", *args[1:]], capture_output=True, text=True, timeout=600)
    assert loud.returncode == 0 and "ODIE [default]: Loading function" in loud.stderr
