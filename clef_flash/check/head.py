"""check-release's head part: the release's head files and lm_head table, the host's head inputs run
through the head asset, and each question's answers compared with the author's, field by field."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError, UsageError
from ..interrupts import gather_all


# Bars on the probabilities before the author's rounding, by the reference's dtype; data, each
# with its reason, written into the transcript.
BARS: dict[str, tuple[float, str]] = {
    "float32": (1e-5, "same hidden rows on both sides; the author's head in fp32 vs the asset's fp32 math on fp16-stored "
                      "bf16 weights (exact) and fp16 lexical rows of bf16 lm_head rows (exact in fp16's normal range): "
                      "only accumulation order differs, the bar of `verify`"),
    "bfloat16": (5e-3, "the author's head computes in bf16 (8-bit mantissa, about 4e-3 relative per operation) while "
                       "the asset computes in fp32 on the same rows; measured 1.4e-3 on the tiny release, not yet on a real one"),
}


# question outcomes; only "disagree" fails
EQUAL, NEAR_TIE, ROUNDED, DISAGREE = "equal", "near-tie", "rounded-digits", "disagree"


def _trusted(release: Path) -> str | None:
    """The author file's sha256 the release's own pins trust (``pin --trust-author-code``), if any."""
    from ..sources.pins import load_pins

    return load_pins(release / "pins.json").trusted_author_sha256 if (release / "pins.json").is_file() else None


def release_module(release: Path, manifest: Any):
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


def shift_spans(questions: Any, length: int) -> list[Any]:
    """Red arm ``spans``: every question and option span one token late (one early at the end)."""
    from ..head.host import Question

    def move(span: tuple[int, int]) -> tuple[int, int]:
        s, e = span
        return (s + 1, e + 1) if e < length else (s - 1, e - 1)

    return [Question(question_type=q.question_type, question_span=move(q.question_span),
                     option_spans=tuple(move(sp) for sp in q.option_spans), option_ids=q.option_ids,
                     question_id=q.question_id) for q in questions]


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


@dataclass
class Tally:
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


def table(given: Path | None, release: Path, tmp: Path, hidden_size: int, log) -> tuple[Any, dict[str, Any]]:
    """The lm_head table the host reads: the one given (``--table``), or one built from the release."""
    table, info = _open_given_table(given, release) if given is not None else _build_table(release, tmp, log)
    if table.shape[1] != hidden_size:
        raise IntegrityError(f"{info['table']}: rows of {table.shape[1]} values; the head's hidden size is {hidden_size}")
    return table, info


def compare_all(requests, entries, jobs, logits, bar: float) -> Tally:
    """Every answered request's questions against the author's, field by field (``compare_question``)."""
    from ..head.host import answers, question_probs

    t = Tally()
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


async def run_all(runner, asset: Path, calls: list[tuple[str, Any]]) -> list[np.ndarray]:
    names = sorted({name for name, _ in calls})
    from ..progress import counting, progress

    async with runner(asset, names) as call:
        with progress("head asset", len(calls), "calls") as tick:
            counted = counting(call, tick)
            return await gather_all(*[counted(name, hi.arrays) for name, hi in calls])


OUTCOMES = {EQUAL: "every field equal", NEAR_TIE: "the chosen option differs between two options within the bar",
            ROUNDED: "only rounded numbers differ, every probability within the bar",
            DISAGREE: "fails: a probability beyond the bar, or a difference noise cannot explain"}


def summary(manifest, entries, t: Tally, bar: float, mean_bar: float | None) -> dict[str, Any]:
    """The transcript summary's head figures: how many requests and questions, how they compared."""
    return {
        "ok": not t.failures, "requests": len(entries), "checked": sum(1 for e in entries if "function" in e),
        "does_not_fit": sum(1 for e in entries if "does_not_fit" in e), "questions": t.questions,
        "answers_equal": t.outcome[EQUAL], "near_ties": t.outcome[NEAR_TIE], "rounded_digits": t.outcome[ROUNDED],
        "disagreements": t.outcome[DISAGREE], "argmax_equal": t.argmax_equal, "usage_equal": t.tokens_equal,
        "max_abs_dp": t.max_dp, "bar": bar, "max_over_bar": t.max_dp / bar,
        "mean_abs_dp": t.mean_dp, "mean_bar": mean_bar,
    }


def functions_used(manifest, fitted: list[dict[str, Any]]) -> dict[str, int]:
    used = Counter(e["function"] for e in fitted)
    return {name: used.get(name, 0) for name, _ in manifest.head.buckets}
