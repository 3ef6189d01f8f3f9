"""``clef-export serve``: the release answering over HTTP on the route and envelope Cloudflare's
clients call (``POST [/client/v4]/accounts/{account}/ai/run/@cf/cloudflare/{clef|clef-flash}``),
one model in memory, requests queued to it, every answer ``answer``'s for the same body.

Starlette on uvicorn: the ASGI pair clef-router itself serves with, well kept, small, and
uvicorn stops taking connections and finishes those in flight on a signal (the exit is ours: 0)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

MODELS = ("clef", "clef-flash")  # @cf/cloudflare/<name>: the one release answers under either
PREFIX = "/client/v4"  # the clients' default base URL ends in it; the route is taken with and without it
MAX_BODY = 32 * 1024 * 1024  # a body's bytes: one image of MAX_IMAGE_BYTES as base64 fits
# a client that trickles: its request line and headers must be whole this long after it connected
# (or after its previous answer); its body must not pause longer than BODY_IDLE_S between two
# reads, nor take longer than BODY_S in all (32 MiB at 1 MB/s fits). Past them: 408, or the
# connection closed while the headers are not whole.
HEADERS_S = 10.0
BODY_IDLE_S = 10.0
BODY_S = 60.0
GONE_POLL_S = 0.25  # how often a request waiting for the model looks whether its client has gone
STOP_NOW_S = 2.0  # after a second signal: how long the clients in flight have to be told, then exit 130


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
    # the worker holding the assets is replaced once its memory grew this fraction past what it held
    # after its warm-up (worker.WARM_AFTER answers; the runtime's ~17 KiB a call, never given back),
    # or after this many answers (0: not by count)
    recycle_growth: float = 0.05
    recycle_after: int = 0


def check_bind(cfg: ServeConfig) -> None:
    """A bind beyond loopback only with a token."""
    try:
        loopback = cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        raise UsageError(f"--host {cfg.host!r}: not an IP address (or localhost)") from None
    if not loopback and not cfg.token:
        raise UsageError(f"--host {cfg.host}: binding beyond loopback needs --token (every request must carry it)")
    if cfg.token is not None and (not cfg.token or cfg.token != cfg.token.strip() or any(c.isspace() for c in cfg.token)):
        raise UsageError("--token: empty or holding whitespace; no client could send it in Authorization: Bearer <token>")
    if not 0 <= cfg.port <= 65535:
        raise UsageError(f"--port {cfg.port}: not a port")
    if cfg.queue < 1:
        raise UsageError(f"--queue {cfg.queue}: at least 1")
    if not 0 < cfg.recycle_growth or cfg.recycle_after < 0:
        raise UsageError("--recycle-growth must be above 0 and --recycle-after at least 0")


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


SYSTEMONE = "/v1/systemone"  # the author's own route (its systemone docstring; clef-rag's self-hosted backend)
REQUEST_ID = "x-request-id"  # on every answer and error: the id the server's log lines carry
# the bare route's error types, as clef-rag's own server names them (its client branches on 429 alone)
ERROR_TYPES = {400: "invalid_request", 401: "auth", 404: "not_found", 405: "not_found", 408: "timeout",
               413: "invalid_request", 422: "invalid_request", 429: "rate_limited", 499: "client_closed",
               500: "server_error", 503: "unavailable"}
RETRY_AFTER_S = 1  # a full queue (429) and a stopping server (503): when to try again
STOPPING = "the server is stopping now (a second signal); retry elsewhere"


def envelope(result: Any = None, status: int = 200, message: str | None = None, bare: bool = False):
    """An answer or an error: in Cloudflare's envelope (``{success, result, errors, messages}``), or
    ``bare`` (``/v1/systemone``): the SystemOne response itself, an error as ``{"error": {type,
    message, code}}``."""
    from starlette.responses import JSONResponse

    from .requests import safe_text

    if message is None:
        return JSONResponse(result if bare else {"success": True, "result": result, "errors": [], "messages": []})
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    # a message may quote the request's own strings: a lone surrogate in them is written escaped
    message = safe_text(message)
    if bare:
        body = {"error": {"type": ERROR_TYPES.get(status, "error"), "message": message, "code": status}}
    else:
        body = {"success": False, "result": None, "errors": [{"code": status, "message": message}], "messages": []}
    return JSONResponse(body, status_code=status, headers=headers)


def request_ids(app):
    """ASGI middleware: every response carries ``x-request-id`` (a new one per request), and the
    request's handlers find it in ``request.state.request_id`` for their log lines."""
    import uuid

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID.encode(), rid.encode())]}
            await send(message)

        return await app(scope, receive, sending)

    return asgi


