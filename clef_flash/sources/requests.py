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
    body: dict[str, Any]

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


def load_requests(path: Path) -> list[Request]:
    """SystemOne request bodies, one JSON object a line (blank lines skipped; a ``labels`` or
    ``id`` field may be present). A malformed line is a usage error naming file and line."""
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
        if body.get("images") or body.get("videos"):
            raise UsageError(f"{path}:{n}: requests with images or videos are not supported by check-release "
                             "(text only; the release's processor is not used)")
        out.append(Request(line=n, body=body))
    if not out:
        raise UsageError(f"{path}: no requests")
    return out
