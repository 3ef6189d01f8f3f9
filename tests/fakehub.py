"""A loopback fake of the Hub's file endpoints, serving a snapshot folder, misbehaving on demand.

Serves ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` with the headers huggingface_hub needs
(``X-Repo-Commit``, ``ETag``, ``Content-Length``). ``faults[file]`` picks a misbehaviour:
``404-entry``, ``404-revision``, ``500``, ``reset`` (connection cut mid-body), ``corrupt``
(same size, one byte flipped), ``corrupt-once`` (corrupt for one download, right afterwards),
``slow`` (a delay before the body), ``tamper`` (other bytes than the ones paths-info describes).
``POST /api/models/{repo}/paths-info/{revision}`` answers like the Hub: ``*.safetensors`` are LFS
files (``lfs.oid`` = sha256), the rest are git files (``oid`` = git blob sha1).
"""

from __future__ import annotations

import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
import json
from urllib.parse import parse_qs, unquote


class FakeHub:
    def __init__(self, repo: str, revision: str, folder: Path):
        self.repo, self.revision, self.folder = repo, revision, Path(folder)
        self.faults: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _route(self, body: bool) -> None:
                path = unquote(self.path.split("?")[0])
                hub.requests.append((self.command, path))
                prefix = f"/{hub.repo}/resolve/"
                if not path.startswith(prefix):
                    return self._error(404, "RepoNotFound", "Repository not found")
                rev, _, name = path[len(prefix):].partition("/")
                fault = hub.faults.get(name, "")
                if rev != hub.revision or fault == "404-revision":
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                f = hub.folder / name
                if fault == "404-entry" or not f.is_file():
                    return self._error(404, "EntryNotFound", "Entry not found")
                if fault == "500":
                    return self._error(500, None, "Internal Error")
                data = f.read_bytes()
                if fault == "tamper":
                    data = data + b"\n# appended by a man in the middle\n"
                if fault in ("corrupt", "corrupt-once"):
                    data = data[:-1] + bytes([data[-1] ^ 0x01])
                    if fault == "corrupt-once" and body:
                        hub.faults.pop(name)  # the next request gets the true bytes
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("X-Repo-Commit", hub.revision)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if not body:
                    return
                if fault == "slow":
                    time.sleep(1.5)
                if fault == "reset":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

            def _error(self, code: int, error_code: str | None, msg: str) -> None:
                payload = ('{"error": "%s"}' % msg).encode()
                self.send_response(code)
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", msg)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def do_POST(self):
                path = unquote(self.path.split("?")[0])
                hub.requests.append((self.command, path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                prefix = f"/api/models/{hub.repo}/paths-info/"
                if not path.startswith(prefix):
                    return self._error(404, "RepoNotFound", "Repository not found")
                if path[len(prefix):] != hub.revision:
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                out = []
                for name in parse_qs(body).get("paths", []):
                    f = hub.folder / name
                    if not f.is_file():
                        continue  # the Hub leaves out paths it does not have
                    data = f.read_bytes()
                    entry = {"type": "file", "path": name, "size": len(data),
                             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                    if name.endswith(".safetensors"):
                        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    out.append(entry)
                payload = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_HEAD(self):
                self._route(body=False)

            def do_GET(self):
                self._route(body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
