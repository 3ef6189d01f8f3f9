"""``host-vectors.jsonl``: what each host step gives for a few requests (text, an image, each
question type), written into every release with a decoder, so that a host in another language can
prove itself step by step; ``answer --vectors`` checks this Python host against it.

The first line is the header (the release, the tolerances with their reasons); each next line one
request: its body (an image inline as a data URL), then per step what the host must give. Exact
steps (token ids, spans, the image's grid, its patches, the head's structural inputs and lexical
rows) are compared bit for bit; the assets' outputs (image rows, hidden rows, logits) within the
tolerances, since a Mac computes them in fp16 on its GPU."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 1
EXACT_INPUTS = ("key_valid", "q_avg", "o_avg", "g_avg", "lexical", "member", "type_ids", "q_valid", "o_valid")
SHOWN = 16  # values shown of each row
TOLERANCES = {
    "image_rows": {"rel_max_abs_d": 2e-2, "reason": "the tower in fp16 on a Mac GPU against this run (the decoder's own bar)"},
    "hidden_rows": {"rel_max_abs_d": 2e-2, "reason": "the decoder in fp16 on a Mac GPU against this run"},
    "probabilities": {"max_abs_d": 2e-2, "reason": "the published port's bar on every option's probability"},
}


def digest(a: np.ndarray) -> str:
    """sha256 of an array's little-endian bytes in C order (dtype and shape are stated beside it)."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


def _png(width: int, height: int) -> str:
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x ^ y) & 255], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def requests(with_image: bool) -> list[dict[str, Any]]:
    """The vectors' requests: each question type, several at once, unicode, a state as an object and
    as an array, and (a decoder with image inputs and a tower) one image."""
    out = [
        {"id": "noul", "model": "clef-flash", "state": "The parcel arrived crushed; the customer wants a refund.",
         "questions": {"refund": {"type": "noul", "instructions": "Should we refund?"}}},
        {"id": "choice", "model": "clef-flash", "state": {"ticket": 88213, "text": "Card declined twice ✓ — 数据"},
         "questions": {"team": {"type": "choice", "instructions": "Owning team?",
                                "criteria": {"billing": "Charges.", "shipping": "Delivery.", "returns": None}}}},
        {"id": "score", "model": "clef", "state": ["first message", {"second": "message"}, 3],
         "questions": {"severity": {"type": "score", "instructions": "How bad?", "criteria": ["low", "mid", "high", "critical"]}}},
        {"id": "mixed", "model": "clef-flash", "state": "Desk (order 88213) came with a cracked leg.",
         "questions": {"escalate": {"type": "noul", "criteria": {"true": "Act today."}},
                       "team": {"type": "choice", "instructions": {"ask": "which team"}, "criteria": {"b": "Billing", "s": "Shipping"}},
                       "tone": {"type": "score", "instructions": "", "criteria": ["calm", "upset"]}}},
    ]
    if with_image:
        out.append({"id": "image", "model": "clef-flash", "state": "What does the banner show?", "images": [_png(96, 64)],
                    "questions": {"kind": {"type": "choice", "instructions": "What is it?",
                                           "criteria": {"banner": "A banner.", "photo": "A photo."}}}})
    return out


def _rows(a: np.ndarray, which: dict[str, int]) -> dict[str, Any]:
    return {name: {"index": int(i), "first": [float(x) for x in a[i, :SHOWN]], "max_abs": float(np.abs(a[i]).max())}
            for name, i in which.items()}


def vector(body: dict[str, Any], answered) -> dict[str, Any]:
    """One request's line: what each step gave."""
    enc, st = answered.encoded, answered.steps
    out: dict[str, Any] = {"id": body["id"], "request": body,
                           "encode": {"ids": list(enc.ids), "global_position": enc.global_position,
                                      "questions": [{"id": q.question_id, "type": q.question_type, "span": list(q.question_span),
                                                     "options": [list(o) for o in q.option_spans], "option_ids": list(q.option_ids)}
                                                    for q in enc.questions],
                                      "image": None if enc.image is None else {"start": enc.image.start, "tokens": enc.image.tokens}}}
    if st["patches"] is not None:
        out["image"] = {"grid": [st["grid"].rows, st["grid"].cols], "merged": list(st["grid"].merged),
                        "patches": {"shape": list(st["patches"].shape), "dtype": "float32", "sha256": digest(st["patches"])},
                        "rows": _rows(st["image_rows"], {"first": 0, "last": len(st["image_rows"]) - 1})}
    hidden = st["hidden"]
    out["decoder"] = {"tokens": len(enc.ids), "function": answered.decoder, "rows": _rows(hidden, {"first": 0, "global": enc.global_position,
                                                                     "first_option": enc.questions[0].option_spans[0][0]})}
    arrays = st["head_inputs"]
    out["head"] = {"bundle": answered.head, "function": answered.bucket, "inputs": {n: {"shape": list(arrays[n].shape), "dtype": str(arrays[n].dtype),
                                                               "sha256": digest(arrays[n])} for n in EXACT_INPUTS}}
    out["logits"] = [float(x) for x in answered.logits]
    out["probabilities"] = {q.question_id: [float(x) for x in p] for q, p in zip(enc.questions, st["probabilities"], strict=True)}
    out["answers"] = answered.response["answers"]
    return out


async def _answer_all(dist, bodies: list[dict[str, Any]], engine: str = "auto", log=lambda msg: None):
    """Every body answered, its steps kept; and what ran the decoder (``EngineInfo.describe``)."""
    from .model import ClefHost

    async with ClefHost(dist, engine) as host:
        log(f"host vectors: the decoder on {host.engine.describe()} ({host.choice.why})")
        from ..progress import slow_progress

        return [await host.answer(b, keep=True, on_layer=slow_progress(f"host vector {i + 1}", log))
                for i, b in enumerate(bodies)], host.engine.describe()


