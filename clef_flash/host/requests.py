"""A SystemOne request body checked before any work, and its one image decoded: each problem a
``RequestError`` naming the field, with the HTTP status ``serve`` answers it with (400 a bad body,
413 too large, 422 a request the bundles cannot take)."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sources.requests import MAX_IMAGES, MEDIA_KWARGS, QUESTION_TYPES

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image's bytes
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # its decoded pixels: past it Pillow's bomb check, not a resize, answers
# a body's nesting: the prompt renders a state with json.dumps, which recurses a frame a level
# (Python stops at 1,000); no SystemOne field needs more than a few levels
MAX_DEPTH = 200
_SURROGATE = re.compile("[\ud800-\udfff]")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
DATA_URL = re.compile(r"^data:(?P<type>image/[\w.+-]+)?(?:;[\w=.+-]+)*;base64,(?P<data>.*)$", re.S)


class RequestError(ValueError):
    """One request that cannot be answered: the field, why, and the HTTP status that says it."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status, self.reason = field, status, message


@dataclass(frozen=True)
class Image:
    """A request's image, decoded (RGB, EXIF orientation applied) and where it came from."""

    pil: Any
    source: str  # "data URL", "base64", or the file's path
    media_kwargs: dict[str, Any]


def _where(path: list[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path)) or "body"


