"""``check-release``: the shipped head answers real requests like the author's model.

1. the bundle against its manifest, the release's head files against the manifest's source
   hashes (the head the bundle was built from), the author's file known or trusted;
2. the requests (JSONL of SystemOne request bodies; ``conversion/requests.jsonl`` by default),
   each checked and encoded with the author's ``encode_record``; what does not fit the bundle's
   buckets and pads is listed with the reason, never cut and never silently skipped;
3. the reference: the author's ``systemone`` on the release's own backbone and head
   (``reference.Reference``), its head's inputs and outputs recorded;
4. the shipped path on the same hidden rows: ``host.head_inputs`` with the exported lm_head table
   (``--table``, or built from the release into a temporary folder), the bundle's function for the
   record's bucket run by the Core AI runtime, ``host.question_probs`` and ``host.answers``;
5. per question, the answers field by field and the probabilities before rounding; a checklist,
   a transcript, and ``NumericError`` (exit 4) on any disagreement.

With ``--backbone`` (a backbone bundle of the same release, ``backbone.shipped``) step 4 starts one
stage earlier: the token ids the release's tokenizer gave go through the backbone asset chunk by
chunk with its states, and the head asset reads those hidden rows instead of the reference's: the
whole model a Mac host runs. The bar is then the backbone's (``BACKBONE_BARS``) when wider.

With ``--vision`` too (a vision bundle of the same release, ``vision.shipped``), a request's image
goes the way a Mac host sends it: the file through the host's preprocessing (numpy + Pillow; held
bit for bit to the pixels the author's processor gave), the tower asset at the image's native grid
(the bucket that holds it; over the cap it does not fit), its rows into the backbone asset's image
inputs at the image's tokens, then the head asset. Without ``--backbone`` an image request runs the
head on the reference's rows, as text requests do.

A red arm (``--red spans``, ``lexical``, ``state`` with ``--backbone``, ``image`` with ``--vision``)
perturbs the shipped path only; it must fail.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError, ToolchainError, UsageError
from ..interrupts import gather_all, run_async
from ..progress import plural
from ..sources.requests import default_requests, load_requests

# Bars on the probabilities before the author's rounding, by the reference's dtype; data, each
# with its reason, written into the transcript.
BARS: dict[str, tuple[float, str]] = {
    "float32": (1e-5, "same hidden rows on both sides; the author's head in fp32 vs the asset's fp32 math on fp16-stored "
                      "bf16 weights (exact) and fp16 lexical rows of bf16 lm_head rows (exact in fp16's normal range): "
                      "only accumulation order differs, the bar of `verify`"),
    "bfloat16": (5e-3, "the author's head computes in bf16 (8-bit mantissa, about 4e-3 relative per operation) while "
                       "the asset computes in fp32 on the same rows; measured 1.4e-3 on the tiny release, not yet on a real one"),
}
# With ``--backbone`` the hidden rows are the backbone asset's, so the bar is the backbone's when wider.
BACKBONE_BARS: dict[str, dict[str, Any]] = {
    "fp32": {"max_abs_dp": 1e-5, "mean_abs_dp": None,
             "reason": "the backbone computes in fp32 on fp16-stored bf16 weights (exact): its hidden rows are the "
                       "reference's up to fp32 accumulation order (the backbone gate's 1e-5 relative), and the head's "
                       "bar must still hold"},
    "fp16": {"max_abs_dp": 0.02, "mean_abs_dp": 0.002,
             "reason": "the backbone computes in fp16 as Mac hosts run it (about 1e-3 relative on its hidden rows): "
                       "the published port's bar (max 0.02, mean 0.002, argmax equal where the margin exceeds 0.02; "
                       "it measured 0.0112 on a Mac GPU)"},
    # compressed weights (either compute): the quantization moves the answers; the published port's bar
    "compressed": {"max_abs_dp": 0.02, "mean_abs_dp": 0.002,
                   "reason": "int8 / int4 weights: the quantization's cost end to end, against the published port's bar "
                             "(max 0.02, mean 0.002, argmax equal where the margin exceeds 0.02; its int8 with layers 0-11 "
                             "fp16 measured 0.0153 on a Mac GPU, every layer int8 0.075)"},
}
# state: the backbone's states not carried between chunks (--backbone); image: the image's rows zeroed
# in the decoder's inputs (--vision)
RED_ARMS = ("spans", "lexical", "state", "image")
# the published port squashes an image to a square tile; its own measurement against native grids at 448^2
PORT_SQUARE_TILE_DP = 0.44
# question outcomes; only "disagree" fails
EQUAL, NEAR_TIE, ROUNDED, DISAGREE = "equal", "near-tie", "rounded-digits", "disagree"


@dataclass(frozen=True)
class CheckConfig:
    release: Path
    bundle: Path
    table: Path | None = None
    requests: Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    red: str | None = None
    backbone: Path | None = None  # a backbone bundle of this release: its asset computes the hidden rows
    vision: Path | None = None  # a vision bundle of this release: its asset computes an image's rows


# ---------------------------------------------------------------- the release and its table


def _trusted(release: Path) -> str | None:
    """The author file's sha256 the release's own pins trust (``pin --trust-author-code``), if any."""
    from ..sources.pins import load_pins

    return load_pins(release / "pins.json").trusted_author_sha256 if (release / "pins.json").is_file() else None


def _release_module(release: Path, manifest: Any):
    """The release's head files must be the ones the bundle was built from; the author's file
    runs only when known, or trusted by the release's pins."""
    from ..sources.author import check_author_trusted, load_author_module, load_config, load_state
    from ..digest import sha256_file
    from ..sources.pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE

    src = manifest.head.source
    want = {CODE_FILE: src.joint_schema_model_sha256, CONFIG_FILE: src.joint_head_config_sha256,
            WEIGHTS_FILE: src.joint_head_safetensors_sha256}
    for name, sha in want.items():
        path = release / name
        if not path.is_file():
            raise IntegrityError(f"{path}: missing; a release folder holds the head's three files")
        got = sha256_file(path)
        if got != sha:
            raise IntegrityError(f"{path}: sha256 {got[:12]}… is not the bundle's ({sha[:12]}…, {src.hf_id}): "
                                 "the bundle was built from another head")
    check_author_trusted(release / CODE_FILE, want[CODE_FILE], _trusted(release))
    module = load_author_module(release / CODE_FILE, want[CODE_FILE])
    for attr in ("encode_record", "systemone", "ClefModel"):
        if not hasattr(module, attr):
            raise IntegrityError(f"{release / CODE_FILE}: the author's module has no {attr}")
    config = load_config(release / CONFIG_FILE, want[CONFIG_FILE])
    state = load_state(release / WEIGHTS_FILE, want[WEIGHTS_FILE])
    return module, config, state


