"""``check-release``: the shipped head answers real requests like the author's model.

How it works: docs/modules.md."""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ToolchainError, UsageError
from ..interrupts import run_async
from ..progress import plural
from ..report import Report
from ..sources.requests import default_requests, load_requests
from . import backbone as backbone_part
from . import head as head_part
from . import vision as vision_part
from .head import BARS, DISAGREE, EQUAL, NEAR_TIE, ROUNDED, compare_question  # noqa: F401 (the check's public names)

# state: the backbone's states not carried between chunks (--backbone); image: the image's rows zeroed
# in the decoder's inputs (--vision)
RED_ARMS = ("spans", "lexical", "state", "image")


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
    engine: str = "auto"  # what runs the backbone asset (backbone.executor.choose_engine)
    engine_device: str = "auto"  # the torch engine's device
    vision: Path | None = None  # a vision bundle of this release: its asset computes an image's rows
    stream: str = "auto"  # the author's model a layer at a time (streamed_reference.STREAMS)


@dataclass
class CheckReport(Report):
    """check-release's report: the gates' ``Report`` (printed the same way), its rows the summary's."""

    comparison_failures: list[str] = field(default_factory=list)

    def result_failures(self) -> list[str]:
        return list(self.comparison_failures)

    def title(self) -> str:
        return f"check-release {self.transcript['release']} vs {self.transcript['bundle']}"

    def columns(self) -> list[str]:
        return ["check", "value", "bar"]

    def rows(self):
        s = self.transcript["summary"]
        out = []

        def row(name: str, value: str, bar: str, ok: bool) -> None:
            out.append(([name, value, bar], "pass" if ok else "FAIL"))

        row("requests", f"{s['checked']} checked of {s['requests']}, {s['does_not_fit']} do not fit", "listed, never cut", s["checked"] > 0)
        row("questions", str(s["questions"]), "", True)
        enc = s["encoder"]
        row("host encoder = author's", f"{enc['compared'] - enc['differ']}/{enc['compared']} requests token for token and "
            "span for span", "all", enc["differ"] == 0)
        row("answers equal", f"{s['answers_equal']} equal, {s['near_ties']} near-ties, {s['rounded_digits']} differ in rounded "
            "digits only", "0 disagreements", s["disagreements"] == 0)
        row("disagreements", str(s["disagreements"]), "0", s["disagreements"] == 0)
        row("argmax equal", f"{s['argmax_equal']}/{s['questions']}", "near-ties aside", True)
        row("max |d p|", f"{s['max_abs_dp']:.2e} ({s['max_over_bar']:.2f} of the bar)", f"<= {s['bar']:g}", s["max_abs_dp"] <= s["bar"])
        if s["mean_bar"] is not None:
            row("mean |d p|", f"{s['mean_abs_dp']:.2e}", f"<= {s['mean_bar']:g}", s["mean_abs_dp"] <= s["mean_bar"])
        if s["backbone"]:
            b = s["backbone"]
            row("backbone hidden rows", f"rel max |d| {b['hidden_rel_max_abs_d']:.2e} (fp{'32' if b['compute'] == 'fp32' else '16'} "
                f"compute, {b['seconds']:.1f} s)", "reported", True)
        im = s.get("images") or {}
        if im.get("requests"):
            via = f"{im['through_vision']} through the vision asset (rel max |d| {im['vision_rel_max_abs_d']:.2e})" \
                if im.get("vision") else "the reference's rows (no --backbone)"
            row("image requests", f"{im['requests']} checked, {via}; max |d p| {im['max_abs_dp']:.2e} at the native grid "
                f"(the port's square tile: {im['port_square_tile_max_abs_dp']:g})", "the bar above", im["host_patches_equal"])
        row("usage.input_tokens equal", f"{s['usage_equal']}/{s['checked']}", "all", s["usage_equal"] == s["checked"])
        row("buckets used", ", ".join(f"{k}: {v}" for k, v in s["functions_used"].items()), "", True)
        row("wall time", f"{s['seconds']['total']:.1f} s (reference {s['seconds']['reference']:.1f} s, asset "
            f"{s['seconds']['shipped']:.1f} s)", "", True)
        return out

    def lines(self) -> list[str]:
        t = self.transcript
        out = [f"does not fit {e['id']} (line {e['line']}, {e['tokens']} tokens): {e['why']}" for e in t["does_not_fit"]]
        if t["red"]:
            out.append(f"red arm: {t['red']} (the shipped path perturbed; this run must fail)")
        return out

    def headline(self) -> str:
        s = self.transcript["summary"]
        return f"{plural(s['checked'], 'request')}, {plural(s['questions'], 'question')}"


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