def header(dist, engine: str) -> dict[str, Any]:
    m = dist.head.manifest
    return {"kind": "clef-host-vectors", "version": VERSION, "release": {"hf_id": m.head.source.hf_id,
            "revision": m.head.source.revision}, "bundles": dist.digests(), "tolerances": TOLERANCES,
            "exact": "ids, spans, option ids, the image's grid and patches, the head's inputs " + ", ".join(EXACT_INPUTS),
            "engine": engine}


def write_vectors(dist, path: Path, log=lambda msg: None) -> int:
    """The vectors of an opened release, written to ``path``; how many requests."""
    from ..bundle import atomic_write_bytes
    from ..interrupts import run_async

    images = dist.vision is not None and dist.backbone.manifest.interface.vision is not None
    bodies = requests(images)
    log(f"host vectors: {len(bodies)} requests through the shipped assets")
    answered, engine = run_async(lambda: _answer_all(dist, bodies, log=log))
    lines = [header(dist, engine)] + [vector(b, a) for b, a in zip(bodies, answered, strict=True)]
    atomic_write_bytes(path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8"))
    return len(bodies)


@dataclass(frozen=True)
class Step:
    request: str
    step: str
    ok: bool
    detail: str


def _row_d(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest deviation of the shown values of each row, relative to the row's max |x|."""
    return max(abs(a - b) / max(want[k]["max_abs"], 1e-30) for k in want for a, b in zip(got[k]["first"], want[k]["first"]))


def compare(want: dict[str, Any], got: dict[str, Any], tol: dict[str, Any]) -> list[Step]:
    """This host's line (``got``, made by ``vector``) against the file's, step by step."""
    rid, out = want["id"], []

    def step(name: str, ok: bool, detail: str) -> None:
        out.append(Step(rid, name, bool(ok), detail))

    ids_w, ids_g = want["encode"]["ids"], got["encode"]["ids"]
    first = next((i for i, (a, b) in enumerate(zip(ids_g, ids_w)) if a != b), None)
    step("token ids", ids_w == ids_g, f"{len(ids_g)} tokens" if ids_w == ids_g else
         f"first difference at token {first if first is not None else min(len(ids_g), len(ids_w))}")
    step("spans and option ids", want["encode"]["questions"] == got["encode"]["questions"]
         and want["encode"]["image"] == got["encode"]["image"], f"{len(want['encode']['questions'])} questions")
    if "image" in want:
        w, g = want["image"], got.get("image") or {}
        step("image grid and patches", w["grid"] == g.get("grid") and w["patches"] == g.get("patches"), f"grid {w['grid']}")
        d = _row_d(g["rows"], w["rows"])
        step("image rows", d <= tol["image_rows"]["rel_max_abs_d"], f"rel max |d| {d:.2e}")
    d = _row_d(got["decoder"]["rows"], want["decoder"]["rows"])
    # the decoder's function (files written before functions by context name none: one function then)
    fn = want["decoder"].get("function", got["decoder"].get("function")), got["decoder"].get("function")
    step("hidden rows", d <= tol["hidden_rows"]["rel_max_abs_d"] and fn[0] == fn[1],
         f"rel max |d| {d:.2e}" + (f", {fn[1]}" if fn[0] == fn[1] else f"; the decoder ran {fn[1]}, the file's {fn[0]}"))
    bad = [n for n in EXACT_INPUTS if want["head"]["inputs"][n] != got["head"]["inputs"].get(n)]
    step("head inputs", not bad and want["head"]["function"] == got["head"]["function"],
         f"{want['head']['function']}, {len(EXACT_INPUTS)} inputs bit for bit" if not bad else f"differ: {', '.join(bad)}")
    dp = max((abs(a - b) for q in want["probabilities"] for a, b in zip(got["probabilities"].get(q, []), want["probabilities"][q])),
             default=float("inf"))
    step("probabilities", dp <= tol["probabilities"]["max_abs_d"], f"max |d p| {dp:.2e}")
    same = [q for q in want["answers"] if q in got["answers"] and want["answers"][q].get("choice") == got["answers"][q].get("choice")]
    step("answers", len(same) == len(want["answers"]), f"{len(same)}/{len(want['answers'])} chosen equal")
    return out


def check_vectors(dist, path: Path, log=lambda msg: None, engine: str = "auto") -> list[Step]:
    """Every vector of ``path`` run through this host (its decoder on ``engine``) and compared step by step."""
    from ..errors import IntegrityError
    from ..interrupts import run_async

    try:
        lines = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing (a release with a decoder ships host/host-vectors.jsonl)") from None
    except ValueError as exc:
        raise IntegrityError(f"{path}: not JSON lines ({exc})") from None
    if not lines or lines[0].get("kind") != "clef-host-vectors" or lines[0].get("version") != VERSION:
        raise IntegrityError(f"{path}: not a version {VERSION} clef-host-vectors file")
    head, vectors = lines[0], lines[1:]
    log(f"host vectors: {len(vectors)} requests, step by step")
    answered, engine = run_async(lambda: _answer_all(dist, [v["request"] for v in vectors], engine, log))
    steps: list[Step] = []
    for want, a in zip(vectors, answered, strict=True):
        steps += compare(want, json.loads(json.dumps(vector(want["request"], a))), head["tolerances"])
    return steps