def _lm_head_file(release: Path) -> Path:
    """The release's checkpoint file that holds ``lm_head.weight`` (through its index when sharded)."""
    from ..sources.lm_head import INDEX_FILE, SINGLE_FILE, TENSOR
    from ..sources.pinning import lm_head_shard

    index_path = release / INDEX_FILE
    if not index_path.is_file():
        return release / SINGLE_FILE
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{index_path}: not JSON ({exc})") from None
    shard = lm_head_shard(index, str(release))
    if shard is None:
        raise IntegrityError(f"{index_path}: no weight_map entry for {TENSOR}")
    return release / shard


def _open_given_table(table: Path, release: Path) -> tuple[np.memmap, dict[str, Any]]:
    """A table made by ``lm-head-table``, whose sidecar says it came from this release's lm_head."""
    from ..digest import sha256_file
    from ..sources.lm_head import SIDECAR_FILE, open_table

    table = Path(table)
    sidecar_path = table.parent / SIDECAR_FILE
    if not table.is_file():
        raise UsageError(f"{table}: table not found")
    try:
        sidecar = json.loads(sidecar_path.read_text())
        made_from = sidecar["source"]["sha256"]
    except FileNotFoundError:
        raise IntegrityError(f"{sidecar_path}: missing; without its sidecar the table's origin is unknown") from None
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{sidecar_path}: not an lm-head-table sidecar") from None
    lm_file = _lm_head_file(release)
    have = sha256_file(lm_file)
    if have != made_from:
        raise IntegrityError(f"{table}: made from a file with sha256 {made_from[:12]}…, not this release's "
                             f"{lm_file.name} ({have[:12]}…)")
    return open_table(table), {"table": str(table), "built": False, "sha256": sidecar.get("sha256"),
                               "source_file": lm_file.name}


def _build_table(release: Path, tmp: Path, log) -> tuple[np.memmap, dict[str, Any]]:
    """``lm-head-table`` of the release into a temporary folder (pins made on the fly)."""
    from ..sources.lm_head import TABLE_FILE, lm_head_table, open_table
    from ..sources.pinning import pin_local

    pins, pins_path = pin_local(release, tmp / "pins.json", trust_author=_trusted(release))
    result = lm_head_table(release, pins, pins_path, tmp / "table", log=log)
    return open_table(tmp / "table" / TABLE_FILE), {"table": "built from the release", "built": True,
                                                    "sha256": result["sha256"], "source_file": result["source"]["file"]}


