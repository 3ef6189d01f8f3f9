"""A real ``clef-export serve`` on a loopback port, for the tests that speak HTTP to it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXE = str(Path(sys.executable).parent / "clef-export")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, dist: Path, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")  # its per-request lines: a pipe nobody reads would fill
        self.proc = subprocess.Popen([EXE, "serve", str(dist), "--port", str(self.port), *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env)
        import httpx

        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(self.stop()[1][-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("serve did not become ready")

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        self.log.seek(0)
        return code, self.log.read()