class BodyTimeout(Exception):
    """A body that stopped coming (``BODY_IDLE_S``) or came too slowly (``BODY_S``)."""


def _rid(request) -> str:
    return f"request {getattr(request.state, 'request_id', '?')}"


class Service:
    """The model and its queue: requests are answered one at a time, at most ``queue`` waiting."""

    def __init__(self, cfg: ServeConfig, dist, worker, log):
        self.cfg, self.dist, self.worker, self.log = cfg, dist, worker, log
        self.workers = 1  # started so far (a recycled or dead one replaced)
        self.lock = asyncio.Lock()
        self.waiting = 0  # requests past the queue check: reading their body, waiting, or answered now
        self.answered = 0
        self.gone = 0  # requests dropped because their client hung up before their turn
        self.in_handler = 0  # run() calls not yet returned (a stop-now waits for them to be told)
        self.stop_now = asyncio.Event()  # a second signal: every request still here is told 503

    def authorised(self, request) -> bool:
        """``Authorization: Bearer <token>``, the scheme in any case (RFC 7235), the token compared
        in constant time."""
        if not self.cfg.token:
            return True
        scheme, _, got = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(got.strip().encode(), self.cfg.token.encode())

    async def body(self, request) -> bytes | None:
        """The body, or None past ``max_body`` (said by Content-Length or counted as it comes);
        ``BodyTimeout`` when it stops coming."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.cfg.max_body:
            return None
        data = bytearray()
        chunks = request.stream().__aiter__()
        deadline = time.monotonic() + BODY_S
        while True:
            wait = min(BODY_IDLE_S, deadline - time.monotonic())
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), timeout=max(wait, 0.0))
            except StopAsyncIteration:
                return bytes(data)
            except asyncio.TimeoutError:
                raise BodyTimeout() from None
            data += chunk
            if len(data) > self.cfg.max_body:
                return None

    async def _turn(self, request) -> bool:
        """The model's lock, once the requests ahead have been answered; False (and no lock) when
        the client hung up meanwhile or the server stops now: no model time for a gone client."""
        take = asyncio.ensure_future(self.lock.acquire())
        stop = asyncio.ensure_future(self.stop_now.wait())
        try:
            while not take.done():
                await asyncio.wait({take, stop}, timeout=GONE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if take.done():
                    break
                if stop.done() or await request.is_disconnected():
                    take.cancel()
                    break
            try:
                await take
            except asyncio.CancelledError:
                return False
            if self.stop_now.is_set() or await request.is_disconnected():
                self.lock.release()
                return False
            return True
        finally:
            stop.cancel()

    async def run(self, request, bare: bool = False):
        """One request on either route: Cloudflare's (its envelope) or ``/v1/systemone`` (``bare``)."""
        self.in_handler += 1
        try:
            return await self._run(request, lambda result=None, status=200, message=None:
                                   envelope(result, status, message, bare=bare))
        finally:
            self.in_handler -= 1

    async def _run(self, request, envelope):
        from .requests import RequestError, parse_body
        from .worker import WorkerGone

        model = request.path_params.get("model")
        if model is not None and model not in MODELS:
            return envelope(status=404, message=f"model @cf/cloudflare/{model} not found "
                                                f"(this server answers {', '.join('@cf/cloudflare/' + m for m in MODELS)})")
        if not self.authorised(request):
            return envelope(status=401, message="missing or wrong bearer token (Authorization: Bearer <token>)")
        # the queue said before a body is read: a full server holds no one's 32 MiB
        if self.waiting > self.cfg.queue:  # one in flight and ``queue`` behind it: Workers AI's "out of capacity"
            return envelope(status=429, message=f"{self.waiting - 1} requests waiting behind the one answered; "
                                                f"retry after {RETRY_AFTER_S} s")
        self.waiting += 1
        try:
            try:
                raw = await self.body(request)
            except BodyTimeout:
                return envelope(status=408, message=f"body: not received in time (a pause over {BODY_IDLE_S:g} s, "
                                                    f"or over {BODY_S:g} s in all)")
            if raw is None:
                return envelope(status=413, message=f"body: over {self.cfg.max_body} bytes")
            body = await asyncio.to_thread(parse_body, raw)  # megabytes of JSON: off the event loop
            if not await self._turn(request):
                if self.stop_now.is_set():
                    return envelope(status=503, message=STOPPING)
                self.gone += 1
                self.log(f"dropped a request: its client hung up before its turn ({_rid(request)})")
                return envelope(status=499, message="client closed the request")
            replace = None  # why the worker is replaced once this request is answered (the lock handed over)
            try:
                t0 = time.perf_counter()
                answering = asyncio.ensure_future(self.worker.answer(body))
                stop = asyncio.ensure_future(self.stop_now.wait())
                await asyncio.wait({answering, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if not answering.done():  # the process ends in a moment: its client told now
                    answering.add_done_callback(lambda f: f.cancelled() or f.exception())
                    return envelope(status=503, message=STOPPING)
                try:
                    answered = answering.result()
                    took = time.perf_counter() - t0
                except WorkerGone as exc:
                    replace = f"{exc} ({_rid(request)})"
                    return envelope(status=500, message="internal error: the worker running the model ended mid-request; "
                                                        "a new one answers the next request")
                replace = self._worn()
            finally:
                if replace is None or self.stop_now.is_set():
                    self.lock.release()
                else:  # this client is answered now; the next request waits for the new worker
                    asyncio.ensure_future(self._replace(replace))
        except RequestError as exc:
            return envelope(status=exc.status, message=str(exc))
        except Exception as exc:  # the server keeps serving; the request is told
            self.log(f"request failed: {type(exc).__name__}: {exc} ({_rid(request)})")
            return envelope(status=500, message=f"internal error: {type(exc).__name__}")
        finally:
            self.waiting -= 1
        self.answered += 1
        self.log(f"answered in {took:.3f} s ({answered.decoder}, {answered.bucket}, {answered.tokens} tokens, "
                 f"{_rid(request)})")
        return envelope(answered.response)

    def _worn(self) -> str | None:
        """Why the worker is to be replaced now (grown past the mark, or its answers counted), or None."""
        from .worker import WARM_AFTER

        grown, w = self.worker.grown(), self.worker
        if self.cfg.recycle_after and w.answered >= self.cfg.recycle_after:
            return f"{w.answered} answers"
        if grown is not None and grown > self.cfg.recycle_growth:
            return f"its memory grew {100 * grown:.1f} % since its {WARM_AFTER}th answer"
        return None

    async def _replace(self, why: str) -> None:
        """A new worker in place of the current one, the model's lock held throughout (taken by the
        request that found the worker worn or dead) and released at the end: the requests behind
        wait, none is lost or answered twice."""
        from .worker import Worker

        try:
            self.log(f"replacing the worker (pid {self.worker.proc.pid}): {why}")
            await self.worker.stop()
            fresh = Worker(self.worker.spec, self.worker.scratch, self.log)
            await fresh.start()
            self.worker = fresh
            self.workers += 1
        except Exception as exc:  # the next request finds the worker gone and tries again
            self.log(f"the new worker did not start: {type(exc).__name__}: {exc}")
        finally:
            self.lock.release()

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ready", "bundles": self.dist.digests(), "waiting": self.waiting,
                             "answered": self.answered, "dropped": self.gone, "engine": self.worker.engine,
                             "worker": {"pid": self.worker.proc.pid, "answered": self.worker.answered, "started": self.workers}})