class NextRowTable:
    """Red arm ``lexical``: every id reads the next id's row, as a table of another release would
    give other rows (a view: nothing is copied)."""

    def __init__(self, table: Any):
        self.table = table
        self.shape = table.shape

    def __getitem__(self, ids: Any) -> Any:
        return self.table[(np.asarray(ids) + 1) % self.shape[0]]


def _shift_spans(questions: Any, length: int) -> list[Any]:
    """Red arm ``spans``: every question and option span one token late (one early at the end)."""
    from ..head.host import Question

    def move(span: tuple[int, int]) -> tuple[int, int]:
        s, e = span
        return (s + 1, e + 1) if e < length else (s - 1, e - 1)

    return [Question(question_type=q.question_type, question_span=move(q.question_span),
                     option_spans=tuple(move(sp) for sp in q.option_spans), option_ids=q.option_ids,
                     question_id=q.question_id) for q in questions]


# ---------------------------------------------------------------- comparing answers


def _argmax(p: np.ndarray) -> int:
    return int(np.argmax(p))  # first of equals, as max() in the author's systemone_answer


def compare_question(spec: dict[str, Any], ref: dict[str, Any], got: dict[str, Any], p_ref: np.ndarray,
                     p_got: np.ndarray, option_ids: tuple[str, ...], bar: float) -> dict[str, Any]:
    """One question's answers field by field, with the probabilities before rounding.

    ``disagree`` when any probability moved by more than the bar, when the answers differ in
    what no probability noise explains (type, keys, legend, options), or when the chosen option
    differs while the two options are not within the bar of each other; ``near-tie`` when the
    chosen option (or argmax) differs between two options within the bar of each other;
    ``rounded-digits`` when only rounded numbers differ while every probability is within the bar
    (in fp32, a value on the other side of a 4th-decimal edge); ``equal`` otherwise."""
    dp = float(np.abs(p_ref.astype(np.float64) - p_got.astype(np.float64)).max())
    fields = sorted(set(ref) | set(got))
    differ = [k for k in fields if ref.get(k) != got.get(k)]
    out: dict[str, Any] = {"max_abs_dp": dp, "argmax_equal": _argmax(p_ref) == _argmax(p_got), "fields_differ": differ}
    reasons = []
    if dp > bar:
        reasons.append(f"max |d p| {dp:.3g} > {bar:g}")
    structural = [k for k in differ if k in ("type", "legend") or k not in ref or k not in got]
    if "probabilities" in differ and set(ref.get("probabilities", {})) != set(got.get("probabilities", {})):
        structural.append("probabilities (options)")
    if structural:
        reasons.append(f"differ in {', '.join(structural)}")
    tie = False
    a, b = _argmax(p_ref), _argmax(p_got)
    if a != b:
        gap = min(abs(float(p_ref[a]) - float(p_ref[b])), abs(float(p_got[a]) - float(p_got[b])))
        out["tie"] = {"reference": option_ids[a], "shipped": option_ids[b], "gap": gap}
        if gap <= bar:
            tie = True
        else:
            reasons.append(f"chose {option_ids[b]!r}, the author {option_ids[a]!r} (gap {gap:.3g} > {bar:g})")
    if spec["type"] == "choice" and ref.get("choice") != got.get("choice") and a == b:
        reasons.append(f"choice {got.get('choice')!r} vs the author's {ref.get('choice')!r} with the same argmax")
    if reasons:
        out["status"], out["why"] = DISAGREE, "; ".join(reasons)
    elif tie:
        out["status"] = NEAR_TIE
    elif differ:
        out["status"] = ROUNDED
    else:
        out["status"] = EQUAL
    return out


# ---------------------------------------------------------------- the check


@dataclass
class CheckReport:
    checks: list[tuple[str, bool, str]]
    transcript: dict[str, Any]
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _check_kinds(bundle: Path, backbone: Path | None, vision: Path | None = None) -> None:
    from ..gate import kind_of

    as_option = {"head": "--bundle", "backbone": "--backbone", "vision": "--vision"}
    for path, want in ((bundle, "head"), (backbone, "backbone"), (vision, "vision")):
        if path is None:
            continue
        got = kind_of(Path(path)).MODEL
        if got != want:
            raise UsageError(f"{path}: this is a {got} bundle: pass it as {as_option[got]}, and the {want} bundle as "
                             f"{as_option[want]}")


