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


class Recorder:
    """A loopback proxy in front of a server that records every exchange (path, the body the client
    sent, the status and the JSON answered): what a client really sent, to answer again with
    ``answer`` and to check against the author's."""

    def __init__(self, upstream: str):
        import http.server
        import json
        import threading

        import httpx

        self.exchanges: list[dict] = []
        lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                r = httpx.post(upstream + self.path, content=raw, headers=headers, timeout=900)
                exchange = {"path": self.path, "body": json.loads(raw), "status": r.status_code, "response": r.json(),
                            "delivered": False}
                with lock:
                    recorder.exchanges.append(exchange)
                try:
                    self.send_response(r.status_code)
                    for k in ("content-type", "retry-after", "x-request-id"):
                        if k in r.headers:
                            self.send_header(k, r.headers[k])
                    self.send_header("content-length", str(len(r.content)))
                    self.end_headers()
                    self.wfile.write(r.content)
                    self.wfile.flush()
                    exchange["delivered"] = True
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client had gone (its own timeout): its retry is the request that counts

            def log_message(self, *args):  # the test's output stays the test's
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
