"""``clef-export serve``: the release answering over HTTP on the route and envelope Cloudflare's
clients call (``POST [/client/v4]/accounts/{account}/ai/run/@cf/cloudflare/{clef|clef-flash}``),
one model in memory, requests queued to it, every answer ``answer``'s for the same body.

Starlette on uvicorn: the ASGI pair clef-router itself serves with, well kept, small, and
uvicorn stops taking connections and finishes those in flight on a signal (the exit is ours: 0)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

MODELS = ("clef", "clef-flash")  # @cf/cloudflare/<name>: the one release answers under either
PREFIX = "/client/v4"  # the clients' default base URL ends in it; the route is taken with and without it
MAX_BODY = 32 * 1024 * 1024  # a body's bytes: one image of MAX_IMAGE_BYTES as base64 fits


@dataclass(frozen=True)
class ServeConfig:
    dist: str
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    queue: int = 64  # requests waiting for the model past which the server answers 503
    max_body: int = MAX_BODY
    cache: Any = None
    engine: str = "auto"  # the decoder's engine (backbone.executor.choose_engine)
    device: str = "auto"  # the torch engine's device


def check_bind(cfg: ServeConfig) -> None:
    """A bind beyond loopback only with a token."""
    try:
        loopback = cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        raise UsageError(f"--host {cfg.host!r}: not an IP address (or localhost)") from None
    if not loopback and not cfg.token:
        raise UsageError(f"--host {cfg.host}: binding beyond loopback needs --token (every request must carry it)")
    if not 0 <= cfg.port <= 65535:
        raise UsageError(f"--port {cfg.port}: not a port")
    if cfg.queue < 1:
        raise UsageError(f"--queue {cfg.queue}: at least 1")


def _bound(cfg: ServeConfig):
    import socket

    host = "127.0.0.1" if cfg.host == "localhost" else cfg.host
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, cfg.port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"--port {cfg.port}: cannot listen on {host}:{cfg.port} ({exc.strerror or exc})") from None
    return sock


def envelope(result: Any = None, status: int = 200, message: str | None = None):
    from starlette.responses import JSONResponse

    if message is None:
        return JSONResponse({"success": True, "result": result, "errors": [], "messages": []})
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"success": False, "result": None, "errors": [{"code": status, "message": message}],
                         "messages": []}, status_code=status, headers=headers)


class Service:
    """The model and its queue: requests are answered one at a time, at most ``queue`` waiting."""

    def __init__(self, cfg: ServeConfig, dist, host, log):
        self.cfg, self.dist, self.host, self.log = cfg, dist, host, log
        self.lock = asyncio.Lock()
        self.waiting = 0
        self.answered = 0

    def authorised(self, request) -> bool:
        if not self.cfg.token:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.cfg.token}".encode())

    async def body(self, request) -> bytes | None:
        """The body, or None past ``max_body`` (said by Content-Length or counted as it comes)."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.cfg.max_body:
            return None
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.cfg.max_body:
                return None
        return bytes(data)

    async def run(self, request):
        from .requests import RequestError

        if request.path_params["model"] not in MODELS:
            return envelope(status=404, message=f"model @cf/cloudflare/{request.path_params['model']} not found "
                                                f"(this server answers {', '.join('@cf/cloudflare/' + m for m in MODELS)})")
        if not self.authorised(request):
            return envelope(status=401, message="missing or wrong bearer token (Authorization: Bearer <token>)")
        raw = await self.body(request)
        if raw is None:
            return envelope(status=413, message=f"body: over {self.cfg.max_body} bytes")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return envelope(status=400, message=f"body: not JSON ({exc})")
        if self.waiting > self.cfg.queue:  # one in flight and ``queue`` behind it
            return envelope(status=503, message=f"{self.waiting - 1} requests waiting behind the one answered; retry later")
        self.waiting += 1
        try:
            async with self.lock:
                t0 = time.perf_counter()
                answered = await self.host.answer(body)
        except RequestError as exc:
            return envelope(status=exc.status, message=str(exc))
        except Exception as exc:  # the server keeps serving; the request is told
            self.log(f"request failed: {type(exc).__name__}: {exc}")
            return envelope(status=500, message=f"internal error: {type(exc).__name__}")
        finally:
            self.waiting -= 1
        self.answered += 1
        self.log(f"answered in {time.perf_counter() - t0:.3f} s ({answered.bucket}, {len(answered.encoded.ids)} tokens)")
        return envelope(answered.response)

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ready", "bundles": self.dist.digests(), "waiting": self.waiting,
                             "answered": self.answered, "engine": self.host.engine.describe()})


def app(service_box: dict[str, Any], log):
    """The Starlette app; the model is opened in its lifespan, in the server's own loop."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    async def run(request):
        return await service_box["service"].run(request)

    async def health(request):
        return await service_box["service"].health(request)

    async def not_found(request, exc: HTTPException):
        if exc.status_code == 405:
            return envelope(status=405, message=f"{request.method} {request.url.path}: method not allowed")
        return envelope(status=404, message=f"{request.url.path}: no such route (POST "
                                            f"{PREFIX}/accounts/<account>/ai/run/@cf/cloudflare/<clef|clef-flash>)")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        from .model import ClefHost

        cfg = service_box["config"]
        async with ClefHost(service_box["dist"], cfg.engine, cfg.device) as host:
            service_box["service"] = Service(cfg, service_box["dist"], host, log)
            log(f"decoder: {host.engine.describe()} ({host.choice.why})")
            log(f"ready: http://{cfg.host}:{cfg.port}/health")
            yield

    route = "/accounts/{account}/ai/run/@cf/cloudflare/{model}"
    routes = [Route(p + route, run, methods=["POST"]) for p in (PREFIX, "")] + [Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})


def serve(cfg: ServeConfig, log=lambda msg: None) -> dict[str, Any]:
    """Serve until SIGINT / SIGTERM; then stop taking requests, finish those in flight, return."""
    import contextlib

    import uvicorn

    from .dist import open_dist

    from .answer import check_engine_options

    check_engine_options(cfg.engine, cfg.device)
    check_bind(cfg)
    sock = _bound(cfg)  # a port in use is said now, before the release is hashed and loaded
    dist = open_dist(cfg.dist, cfg.cache, log)
    box: dict[str, Any] = {"config": cfg, "dist": dist}

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn re-raises the signal after its shutdown; a drained stop exits 0
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

    config = uvicorn.Config(app(box, log), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=None)
    server = Server(config)
    log(f"serving {dist.root} on http://{cfg.host}:{cfg.port}{PREFIX}/accounts/<account>/ai/run/@cf/cloudflare/"
        f"<clef|clef-flash> (Ctrl-C: finish what is in flight, then stop)")
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    if not server.started:
        raise UsageError(f"could not serve on {cfg.host}:{cfg.port} (in use, or the model did not load)")
    service = box.get("service")
    return {"answered": service.answered if service else 0}