@dataclass
class _Shipped:
    """The bundles a check runs, opened and checked against the release, and the bar they set."""

    manifest: Any
    fmt: Any
    asset: Path
    checks: list[tuple[str, bool, str]]
    module: Any
    config: Any
    state: Any
    bar: float
    bar_reason: str
    mean_bar: float | None = None
    backbone: Any = None
    vision: Any = None

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.manifest.head.buckets)

    @property
    def names(self) -> dict[int, str]:
        return {b: name for name, b in self.manifest.head.buckets}

    @property
    def pads(self) -> tuple[int, int]:
        from ..manifest import pads

        return pads(self.manifest.head)


@dataclass
class _Tally:
    """The comparison of every answered question, summed as the transcript reports it."""

    failures: list[str] = field(default_factory=list)
    outcome: Counter = field(default_factory=Counter)
    max_dp: float = 0.0
    argmax_equal: int = 0
    questions: int = 0
    tokens_equal: int = 0
    dp_sum: float = 0.0  # over every option probability: the mean bar of an fp16 backbone
    dp_count: int = 0

    @property
    def mean_dp(self) -> float:
        return self.dp_sum / self.dp_count if self.dp_count else 0.0


def _check_options(cfg: CheckConfig, release: Path, bundle: Path) -> None:
    """Every option, and which bundle is which, refused before any work."""
    if cfg.red is not None and cfg.red not in RED_ARMS:
        raise UsageError(f"--red must be one of {', '.join(RED_ARMS)}, got {cfg.red!r}")
    if cfg.dtype not in BARS:
        raise UsageError(f"--dtype must be one of {', '.join(BARS)}, got {cfg.dtype!r}")
    if cfg.red == "state" and cfg.backbone is None:
        raise UsageError("--red state perturbs the backbone's host loop: it needs --backbone")
    if cfg.red == "image" and (cfg.backbone is None or cfg.vision is None):
        raise UsageError("--red image zeroes the image's rows in the backbone's inputs: it needs --backbone and --vision")
    if cfg.vision is not None and cfg.backbone is None:
        raise UsageError("--vision feeds the tower's rows to the backbone asset: it needs --backbone")
    if not release.is_dir():
        raise UsageError(f"{release}: release folder not found")
    _check_kinds(bundle, cfg.backbone, cfg.vision)  # a bundle passed in another's place: said at once, by name


def _open_shipped(cfg: CheckConfig, release: Path, bundle: Path) -> _Shipped:
    """The head bundle (and the backbone and vision bundles) against the release; the widest bar."""
    from ..backbone.shipped import open_backbone
    from ..gate.artifact import check_bundle
    from ..vision.shipped import open_vision

    manifest, fmt, asset, checks = check_bundle(bundle)
    bad = [f"{n}: {d}" for n, ok, d in checks if not ok]
    if bad:
        raise IntegrityError(f"{bundle}: {bad[0]}")
    why_not = fmt.cannot_run()
    if why_not:
        raise ToolchainError(f"{bundle}: cannot run its {fmt.FORMAT} asset on this machine ({why_not})")
    module, config, state = _release_module(release, manifest)
    bar, bar_reason = BARS[cfg.dtype]
    side = _Shipped(manifest, fmt, asset, checks, module, config, state, bar, bar_reason)
    hashed: dict[str, str] = {}  # release file -> sha256, taken once for the backbone and the tower
    if cfg.backbone is not None:
        side.backbone = open_backbone(Path(cfg.backbone), release, config.hidden_size, hashed)
        checks.extend(side.backbone.checks)
        bb_bar = BACKBONE_BARS["compressed" if side.backbone.manifest.export.weights != "fp16" else side.backbone.compute]
        if bb_bar["max_abs_dp"] > bar:
            side.bar, side.bar_reason = bb_bar["max_abs_dp"], bb_bar["reason"]
        else:
            side.bar_reason = f"{bar_reason}; {bb_bar['reason']}"
        side.mean_bar = bb_bar["mean_abs_dp"]
    if cfg.vision is not None:
        side.vision = open_vision(Path(cfg.vision), release, config.hidden_size, hashed)
        checks.extend(side.vision.checks)
    return side


