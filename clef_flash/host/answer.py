"""``clef-export answer``: every request of a JSONL file answered by the release's assets, one JSON
line per request in input order (a request that cannot be answered: its line says why, and the
command exits 4 once the rest are answered); ``--out`` written whole or not at all."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError


@dataclass(frozen=True)
class AnswerConfig:
    dist: str  # a release folder, or OWNER/NAME@COMMIT
    requests: Path
    out: Path | None = None
    overwrite: bool = False
    cache: Path | None = None  # where a published release is downloaded (default: the Hub's cache)
    engine: str = "auto"  # the decoder's engine (backbone.executor.choose_engine)
    device: str = "auto"  # the torch engine's device


@dataclass
class AnswerResult:
    lines: list[str]  # one JSON line per request, in input order
    failed: list[str] = field(default_factory=list)  # "file:line: field: why"
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, summed over the requests
    requests: int = 0
    engine: str = ""  # what ran the decoder (backbone.executor.EngineInfo.describe)


def check_engine_options(engine: str, device: str) -> None:
    """``--engine`` and ``--device`` refused before any work where they cannot be (exit 2)."""
    from ..backbone.executor import ENGINES

    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "coreai" and (engine == "torch" or device != "auto"):
        from ..devices import device_name

        device_name(device)


# a line is one request body: the server's cap on a body (host.server.MAX_BODY: one image of
# 20 MiB as base64 fits), so a file of requests and a server take the same requests
MAX_LINE = 32 * 1024 * 1024


def check_requests_file(path: Path) -> None:
    """A requests file that can be read as lines: a regular file or a FIFO (a pipe's ``<(…)``),
    refused before any work otherwise (a folder, a device such as /dev/zero, a socket)."""
    import stat

    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        raise UsageError(f"{path}: requests file not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the requests file ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path}: a folder, not a requests file (JSONL, one request a line)")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise UsageError(f"{path}: not a regular file or a FIFO (a device or a socket is not read as requests)")


def read_lines(path: Path, max_line: int = MAX_LINE) -> list[tuple[int, Any]]:
    """(line number, parsed body or the ``RequestError`` saying why not) of each non-blank line;
    a line past ``max_line`` bytes is refused as it is read (never held whole)."""
    from .requests import RequestError, parse_body

    check_requests_file(path)
    out: list[tuple[int, Any]] = []
    try:
        with open(path, "rb") as f:
            n = 0
            while True:
                line = f.readline(max_line + 1)
                if not line:
                    break
                n += 1
                if len(line) > max_line and not line.endswith(b"\n"):
                    while line and not line.endswith(b"\n"):  # the rest of the line, read and let go
                        line = f.readline(1024 * 1024)
                    out.append((n, RequestError("body", f"line over {max_line} bytes (a request's cap, as serve's body)", 413)))
                    continue
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    out.append((n, RequestError("body", "not UTF-8 text")))
                    continue
                try:
                    out.append((n, parse_body(text)))
                except RequestError as exc:
                    out.append((n, exc))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the requests file ({exc.strerror or exc})") from None
    if not out:
        raise UsageError(f"{path}: no requests")
    return out


def error_line(n: int, body: Any, field_name: str, message: str, status: int) -> dict[str, Any]:
    from .requests import safe_text

    rid = body.get("id") if isinstance(body, dict) else None
    if isinstance(rid, str):
        rid = safe_text(rid)
    elif not isinstance(rid, (int, float, type(None))):
        rid = None  # an id that is not a string or a number is not echoed
    return {"line": n, **({"id": rid} if rid is not None else {}),
            "error": {"field": safe_text(field_name), "message": safe_text(message), "status": status}}


def answer_file(cfg: AnswerConfig, emit: Callable[[str], None] | None = None, log=lambda msg: None) -> AnswerResult:
    """Every request answered in order; ``emit`` gets each line as it is made (stdout)."""
    from ..bundle import atomic_write_bytes, check_output_path
    from ..interrupts import refuse_if_interrupted, run_async
    from ..progress import slow_progress
    from .dist import open_dist
    from ..errors import ClefError
    from ..interrupts import Interrupted
    from .model import STAGES, ClefHost
    from .requests import RequestError, safe_text

    check_engine_options(cfg.engine, cfg.device)
    check_requests_file(cfg.requests)
    if cfg.out is not None:
        if Path(cfg.out).is_dir():
            raise UsageError(f"{cfg.out}: --out is a folder; it takes a file (JSONL, one answer a line)")
        check_output_path(Path(cfg.out), cfg.overwrite)
    bodies = read_lines(cfg.requests)
    dist = open_dist(cfg.dist, cfg.cache, log)
    result = AnswerResult(lines=[], seconds={s: 0.0 for s in STAGES}, requests=len(bodies))

    async def run() -> None:
        from ..progress import progress

        async with ClefHost(dist, cfg.engine, cfg.device) as host:
            log(f"decoder: {host.engine.describe()} ({host.choice.why})")
            result.engine = host.engine.describe()
            with progress("answering", len(bodies), "requests") as tick:
                for n, body in bodies:
                    refuse_if_interrupted()  # Ctrl-C: no request starts after it
                    try:
                        if isinstance(body, RequestError):
                            raise body
                        answered = await host.answer(body, Path(cfg.requests).parent, on_layer=slow_progress(f"request on line {n}", log))
                        line = json.dumps({"line": n, **({"id": body["id"]} if "id" in body else {}), **answered.response},
                                          ensure_ascii=False)
                        for s in STAGES:
                            result.seconds[s] += answered.seconds[s]
                    except RequestError as exc:
                        result.failed.append(f"{cfg.requests}:{n}: {safe_text(str(exc))}")
                        line = json.dumps(error_line(n, body, exc.field, str(exc), exc.status), ensure_ascii=False)
                    except (Interrupted, ClefError):
                        raise  # a stop, or a release that cannot answer at all: the command's, not the line's
                    except Exception as exc:  # this line's own failure: said on its line, the rest answered (as serve's 500)
                        why = f"internal error: {type(exc).__name__}: {safe_text(str(exc))[:200]}"
                        result.failed.append(f"{cfg.requests}:{n}: {why}")
                        line = json.dumps(error_line(n, body, "body", why, 500), ensure_ascii=False)
                    result.lines.append(line)
                    if emit is not None and cfg.out is None:
                        emit(line)
                    tick()

    t0 = time.perf_counter()
    run_async(run)
    result.seconds["total"] = time.perf_counter() - t0
    if cfg.out is not None:
        atomic_write_bytes(Path(cfg.out), "".join(line + "\n" for line in result.lines).encode("utf-8"))
    return result


def check_release_vectors(dist_spec: str, cache: Path | None = None, log=lambda msg: None, engine: str = "auto",
                          device: str = "auto"):
    """``answer --vectors``: this host (its decoder on ``engine``) against the release's
    ``host/host-vectors.jsonl``, step by step."""
    from ..layout import HOST_DIR, VECTORS_FILE
    from .dist import open_dist
    from .vectors import check_vectors

    check_engine_options(engine, device)
    dist = open_dist(dist_spec, cache, log)
    return check_vectors(dist, dist.root / HOST_DIR / VECTORS_FILE, log, engine)