def _check_options(cfg: CheckConfig, release: Path, bundle: Path) -> None:
    """Every option, and which bundle is which, refused before any work."""
    if cfg.red is not None and cfg.red not in RED_ARMS:
        raise UsageError(f"--red must be one of {', '.join(RED_ARMS)}, got {cfg.red!r}")
    if cfg.dtype not in BARS:
        raise UsageError(f"--dtype must be one of {', '.join(BARS)}, got {cfg.dtype!r}")
    if cfg.stream not in ("auto", "on", "off"):
        raise UsageError(f"--stream must be auto, on or off, got {cfg.stream!r}")
    if cfg.red == "state" and cfg.backbone is None:
        raise UsageError("--red state perturbs the backbone's host loop: it needs --backbone")
    if cfg.red == "image" and (cfg.backbone is None or cfg.vision is None):
        raise UsageError("--red image zeroes the image's rows in the backbone's inputs: it needs --backbone and --vision")
    if cfg.vision is not None and cfg.backbone is None:
        raise UsageError("--vision feeds the tower's rows to the backbone asset: it needs --backbone")
    from ..host.answer import check_engine_options

    check_engine_options(cfg.engine, cfg.engine_device)
    if cfg.red == "state" and cfg.engine == "torch":
        raise UsageError("--red state resets the states of the runtime's host loop: run it with --engine coreai")
    if not release.is_dir():
        raise UsageError(f"{release}: release folder not found")
    _check_kinds(bundle, cfg.backbone, cfg.vision)  # a bundle passed in another's place: said at once, by name


def _streamed(cfg: CheckConfig, release: Path, log):
    """The backbone stand-in that holds one layer at a time, where ``--stream`` says so (or None)."""
    import torch

    from .streamed_reference import StreamedBackbone, streams

    return StreamedBackbone(release, getattr(torch, cfg.dtype), cfg.device, log) if streams(release, cfg.stream) else None


def _narrow_streamed_head(cfg: CheckConfig, ref_model, log) -> None:
    """Streamed (a release too big to hold), the author's head's linears are held in the release's
    16 bits where that is exact, widened at each call: the same fp32 arithmetic, half its memory
    (0.24 GB at the 9B's head), as ``plan-weights`` holds it."""
    if not ref_model.streamed or cfg.dtype != "float32":
        return
    from ..backbone.held_weights import hold_narrow

    saved = hold_narrow(ref_model.head)
    log(f"reference: the head's linears held in their 16 bits, widened on use ({saved / 1e6:.0f} MB given back)")


def _hashing(part: str, bundle: Path, log) -> None:
    """Said before a part's bundle and the release files it was built from are hashed: at 9B that is
    25 GB read, about a minute, and nothing else would be printed meanwhile."""
    size = sum(p.stat().st_size for p in Path(bundle).rglob("*") if p.is_file())
    log(f"{part}: checking {Path(bundle).name} ({size / 1e9:.1f} GB) and the release files it was built from by sha256")