def _table(cfg: CheckConfig, release: Path, tmp: Path, hidden_size: int, log) -> tuple[Any, dict[str, Any]]:
    """The lm_head table the host reads: the one given, or one built from the release."""
    table, info = _open_given_table(cfg.table, release) if cfg.table is not None else _build_table(release, tmp, log)
    if table.shape[1] != hidden_size:
        raise IntegrityError(f"{info['table']}: rows of {table.shape[1]} values; the head's hidden size is {hidden_size}")
    return table, info


def _fit(req, entry: dict[str, Any], encoded, side: _Shipped, prepared: dict[int, Any], index: int) -> int | None:
    """The bucket a request runs in, its image prepared; None (the reason in ``entry``) when it does not fit."""
    from ..head.host import HostInputError, check_fits
    from ..vision.shipped import prepare

    q_pad, o_pad = side.pads
    backbone, vision = side.backbone, side.vision
    try:
        bucket = check_fits(len(encoded.input_ids), encoded.questions, q_pad=q_pad, o_pad=o_pad, buckets=side.buckets)
        if req.images and vision is not None:
            im = prepare(vision, req.images[0], req.body.get("media_kwargs"))
            entry["image"].update({"tokens": im.grid.tokens, "grid": list(im.grid.merged)})
            if im.bucket is None:
                raise HostInputError(f"{im.grid.tokens} vision tokens ({im.grid.merged[0]} x {im.grid.merged[1]}) "
                                     f"exceed the vision asset's cap of {vision.cap} (media_kwargs max_pixels "
                                     f"bounds an image)")
            rows = backbone.manifest.interface.vision.image_rows
            if im.grid.tokens > rows:
                raise HostInputError(f"{im.grid.tokens} vision tokens exceed the backbone's {rows} image rows")
            prepared[index] = im
        too_long = backbone.does_not_fit(entry["tokens"]) if backbone is not None else None
        if too_long:
            raise HostInputError(too_long)
    except HostInputError as exc:
        entry["does_not_fit"] = str(exc)
        return None
    return bucket


def _reference_pass(cfg: CheckConfig, requests, ref_model, side: _Shipped):
    """The reference side, request by request: (entries, [(entry index, Seen, the questions the host
    reads, bucket)], entry index -> the host's prepared image)."""
    from ..progress import progress

    entries: list[dict[str, Any]] = []
    seen_by: list[tuple[int, Any, Any, int]] = []
    prepared: dict[int, Any] = {}
    with progress("reference: the author's systemone", len(requests), "requests") as tick:
        for req in requests:
            tick()
            i = len(entries)
            entry: dict[str, Any] = {"id": req.id, "line": req.line, "questions": len(req.body["questions"])}
            entries.append(entry)
            if req.images:
                entry["image"] = {"file": str(req.images[0])}
                why = image_not_run(ref_model, side.backbone, side.vision)
                if why:
                    entry["tokens"], entry["options"], entry["does_not_fit"] = 0, 0, why
                    continue
            encoded = ref_model.encode(req.body)
            entry["tokens"] = len(encoded.input_ids)
            entry["options"] = sum(len(q.option_spans) for q in encoded.questions)
            bucket = _fit(req, entry, encoded, side, prepared, i)
            if bucket is None:
                continue
            entry["function"] = side.names[bucket]
            response, seen = ref_model.answer(req.body)
            if tuple(seen.ids.tolist()) != tuple(encoded.input_ids):
                raise RuntimeError(f"request {req.id}: systemone encoded other tokens than encode_record")
            entry["reference"] = response
            if i in prepared:
                im = prepared[i]
                theirs = np.asarray(seen.record.media["pixel_values"])
                entry["image"]["host_patches_equal"] = bool(theirs.shape == im.patches.shape and np.array_equal(theirs, im.patches))
                entry["image"]["host_prompt_equal"] = host_prompt_equal(ref_model, req.body, seen, im.grid.tokens)
                entry["image"]["function"] = f"n{im.bucket}"
            questions = seen.record.questions  # the author's EncodedQuestions are what the host reads
            if cfg.red == "spans":
                questions = _shift_spans(questions, len(seen.ids))
            seen_by.append((i, seen, questions, bucket))
    return entries, seen_by, prepared


