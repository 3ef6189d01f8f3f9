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

import base64
import hashlib
import re
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
                if fault == "500":  # Retry-After: 0, as a busy Hub may say: the client's retries take 1 s each, not 1 + 2 + 4 + 8 + 8
                    return self._error(500, None, "Internal Error", retry_after=0)
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

            def _error(self, code: int, error_code: str | None, msg: str, retry_after: int | None = None) -> None:
                payload = ('{"error": "%s"}' % msg).encode()
                self.send_response(code)
                if retry_after is not None:
                    self.send_header("Retry-After", str(retry_after))
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


class FakeHubRepos:
    """A loopback fake of the Hub's *write* side: repos with branches and commits, the endpoints
    ``create_repo`` / ``create_commit`` (LFS ``basic`` transfer) / ``hf_hub_download`` /
    ``snapshot_download`` use, and a token check. Commits are all-or-nothing, like the Hub's.

    ``faults``: ``reset-upload`` (every LFS PUT is cut mid-body), ``reset-commit`` (the commit POST
    is cut before it applies), ``500-paths-info`` (the read-back's file listing fails after the commit
    landed). ``commits(repo)`` lists a repo's commit ids on ``main``, oldest first.
    Run ``python -m tests.fakehub --serve`` to serve it on a free loopback port (``make check``).
    """

    LFS_SUFFIXES = (".mlirb", ".bin", ".safetensors")  # what the Hub's default .gitattributes puts in LFS

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.faults: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, payload, headers: dict | None = None, error: str | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if error:
                    self.send_header("X-Error-Code", error)
                    self.send_header("X-Error-Message", str(payload))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Bearer ") and len(auth) > len("Bearer "):
                    return True
                self._send(401, {"error": "Invalid credentials"})
                return False

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _cut(self) -> None:
                self.close_connection = True
                self.connection.shutdown(2)

            def do_POST(self):
                path = unquote(self.path.split("?")[0])
                hub.requests.append(("POST", path))
                if path == "/api/validate-yaml":
                    self._body()
                    return self._send(200, {"errors": [], "warnings": []})
                if "/paths-info/" not in path and not self._authorized():
                    return
                if path == "/api/repos/create":
                    req = json.loads(self._body())
                    repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    with hub.lock:
                        if repo in hub.repos:
                            return self._send(409, {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo}"})
                        hub.create(repo, private=req.get("visibility") == "private")
                    return self._send(200, {"url": f"{hub.endpoint}/{repo}", "name": repo})
                if path.endswith(".git/info/lfs/objects/batch"):
                    req = json.loads(self._body())
                    objs = []
                    for o in req["objects"]:
                        entry = {"oid": o["oid"], "size": o["size"]}
                        if o["oid"] not in hub.lfs:
                            entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{o['oid']}"}}
                        objs.append(entry)
                    return self._send(200, {"transfer": "basic", "objects": objs})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/paths-info/(.+)$", path)
                if m:
                    if "500-paths-info" in hub.faults:  # the read-back after a commit fails
                        self._body()
                        return self._send(500, "Internal Error", error="ServerError")
                    files = hub.files(*m.groups())
                    if files is None:
                        return self._send(404, "Invalid rev id", error="RevisionNotFound")
                    out = []
                    for name in parse_qs(self._body().decode()).get("paths", []):
                        if name in files:
                            data = files[name]
                            e = {"type": "file", "path": name, "size": len(data), "oid": git_sha1(data)}
                            if name.endswith(FakeHubRepos.LFS_SUFFIXES):
                                e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                            out.append(e)
                    return self._send(200, out)
                for kind in ("preupload", "commit", "branch"):
                    m = re.match(rf"^/api/models/([^/]+/[^/]+)/{kind}/(.+)$", path)
                    if m:
                        repo, rev = m.groups()
                        if repo not in hub.repos:
                            return self._send(404, "Repository not found", error="RepoNotFound")
                        return getattr(self, f"_{kind}")(repo, rev)
                return self._send(404, "Not found", error="EntryNotFound")

            def _preupload(self, repo, rev):
                req = json.loads(self._body())
                files = hub.files(repo, rev) or {}
                out = []
                for f in req["files"]:
                    lfs = f["path"].endswith(FakeHubRepos.LFS_SUFFIXES) or f["size"] > 10 * 2**20
                    old = files.get(f["path"])
                    oid = None if old is None else (hashlib.sha256(old).hexdigest() if lfs else git_sha1(old))
                    out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                                "shouldIgnore": False, "oid": oid})
                return self._send(200, {"files": out, "commitOid": hub.repos[repo]["branches"].get(rev)})

            def _branch(self, repo, rev):
                self._body()
                with hub.lock:
                    branches = hub.repos[repo]["branches"]
                    if rev in branches:
                        return self._send(409, {"error": "Branch already exists"})
                    branches[rev] = branches["main"]
                return self._send(200, {})

            def _commit(self, repo, rev):
                lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
                if "reset-commit" in hub.faults:
                    return self._cut()
                with hub.lock:
                    branches = hub.repos[repo]["branches"]
                    if rev not in branches:
                        return self._send(404, "Invalid rev id", error="RevisionNotFound")
                    parent = branches[rev]
                    files = dict(hub.repos[repo]["commits"][parent]["files"]) if parent else {}
                    for item in lines:
                        v = item["value"]
                        if item["key"] == "file":
                            files[v["path"]] = base64.b64decode(v["content"])
                        elif item["key"] == "lfsFile":
                            if v["oid"] not in hub.lfs:
                                return self._send(400, {"error": f"LFS object {v['oid']} was never uploaded"})
                            files[v["path"]] = hub.lfs[v["oid"]]
                        elif item["key"] in ("deletedFile",):
                            files.pop(v["path"], None)
                    oid = hub.commit(repo, rev, files, lines[0]["value"]["summary"])
                return self._send(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid,
                                        "pullRequestUrl": None})

            def do_PUT(self):
                path = unquote(self.path.split("?")[0])
                hub.requests.append(("PUT", path))
                oid = path.rsplit("/", 1)[-1]
                n = int(self.headers.get("Content-Length") or 0)
                if "reset-upload" in hub.faults:
                    self.rfile.read(min(n, max(1, n // 2)))
                    return self._cut()
                data = self.rfile.read(n)
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._send(400, {"error": "sha256 of the body is not the oid"})
                hub.lfs[oid] = data
                return self._send(200, b"")

            def do_HEAD(self):
                self._get(body=False)

            def do_GET(self):
                self._get(body=True)

            def _get(self, body: bool):
                path = unquote(self.path.split("?")[0])
                hub.requests.append((self.command, path))
                m = re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?$", path)
                if m:
                    repo, what, rev, _sub = m.groups()
                    sha = hub.resolve(repo, rev)
                    if sha is None:
                        return self._send(404, "Invalid rev id", error="RevisionNotFound")
                    files = hub.repos[repo]["commits"][sha]["files"]
                    if what == "revision":
                        return self._send(200, {"id": repo, "sha": sha, "private": hub.repos[repo]["private"],
                                                "siblings": [{"rfilename": p} for p in sorted(files)]})
                    out = []
                    for p, data in sorted(files.items()):
                        e = {"type": "file", "path": p, "size": len(data), "oid": git_sha1(data)}
                        if p.endswith(FakeHubRepos.LFS_SUFFIXES):
                            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                        out.append(e)
                    return self._send(200, out)
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if not m:
                    return self._send(404, "Repository not found", error="RepoNotFound")
                repo, rev, name = m.groups()
                sha = hub.resolve(repo, rev)
                if sha is None:
                    return self._send(404, "Invalid rev id", error="RevisionNotFound")
                data = hub.repos[repo]["commits"][sha]["files"].get(name)
                if data is None:
                    return self._send(404, "Entry not found", error="EntryNotFound")
                headers = {"X-Repo-Commit": sha, "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                           "Content-Type": "application/octet-stream"}
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # -- the store
    def create(self, repo: str, private: bool = False, files: dict[str, bytes] | None = None) -> None:
        self.repos[repo] = {"private": private, "branches": {"main": None}, "commits": {}}
        self.commit(repo, "main", {".gitattributes": b"*.mlirb filter=lfs diff=lfs merge=lfs -text\n", **(files or {})},
                    "initial commit")

    def commit(self, repo: str, branch: str, files: dict[str, bytes], summary: str) -> str:
        r = self.repos[repo]
        parent = r["branches"][branch]
        listing = "".join(f"{p}\0{hashlib.sha256(d).hexdigest()}\n" for p, d in sorted(files.items()))
        oid = hashlib.sha1(f"{parent}\n{summary}\n{listing}".encode()).hexdigest()
        r["commits"][oid] = {"parent": parent, "files": files, "summary": summary}
        r["branches"][branch] = oid
        return oid

    def resolve(self, repo: str, rev: str) -> str | None:
        r = self.repos.get(repo)
        if r is None:
            return None
        return r["branches"].get(rev) or (rev if rev in r["commits"] else None)

    def files(self, repo: str, rev: str) -> dict[str, bytes] | None:
        sha = self.resolve(repo, rev)
        return None if sha is None else self.repos[repo]["commits"][sha]["files"]

    def commits(self, repo: str, branch: str = "main") -> list[str]:
        r, out = self.repos[repo], []
        sha = r["branches"][branch]
        while sha is not None:
            out.append(sha)
            sha = r["commits"][sha]["parent"]
        return out[::-1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHubRepos":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python -m tests.fakehub --serve   (prints the endpoint, serves until killed)")
    with FakeHubRepos() as _hub:
        print(_hub.endpoint, flush=True)
        threading.Event().wait()