def _open_shipped(cfg: CheckConfig, release: Path, bundle: Path, log=lambda msg: None) -> _Shipped:
    """The head bundle, then each part's bundle given, against the release; the widest bar."""
    from ..gate.artifact import check_bundle

    manifest, fmt, asset, checks = check_bundle(bundle)
    bad = [f"{n}: {d}" for n, ok, d in checks if not ok]
    if bad:
        raise IntegrityError(f"{bundle}: {bad[0]}")
    why_not = fmt.cannot_run()
    if why_not:
        raise ToolchainError(f"{bundle}: cannot run its {fmt.FORMAT} asset on this machine ({why_not})")
    module, config, state = head_part.release_module(release, manifest)
    bar, bar_reason = BARS[cfg.dtype]
    side = _Shipped(manifest, fmt, asset, checks, module, config, state, bar, bar_reason)
    hashed: dict[str, str] = {}  # release file -> sha256, taken once for the backbone and the tower
    if cfg.backbone is not None:
        _hashing("backbone", cfg.backbone, log)
        side.backbone = backbone_part.open_part(cfg.backbone, release, config.hidden_size, hashed)
        checks.extend(side.backbone.checks)
        side.bar, side.bar_reason, side.mean_bar = backbone_part.bar(side.backbone, bar, bar_reason)
    if cfg.vision is not None:
        _hashing("vision", cfg.vision, log)
        side.vision = vision_part.open_part(cfg.vision, release, config.hidden_size, hashed)
        checks.extend(side.vision.checks)
    return side


def _fit(req, entry: dict[str, Any], encoded, side: _Shipped, prepared: dict[int, Any], index: int) -> int | None:
    """The bucket a request runs in, its image prepared; None (the reason in ``entry``) when it does not fit."""
    from ..head.host import HostInputError, check_fits

    q_pad, o_pad = side.pads
    try:
        bucket = check_fits(len(encoded.input_ids), encoded.questions, q_pad=q_pad, o_pad=o_pad, buckets=side.buckets)
        if req.images and side.vision is not None:
            prepared[index] = vision_part.fit(req, entry, side.vision, side.backbone)
        too_long = side.backbone.does_not_fit(entry["tokens"]) if side.backbone is not None else None
        if too_long:
            raise HostInputError(too_long)
    except HostInputError as exc:
        entry["does_not_fit"] = str(exc)
        return None
    return bucket


class HostEncoder:
    """The project's request encoder on the release's tokenizer; an image's N from the host's own
    preprocessing (the release's image processor settings), as ``answer`` and ``serve`` compute it."""

    def __init__(self, release: Path):
        from ..host.encode import PromptTokenizer

        self.release = release
        self.tokenizer = PromptTokenizer(release / "tokenizer.json")
        self._pre = None

    def image_tokens(self, req) -> int:
        from ..vision.contract import read_preprocessing, read_vision_config
        from ..vision.preprocess import open_image, target_grid
        from ..vision.shipped import pixel_bounds

        if self._pre is None:
            self._pre = read_preprocessing(self.release, read_vision_config(self.release))
        width, height = open_image(req.images[0]).size
        try:
            return target_grid(width, height, self._pre, **pixel_bounds(req.body.get("media_kwargs"))).tokens
        except ValueError as exc:  # the processor's own limit (an aspect past 200): the request's input
            raise UsageError(f"{req.images[0]}: {exc}") from None

    def encode(self, req):
        from ..host.encode import encode

        return encode(self.tokenizer, req.body, image_tokens=self.image_tokens(req) if req.images else None)


def _refusals(requests, release: Path, log) -> dict[int, str]:
    """The requests no model can answer, found before the long work, by the host's own encoder (an
    image unreadable, its pixel bounds not numbers, its aspect past the processor's limit, a record
    that cannot hold the schema and the image): request line -> why, each listed, the rest checked."""
    from ..head.host import HostInputError
    from ..host.encode import RecordTooLong
    from ..sources.image_processor import processor_files

    encoder, out = HostEncoder(release), {}
    images = bool(processor_files(release))  # without the processor's settings the reference pass says why
    for req in requests:
        if req.images and not images:
            continue
        try:
            encoder.encode(req)
        except (UsageError, HostInputError, RecordTooLong) as exc:
            where = f"{req.images[0]}: " if req.images and str(req.images[0]) not in str(exc) else ""
            out[req.line] = f"{where}{exc}"
            log(f"request {req.id} (line {req.line}): {out[req.line]}: listed, not run")
    return out