def _hidden_rows(cfg: CheckConfig, side: _Shipped, ref_model, seen_by, prepared, entries) -> tuple[list[Any], float]:
    """The hidden rows the head reads: the reference's, or the backbone asset's on the same token ids
    (an image's rows from the tower asset); and the tower's seconds."""
    from ..backbone.shipped import hidden_rows

    spans, vision_seconds = [None] * len(seen_by), 0.0
    if prepared:
        spans, vision_seconds = _image_spans(side.vision, ref_model, seen_by, prepared, entries)
    if side.backbone is None:
        return [seen.hidden for _, seen, _, _ in seen_by], vision_seconds
    hiddens = hidden_rows(side.backbone, [seen.ids for _, seen, _, _ in seen_by], red=cfg.red, images=spans)
    for (i, seen, _, _), h in zip(seen_by, hiddens, strict=True):
        entries[i]["backbone_rel_max_abs_d"] = float(np.abs(h - seen.hidden).max()
                                                     / max(float(np.abs(seen.hidden).max()), 1e-30))
    return hiddens, vision_seconds


def _compare_all(requests, entries, jobs, logits, bar: float) -> _Tally:
    """Every answered request's questions against the author's, field by field (``compare_question``)."""
    from ..head.host import answers, question_probs

    t = _Tally()
    for (i, hi, seen), out in zip(jobs, logits, strict=True):
        entry, req = entries[i], requests[i]
        probs = question_probs(out, hi.layout)
        got = answers(req.body["questions"], seen.record.questions, probs)
        ref_answers = entry["reference"]["answers"]
        entry["shipped"] = shipped = {"model": req.body["model"], "answers": got,
                                      "usage": {"input_tokens": hi.length, "output_tokens": 0}}
        if shipped["usage"] != entry["reference"]["usage"]:
            t.failures.append(f"{req.id}: usage {shipped['usage']} vs the author's {entry['reference']['usage']}")
        else:
            t.tokens_equal += 1
        if list(got) != list(ref_answers):
            t.failures.append(f"{req.id}: answered questions {list(got)} vs the author's {list(ref_answers)}")
            continue
        per_q = {}
        for q, p_got, p_ref in zip(seen.record.questions, probs, seen.probs, strict=True):
            cmp = compare_question(req.body["questions"][q.question_id], ref_answers[q.question_id], got[q.question_id],
                                   p_ref, p_got, q.option_ids, bar)
            per_q[q.question_id] = cmp
            t.outcome[cmp["status"]] += 1
            t.questions += 1
            t.argmax_equal += int(cmp["argmax_equal"])
            t.max_dp = max(t.max_dp, cmp["max_abs_dp"])
            t.dp_sum += float(np.abs(p_ref.astype(np.float64) - p_got.astype(np.float64)).sum())
            t.dp_count += len(p_ref)
            if cmp["status"] == DISAGREE:
                t.failures.append(f"{req.id} / {q.question_id}: {cmp['why']}")
        entry["compare"] = per_q
    return t


