"""Request files: SystemOne request bodies, one JSON object a line, checked before any work (what
``systemone`` would refuse, and what the text-only commands do not run). Read by ``check-release``
and by ``plan-weights`` (its calibration records)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

QUESTION_TYPES = ("noul", "choice", "score")


@dataclass(frozen=True)
class Request:
    line: int
    body: dict[str, Any]  # as the author's systemone takes it (image paths made absolute)
    images: tuple[Path, ...] = ()  # the image files, resolved against the requests file's folder

    @property
    def id(self) -> str:
        return str(self.body.get("id", f"line {self.line}"))


def default_requests() -> Path:
    from ..data import data_dir

    return data_dir("conversion") / "requests.jsonl"


def _request_problem(body: Any) -> str | None:
    """What ``systemone`` would refuse, or what this command does not run (images, videos)."""
    if not isinstance(body, dict):
        return "not a JSON object"
    if not isinstance(body.get("model"), str) or "state" not in body:
        return "model (a string) and state are required"
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        return "at least one question is required"
    for qid, q in questions.items():
        if not isinstance(q, dict) or q.get("type") not in QUESTION_TYPES:
            return f"question {qid!r}: type must be noul, choice, or score"
        crit = q.get("criteria")
        if q["type"] == "choice" and (not isinstance(crit, dict) or not crit):
            return f"question {qid!r}: a choice needs criteria, an object of options"
        if q["type"] == "score" and (not isinstance(crit, list) or not crit):
            return f"question {qid!r}: a score needs criteria, a list of levels"
        if q["type"] == "noul" and crit is not None and (not isinstance(crit, dict) or set(crit) - {"true", "false"}):
            return f"question {qid!r}: a noul's criteria may only describe true and false"
    return None


MAX_IMAGES = 1  # the decoder takes one image a request (the published port's interface)
MEDIA_KWARGS = ("max_pixels", "min_pixels", "size")  # what the image processor honours per request


def _images(path: Path, n: int, body: dict[str, Any]) -> tuple[Path, ...]:
    """The request's image files, checked: paths relative to the requests file, present, at most
    ``MAX_IMAGES``; videos refused. A problem is a usage error naming the file and line."""
    if body.get("videos"):
        raise UsageError(f"{path}:{n}: requests with videos are not supported (images only)")
    images = body.get("images") or []
    if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
        raise UsageError(f"{path}:{n}: images must be a list of file paths (relative to {path.name}'s folder)")
    if len(images) > MAX_IMAGES:
        raise UsageError(f"{path}:{n}: {len(images)} images; the decoder takes {MAX_IMAGES} image a request")
    kwargs = body.get("media_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - set(MEDIA_KWARGS):
        raise UsageError(f"{path}:{n}: media_kwargs may hold {', '.join(MEDIA_KWARGS)} only")
    out = []
    for x in images:
        if "://" in x or x.startswith("data:"):
            raise UsageError(f"{path}:{n}: image {x[:60]!r}: only local files are read (no URLs, no inline data)")
        f = (path.parent / x).resolve()
        if not f.is_file():
            raise UsageError(f"{path}:{n}: image {x} not found (looked for {f})")
        out.append(f)
    return tuple(out)


def load_requests(path: Path, images: bool = False) -> list[Request]:
    """SystemOne request bodies, one JSON object a line (blank lines skipped; a ``labels`` or
    ``id`` field may be present). A malformed line is a usage error naming file and line.
    ``images``: requests may carry one image file each (``check-release``); else they are refused."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: requests file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the requests ({exc})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from None
        problem = _request_problem(body)
        if problem:
            raise UsageError(f"{path}:{n}: {problem}")
        files: tuple[Path, ...] = ()
        if body.get("images") or body.get("videos") or body.get("media_kwargs"):
            if not images:
                raise UsageError(f"{path}:{n}: requests with images or videos are not taken here (text only)")
            files = _images(path, n, body)
            body = {**body, "images": [str(f) for f in files]} if files else body
        out.append(Request(line=n, body=body, images=files))
    if not out:
        raise UsageError(f"{path}: no requests")
    return out