def _reference_pass(cfg: CheckConfig, requests, ref_model, side: _Shipped, refused: dict[int, str]):
    """The reference side, request by request: (entries, [(entry index, Seen, the questions the host
    reads, bucket)], entry index -> the host's prepared image)."""
    from ..progress import progress

    from ..host.encode import first_difference

    entries: list[dict[str, Any]] = []
    seen_by: list[tuple[int, Any, Any, int]] = []
    prepared: dict[int, Any] = {}
    encoder = HostEncoder(Path(cfg.release))
    with progress("reference: the author's systemone", len(requests), "requests") as tick:
        for req in requests:
            tick()
            i = len(entries)
            entry: dict[str, Any] = {"id": req.id, "line": req.line, "questions": len(req.body["questions"])}
            entries.append(entry)
            if req.line in refused:
                entry["tokens"], entry["options"], entry["does_not_fit"] = 0, 0, refused[req.line]
                continue
            if req.images:
                entry["image"] = {"file": str(req.images[0])}
                why = vision_part.image_not_run(ref_model, side.backbone, side.vision)
                if why:
                    entry["tokens"], entry["options"], entry["does_not_fit"] = 0, 0, why
                    continue
            encoded = ref_model.encode(req.body)
            ours = encoder.encode(req)
            differs = first_difference(ours, encoded.input_ids, encoded.questions)
            if differs:  # the host's encoder is held to the author's on every request
                entry["encoder_differs"] = differs
                continue
            entry["encoder_equal"] = True
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
                vision_part.record(entry, prepared[i], seen, ref_model, req.body)
            questions = ours.questions  # the host's own encoder: equal to the author's, checked above
            if cfg.red == "spans":
                questions = head_part.shift_spans(questions, len(seen.ids))
            seen_by.append((i, seen, questions, bucket))
    return entries, seen_by, prepared


def _hidden_rows(cfg: CheckConfig, side: _Shipped, ref_model, seen_by, prepared, entries) -> tuple[list[Any], float]:
    """The hidden rows the head reads: the reference's, or the backbone asset's on the same token ids
    (an image's rows from the tower asset); and the tower's seconds."""
    spans, vision_seconds = [None] * len(seen_by), 0.0
    if prepared:
        spans, vision_seconds = vision_part.image_spans(side.vision, ref_model, seen_by, prepared, entries)
    if side.backbone is None:
        return [seen.hidden for _, seen, _, _ in seen_by], vision_seconds
    engine = "coreai" if cfg.red == "state" else cfg.engine  # the state arm breaks the runtime's host loop
    return backbone_part.hidden_rows(side.backbone, cfg.red, seen_by, spans, entries, engine, cfg.engine_device), vision_seconds


def _summary(side: _Shipped, entries, t, seconds: dict[str, float]) -> dict[str, Any]:
    """The transcript's summary, each part its own section; the failures that only the whole run shows
    are added to ``t``."""
    fitted = [e for e in entries if "function" in e]
    t.failures.extend(f"{e['id']} (line {e['line']}): the host's encoder differs from the author's at {e['encoder_differs']}"
                      for e in entries if "encoder_differs" in e)
    if not fitted:
        t.failures.append("no request fits the bundle: nothing was compared")
    if side.mean_bar is not None and t.mean_dp > side.mean_bar:
        t.failures.append(f"mean |d p| {t.mean_dp:.3g} over {t.dp_count} probabilities > {side.mean_bar:g}")
    with_image = [e for e in fitted if "image" in e]
    t.failures.extend(vision_part.failures(with_image))
    return {**head_part.summary(side.manifest, entries, t, side.bar, side.mean_bar),
            "backbone": backbone_part.summary(side.backbone, entries, seconds["backbone"]),
            "images": vision_part.summary(side.vision, with_image, seconds["vision"]),
            "encoder": {"compared": sum(1 for e in entries if "encoder_equal" in e or "encoder_differs" in e),
                        "differ": sum(1 for e in entries if "encoder_differs" in e)},
            "functions_used": head_part.functions_used(side.manifest, fitted),
            "seconds": {k: seconds[k] for k in ("reference", "backbone", "shipped", "total")}}