def safe_text(text: str) -> str:
    """``text`` with any lone surrogate written as its escape: an error message that quotes a
    request's own strings still encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_text(body: Any) -> None:
    """A parsed body nested at most ``MAX_DEPTH`` deep and holding only valid Unicode (JSON's
    ``\\ud800`` escape decodes to a lone surrogate, which no tokenizer or UTF-8 writer takes):
    ``RequestError`` 400 naming the first field that is not. A loop, not recursion: the body's depth
    is what is being checked."""
    todo: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while todo:
        value, path = todo.pop()
        if len(path) > MAX_DEPTH:
            raise RequestError(_where(list(path[:3])) + "…", f"nested more than {MAX_DEPTH} deep")
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise RequestError(safe_text(_where(list(path))), "holds a lone UTF-16 surrogate (not valid Unicode)")
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    raise RequestError(safe_text(_where([*path, k])), "a key holds a lone UTF-16 surrogate (not valid Unicode)")
                if isinstance(v, (str, dict, list)):
                    todo.append((v, (*path, k)))
        elif isinstance(value, list):
            todo.extend((v, (*path, i)) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))


def parse_body(raw: bytes | str) -> Any:
    """A request body parsed and ``check_text``-checked; ``RequestError`` 400 when it is not JSON
    (nesting past the parser's own recursion included) or not valid Unicode."""
    import json

    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("body", f"nested too deep to parse (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # UnicodeDecodeError included: bytes that are not UTF-8
        raise RequestError("body", f"not JSON ({safe_text(str(exc))[:200]})") from None
    check_text(body)
    return body


def check_body(body: Any) -> None:
    """What ``systemone`` and the head take, or ``RequestError`` naming the first field that is not."""
    if not isinstance(body, dict):
        raise RequestError("body", "not a JSON object")
    if not isinstance(body.get("model"), str):
        raise RequestError("model", "required, a string")
    if "state" not in body:
        raise RequestError("state", "required (a string, an object or an array)")
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise RequestError("questions", "at least one question is required (an object of questions by id)")
    for qid, q in questions.items():
        where = f"questions.{qid}"
        if not isinstance(q, dict):
            raise RequestError(where, "not an object")
        if q.get("type") not in QUESTION_TYPES:
            raise RequestError(f"{where}.type", f"must be noul, choice or score, got {q.get('type')!r}")
        crit = q.get("criteria")
        if q["type"] == "choice" and (not isinstance(crit, dict) or not crit):
            raise RequestError(f"{where}.criteria", "a choice needs an object of options")
        if q["type"] == "score" and (not isinstance(crit, list) or not crit):
            raise RequestError(f"{where}.criteria", "a score needs a list of levels")
        if q["type"] == "noul" and crit is not None and (not isinstance(crit, dict) or set(crit) - {"true", "false"}):
            raise RequestError(f"{where}.criteria", "a noul's criteria may only describe true and false")
    if body.get("videos"):
        raise RequestError("videos", "videos are not supported (images only)")
    images = body.get("images")
    if images is not None and not isinstance(images, list):
        raise RequestError("images", "a list of images")
    if images and len(images) > MAX_IMAGES:
        raise RequestError("images", f"{len(images)} images; the decoder takes {MAX_IMAGES} image a request", 422)
    kwargs = body.get("media_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or set(kwargs) - set(MEDIA_KWARGS)):
        raise RequestError("media_kwargs", f"may hold {', '.join(MEDIA_KWARGS)} only")


def _encoded_bytes(item: Any, base: Path | None) -> tuple[bytes, str]:
    """An image item's bytes: a data URL, ``{content_type, base64}``, or (``base`` given: the CLI) a
    file path relative to ``base``. A URL is never fetched."""
    if isinstance(item, dict):
        if set(item) - {"content_type", "base64"} or not isinstance(item.get("base64"), str):
            raise RequestError("images[0]", "an object needs content_type and base64 (and nothing else)")
        if not str(item.get("content_type", "")).startswith("image/"):
            raise RequestError("images[0].content_type", f"must be an image/* type, got {item.get('content_type')!r}")
        data, source = item["base64"], "base64"
    elif isinstance(item, str) and item.startswith("data:"):
        m = DATA_URL.match(item)
        if m is None:
            raise RequestError("images[0]", "a data URL must be data:image/<type>;base64,<data>")
        data, source = m.group("data"), "data URL"
    elif isinstance(item, str) and "://" in item:
        raise RequestError("images[0]", "URLs are never fetched: send a data URL or {content_type, base64}")
    elif isinstance(item, str) and item and base is not None:
        path = (base / item).resolve()
        if not path.is_file():
            raise RequestError("images[0]", f"{item}: file not found (looked for {path})")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise RequestError("images[0]", f"{path}: {path.stat().st_size} bytes; at most {MAX_IMAGE_BYTES}", 413)
        return path.read_bytes(), str(path)
    else:
        raise RequestError("images[0]", "a data URL or {content_type, base64}")
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RequestError("images[0]", f"over {MAX_IMAGE_BYTES} bytes once decoded", 413)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("images[0]", "not valid base64") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise RequestError("images[0]", f"{len(raw)} bytes; at most {MAX_IMAGE_BYTES}", 413)
    return raw, source


def read_image(body: dict[str, Any], base: Path | None = None) -> Image | None:
    """The request's image decoded as transformers' ``load_image`` opens one (EXIF orientation, RGB),
    or None. ``base``: the folder image paths are relative to (the CLI's requests file); None (the
    server): paths are refused."""
    from PIL import Image as PILImage, ImageOps, UnidentifiedImageError

    images = body.get("images") or []
    if not images:
        return None
    raw, source = _encoded_bytes(images[0], base)
    try:
        with PILImage.open(io.BytesIO(raw)) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise RequestError("images[0]", f"{w} x {h} pixels; at most {MAX_IMAGE_PIXELS}", 413)
            pil = ImageOps.exif_transpose(im).convert("RGB")
    except RequestError:
        raise
    except PILImage.DecompressionBombError:  # Pillow's own check, past twice its pixel limit: too large, as above
        raise RequestError("images[0]", f"a decompression bomb (Pillow refuses it); at most {MAX_IMAGE_PIXELS} pixels", 413) from None
    except UnidentifiedImageError:
        raise RequestError("images[0]", "not an image Pillow can decode (no format it knows)") from None
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file; the message never holds an address
        why = _ADDRESS.sub("", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:120]
        raise RequestError("images[0]", f"not an image Pillow can decode ({why})") from None
    return Image(pil=pil, source=source, media_kwargs=dict(body.get("media_kwargs") or {}))