def _image_failures(with_image: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in with_image:
        if "host_patches_equal" in e["image"] and not e["image"]["host_patches_equal"]:
            out.append(f"{e['id']}: the host's patches differ from the author's processor's pixel_values")
        if "host_prompt_equal" in e["image"] and not e["image"]["host_prompt_equal"]:
            out.append(f"{e['id']}: the host's image prompt (the text prompt, the image's N + 3 tokens inserted, "
                       f"the spans shifted) differs from the author's")
    return out


def _summary(side: _Shipped, entries, t: _Tally, seconds: dict[str, float]) -> dict[str, Any]:
    """The transcript's summary; the failures that only the whole run shows are added to ``t``."""
    fitted = [e for e in entries if "function" in e]
    if not fitted:
        t.failures.append("no request fits the bundle: nothing was compared")
    if side.mean_bar is not None and t.mean_dp > side.mean_bar:
        t.failures.append(f"mean |d p| {t.mean_dp:.3g} over {t.dp_count} probabilities > {side.mean_bar:g}")
    with_image = [e for e in fitted if "image" in e]
    t.failures.extend(_image_failures(with_image))
    used = Counter(e["function"] for e in fitted)
    bb_rel = [e["backbone_rel_max_abs_d"] for e in entries if "backbone_rel_max_abs_d" in e]
    image_dp = [c["max_abs_dp"] for e in with_image for c in e.get("compare", {}).values()]
    backbone, vision = side.backbone, side.vision
    return {
        "ok": not t.failures, "requests": len(entries), "checked": len(fitted),
        "does_not_fit": sum(1 for e in entries if "does_not_fit" in e), "questions": t.questions,
        "answers_equal": t.outcome[EQUAL], "near_ties": t.outcome[NEAR_TIE], "rounded_digits": t.outcome[ROUNDED],
        "disagreements": t.outcome[DISAGREE], "argmax_equal": t.argmax_equal, "usage_equal": t.tokens_equal,
        "max_abs_dp": t.max_dp, "bar": side.bar, "max_over_bar": t.max_dp / side.bar,
        "mean_abs_dp": t.mean_dp, "mean_bar": side.mean_bar,
        "backbone": None if backbone is None else {
            "bundle": str(backbone.bundle), "compute": backbone.compute, "weights": backbone.manifest.export.weights,
            "asset_sha256": backbone.manifest.export.main_mlirb.sha256,
            "hidden_rel_max_abs_d": max(bb_rel, default=0.0), "seconds": seconds["backbone"]},
        "images": {"requests": len(with_image), "through_vision": sum(1 for e in with_image if "function" in e["image"]),
                   "max_abs_dp": max(image_dp, default=0.0),
                   "vision_rel_max_abs_d": max((e["image"].get("vision_rel_max_abs_d", 0.0) for e in with_image), default=0.0),
                   "host_patches_equal": all(e["image"].get("host_patches_equal", True) for e in with_image),
                   "host_prompt_equal": all(e["image"].get("host_prompt_equal", True) for e in with_image),
                   "native_grid": True, "port_square_tile_max_abs_dp": PORT_SQUARE_TILE_DP,
                   "vision": None if vision is None else {"bundle": str(vision.bundle), "compute": vision.manifest.export.compute,
                                                          "asset_sha256": vision.manifest.export.main_mlirb.sha256,
                                                          "seconds": seconds["vision"]}},
        "functions_used": {name: used.get(name, 0) for name, _ in side.manifest.head.buckets},
        "seconds": {k: seconds[k] for k in ("reference", "backbone", "shipped", "total")},
    }


def _transcript(cfg: CheckConfig, side: _Shipped, entries, t: _Tally, table_info, summary) -> dict[str, Any]:
    from ..provenance import tool_versions

    manifest = side.manifest
    return {
        "command": "check-release", "release": str(Path(cfg.release)), "bundle": str(Path(cfg.bundle)),
        "format": side.fmt.FORMAT, "asset_sha256": side.fmt.asset_digest(manifest),
        "source": {"hf_id": manifest.head.source.hf_id, "revision": manifest.head.source.revision},
        "requests_file": str(cfg.requests or default_requests()), "device": cfg.device, "dtype": cfg.dtype, "red": cfg.red,
        "bar": {"max_abs_dp": side.bar, "mean_abs_dp": side.mean_bar, "reason": side.bar_reason},
        "outcomes": {EQUAL: "every field equal", NEAR_TIE: "the chosen option differs between two options within the bar",
                     ROUNDED: "only rounded numbers differ, every probability within the bar",
                     DISAGREE: "fails: a probability beyond the bar, or a difference noise cannot explain"},
        "table": table_info, "summary": summary,
        "does_not_fit": [{"id": e["id"], "line": e["line"], "tokens": e["tokens"], "why": e["does_not_fit"]}
                         for e in entries if "does_not_fit" in e],
        "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in side.checks],
        "failures": t.failures, "requests": entries,
        "versions": tool_versions(extra=("transformers", "accelerate", "tokenizers")),
    }


def check_release(cfg: CheckConfig, log=lambda msg: None) -> CheckReport:
    """Every request through the author's model and through the shipped head; see the module."""
    from ..head.host import head_inputs
    from ..sources.reference import Reference, import_reference

    t_start = time.perf_counter()
    release, bundle = Path(cfg.release), Path(cfg.bundle)
    _check_options(cfg, release, bundle)
    requests = load_requests(cfg.requests or default_requests(), images=True)
    import_reference()
    side = _open_shipped(cfg, release, bundle)
    q_pad, o_pad = side.pads
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="clef-check-") as tmp:
        table, table_info = _table(cfg, release, Path(tmp), side.config.hidden_size, log)
        ref_model = Reference(release, side.module, side.config, side.state, device=cfg.device, dtype=cfg.dtype, log=log)
        shipped_table = NextRowTable(table) if cfg.red == "lexical" else table
        t0 = time.perf_counter()
        entries, seen_by, prepared = _reference_pass(cfg, requests, ref_model, side)
        seconds["reference"] = time.perf_counter() - t0
        log(f"reference: {plural(len(seen_by), 'request')} answered in {seconds['reference']:.1f} s; "
            f"{len(entries) - len(seen_by)} do not fit")
        t0 = time.perf_counter()
        hiddens, seconds["vision"] = _hidden_rows(cfg, side, ref_model, seen_by, prepared, entries)
        seconds["backbone"] = time.perf_counter() - t0
        jobs = [(i, head_inputs(hidden, seen.ids, questions, shipped_table, bucket, q_pad=q_pad, o_pad=o_pad,
                                buckets=side.buckets), seen)
                for (i, seen, questions, bucket), hidden in zip(seen_by, hiddens, strict=True)]
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calls = [(side.names[hi.bucket], hi) for _, hi, _ in jobs]
            logits = run_async(lambda: _run_all(side.fmt.runner, side.asset, calls))
        seconds["shipped"] = time.perf_counter() - t0
    tally = _compare_all(requests, entries, jobs, logits, side.bar)
    side.checks.append(("release head = bundle's source", True, f"{side.manifest.head.source.hf_id}"))
    side.checks.append(("lexical table", True, f"{table_info['table']} ({table_info['source_file']})"))
    seconds["total"] = time.perf_counter() - t_start
    summary = _summary(side, entries, tally, seconds)
    transcript = _transcript(cfg, side, entries, tally, table_info, summary)
    return CheckReport(checks=side.checks, transcript=transcript, failures=tally.failures)