def app(service_box: dict[str, Any], log):
    """The Starlette app; the model is opened in its lifespan, in the server's own loop."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    async def run(request):
        return await service_box["service"].run(request)

    async def systemone(request):
        return await service_box["service"].run(request, bare=True)

    async def health(request):
        return await service_box["service"].health(request)

    def bare(request) -> bool:  # the author's route speaks its own error form
        return request.url.path.startswith("/v1/")

    async def not_found(request, exc: HTTPException):
        if exc.status_code == 405:
            return envelope(status=405, message=f"{request.method} {request.url.path}: method not allowed", bare=bare(request))
        return envelope(status=404, message=f"{request.url.path}: no such route (POST "
                                            f"{PREFIX}/accounts/<account>/ai/run/@cf/cloudflare/<clef|clef-flash>, "
                                            f"or POST {SYSTEMONE})", bare=bare(request))

    async def failed(request, exc: Exception):  # whatever a handler did not expect: the envelope, and the log says it
        log(f"request failed: {type(exc).__name__}: {str(exc)[:200]} ({_rid(request)})")
        return envelope(status=500, message=f"internal error: {type(exc).__name__}", bare=bare(request))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        from ..interrupts import removed_at_a_forced_stop, stop_now
        from ..tmpdirs import owned_folder
        from .worker import Worker, WorkerSpec

        cfg, dist = service_box["config"], service_box["dist"]
        # the workers' temp folders (the runtime's compiled copies) in one of the server's own: a stop
        # that cannot wait for a worker removes it whole
        scratch = owned_folder(None, "workers")
        removed_at_a_forced_stop(scratch)
        worker = Worker(WorkerSpec(dist.root, dist.sums, cfg.engine, cfg.device), scratch, log)
        try:
            await worker.start()
            service = service_box["service"] = Service(cfg, dist, worker, log)
            log(f"decoder: {worker.engine} ({worker.why}); the assets in worker pid {worker.proc.pid}")
            log(f"ready: http://{cfg.host}:{cfg.port}/health")
            yield
            if service.stop_now.is_set():
                stop_now("stopped at a second signal: the requests in flight were told 503")
            async with service.lock:  # a replacement under way (it holds the lock) finishes first
                pass
        finally:  # the worker of the moment stopped, once
            await (service_box["service"].worker if "service" in service_box else worker).stop()
            shutil.rmtree(scratch, ignore_errors=True)
            removed_at_a_forced_stop(scratch, keep=False)

    route = "/accounts/{account}/ai/run/@cf/cloudflare/{model}"
    routes = [Route(p + route, run, methods=["POST"]) for p in (PREFIX, "")] + [
        Route(SYSTEMONE, systemone, methods=["POST"]), Route("/health", health, methods=["GET"])]
    star = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found, Exception: failed})
    # no redirect for a trailing slash: its Location would be built from the client's own Host header
    star.router.redirect_slashes = False
    return request_ids(star)


def protocol():
    """uvicorn's h11 protocol with a deadline on a request's line and headers (``HEADERS_S``): a
    client that trickles them is disconnected (uvicorn bounds only an idle kept-alive connection)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Deadlined(H11Protocol):
        _headers_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._headers_timer = self.loop.call_later(HEADERS_S, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no request began: nothing to answer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are whole: the body's own deadlines hold from here

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return Deadlined


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
        signals = 0

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn re-raises the signal after its shutdown; a drained stop exits 0
            import asyncio

            self.loop = asyncio.get_running_loop()
            stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a closed terminal stops it as Ctrl-C does
            previous = {s: signal.signal(s, self.on_signal) for s in stops}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        def on_signal(self, sig, frame) -> None:
            self.signals += 1
            if self.signals == 1:
                log("stopping: no new connections; what is in flight is finished (a second signal stops now)")
                self.should_exit = True
                return
            if self.signals == 2:
                self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.stop_now()))

        async def stop_now(self) -> None:
            """A second signal: every request still here is told 503, then exit 130 at once (a
            runtime call in flight is never torn down: that aborts the process)."""
            from ..interrupts import stop_now

            service = box.get("service")
            if service is not None:
                service.stop_now.set()
                deadline = time.monotonic() + STOP_NOW_S
                while service.in_handler and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.05)  # their answers' bytes leave the socket buffers
            stop_now("stopped at a second signal: the requests in flight were told 503")

    config = uvicorn.Config(app(box, log), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=None, http=protocol())
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