def _transcript(cfg: CheckConfig, side: _Shipped, entries, t, table_info, summary) -> dict[str, Any]:
    from ..provenance import tool_versions

    manifest = side.manifest
    return {
        "command": "check-release", "release": str(Path(cfg.release)), "bundle": str(Path(cfg.bundle)),
        "format": side.fmt.FORMAT, "asset_sha256": side.fmt.asset_digest(manifest),
        "source": {"hf_id": manifest.head.source.hf_id, "revision": manifest.head.source.revision},
        "requests_file": str(cfg.requests or default_requests()), "device": cfg.device, "dtype": cfg.dtype, "red": cfg.red,
        "bar": {"max_abs_dp": side.bar, "mean_abs_dp": side.mean_bar, "reason": side.bar_reason},
        "outcomes": head_part.OUTCOMES,
        "table": table_info, "summary": summary,
        "does_not_fit": [{"id": e["id"], "line": e["line"], "tokens": e["tokens"], "why": e["does_not_fit"]}
                         for e in entries if "does_not_fit" in e],
        "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in side.checks],
        "failures": t.failures, "requests": entries,
        "versions": tool_versions(extra=("transformers", "accelerate", "tokenizers")),
    }


def check_release(cfg: CheckConfig, log=lambda msg: None) -> CheckReport:
    """Every request through the author's model and through the shipped path; see the module."""
    from ..head.host import head_inputs
    from ..sources.reference import Reference, import_reference

    t_start = time.perf_counter()
    release, bundle = Path(cfg.release), Path(cfg.bundle)
    _check_options(cfg, release, bundle)
    requests = load_requests(cfg.requests or default_requests(), images=True)
    import_reference()
    side = _open_shipped(cfg, release, bundle, log)
    refused = _refusals(requests, release, log)
    q_pad, o_pad = side.pads
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="clef-check-") as tmp:
        table, table_info = head_part.table(cfg.table, release, Path(tmp), side.config.hidden_size, log)
        ref_model = Reference(release, side.module, side.config, side.state, device=cfg.device, dtype=cfg.dtype,
                              streamed=_streamed(cfg, release, log), log=log)
        side.state = None  # the checkpoint's tensors live on in the head alone
        _narrow_streamed_head(cfg, ref_model, log)
        shipped_table = head_part.NextRowTable(table) if cfg.red == "lexical" else table
        t0 = time.perf_counter()
        entries, seen_by, prepared = _reference_pass(cfg, requests, ref_model, side, refused)
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
            logits = run_async(lambda: head_part.run_all(side.fmt.runner, side.asset, calls))
        seconds["shipped"] = time.perf_counter() - t0
    tally = head_part.compare_all(requests, entries, jobs, logits, side.bar)
    side.checks.append(("release head = bundle's source", True, f"{side.manifest.head.source.hf_id}"))
    side.checks.append(("lexical table", True, f"{table_info['table']} ({table_info['source_file']})"))
    side.checks.append(("author's model", True, "streamed a layer at a time (--stream)" if ref_model.streamed else
                        "transformers' whole model, as the author loads it"))
    seconds["total"] = time.perf_counter() - t_start
    summary = _summary(side, entries, tally, seconds)
    transcript = _transcript(cfg, side, entries, tally, table_info, summary)
    return CheckReport(bundle=bundle, checks=side.checks, transcript=transcript, comparison_failures=tally.failures)