def host_prompt_equal(ref_model, body: dict[str, Any], seen, tokens: int) -> bool:
    """Whether the host's image prompt (``vision.prompt``: the same request's text-only prompt with
    the image's tokens inserted after the prefix and the spans shifted) is the author's."""
    from ..vision.prompt import insert_image, shift_span

    tok = ref_model.processor.tokenizer
    text = ref_model.encode({k: v for k, v in body.items() if k not in ("images", "media_kwargs")})
    at = seen.record.media.get("token_offset") if seen.record.media else None
    if at is None:
        return False
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    prompt = insert_image(text.input_ids, at, tokens, start_id=ids["<|vision_start|>"], pad_id=ids["<|image_pad|>"],
                          end_id=ids["<|vision_end|>"], newline=tok("\n", add_special_tokens=False).input_ids)
    spans = [(shift_span(q.question_span, prompt), tuple(shift_span(o, prompt) for o in q.option_spans)) for q in text.questions]
    theirs = [(q.question_span, tuple(q.option_spans)) for q in seen.record.questions]
    return prompt.ids == tuple(seen.ids.tolist()) and spans == theirs


def image_not_run(ref_model, backbone, vision) -> str | None:
    """Why an image request is listed as not run here, or None."""
    if not getattr(ref_model, "images", False):
        return "the release has no preprocessor_config.json: its processor cannot take images"
    if backbone is not None and vision is None:
        return "an image request through --backbone needs --vision (the tower asset computes the image's rows)"
    if backbone is not None and backbone.manifest.interface.vision is None:
        return f"{backbone.bundle} is a text-only decoder (built without image_rows)"
    return None


def _image_spans(vision, ref_model, seen_by, prepared, entries):
    """The host's images through the tower asset: per checked request, the decoder's ImageSpan (its
    first image token's index in the author's ids, the tower's rows, the merged grid) or None."""
    from ..backbone.host import ImageSpan
    from ..vision.shipped import tower_rows

    t0 = time.perf_counter()
    order = [i for i, *_ in seen_by if i in prepared]
    rows = dict(zip(order, tower_rows(vision, [prepared[i] for i in order]), strict=True))
    image_id = ref_model.processor.image_token_id
    spans = []
    for i, seen, _, _ in seen_by:
        if i not in prepared:
            spans.append(None)
            continue
        im = prepared[i]
        where = np.flatnonzero(seen.ids == image_id)
        if len(where) != im.grid.tokens or (len(where) and where[-1] - where[0] + 1 != len(where)):
            raise RuntimeError(f"request {entries[i]['id']}: the author's prompt holds {len(where)} image tokens; the host's "
                               f"grid gives {im.grid.tokens}")
        if seen.image_rows is not None:
            want = seen.image_rows
            entries[i]["image"]["vision_rel_max_abs_d"] = float(np.abs(rows[i] - want).max() / max(float(np.abs(want).max()), 1e-30))
        spans.append(ImageSpan(start=int(where[0]), rows=rows[i], grid=im.grid.merged))
    return spans, time.perf_counter() - t0


async def _run_all(runner, asset: Path, calls: list[tuple[str, Any]]) -> list[np.ndarray]:
    names = sorted({name for name, _ in calls})
    from ..progress import counting, progress

    async with runner(asset, names) as call:
        with progress("head asset", len(calls), "calls") as tick:
            counted = counting(call, tick)
            return await gather_all(*[counted(name, hi.arrays) for name, hi in calls])

