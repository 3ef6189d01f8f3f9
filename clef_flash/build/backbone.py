"""``build`` of a backbone recipe: plan -> staged bundle -> export worker -> tokenizer -> manifest
-> build record -> gate -> rename into place.

How it works: docs/modules.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..bundle import atomic_write_bytes, check_free_space
from ..digest import sha256_file, tree_bytes
from ..errors import IntegrityError, UsageError
from ..formats import aimodel  # a backbone is a Core AI asset: the format's own names
from ..formats.mlirb import Written
from ..manifest import Compilation, FileDigest, TensorSpec, mlirb_digest, release_source
from ..sources.pinning import BACKBONE_CONFIG, TOKENIZER_FILES
from ..provenance import asset_description, build_date
from ..backbone.contract import (
    FUNCTION, OUTPUT_NAMES, STATE_ORDER, Chunking, TextConfig, check_contract, compressed_names, decoder_functions,
    weight_names,
)
from ..backbone.manifest import (
    HOST_LOOP, KIND, METADATA_VERSION, BackboneExport, BackboneManifest, Compression, Interface, Language, LayerWeights,
    PlanRef,
)
from ..backbone.plan import PLAN_FILE
from ..backbone.source import TOKENIZER_DIR, release_config
from ..sources.pinned_files import check_pinned, read_files, verify_files
from ..engine.quantize import Scheme
from ..engine.streamed_weights import TensorInfo, asset_bytes, locate, scratch_bytes
from ..gate.backbone import BackboneVerifyConfig, tolerances, verify_backbone
from ..sources.safetensors import shard_files

from .config import BuildConfig, Made, BuildPlan, refuse_head_options, resolve_output
from .core_ai import asset_outputs, export_seconds, made
from .process import run_export, run_export_hashing
from ..progress import plural

MODEL = "backbone"
SHIPS_LM_HEAD_TABLE = True  # a release with the backbone is the whole model: the host's lexical table ships too


@dataclass(frozen=True)
class Found:
    """What a backbone build's plan found; ``fp16_layers = "auto"`` replaces the layer choice once the
    planner has run (``choose_layers``)."""

    text: TextConfig
    chunking: Chunking
    infos: dict[str, TensorInfo]  # the release's tensors, located once
    scheme: Scheme | None  # None: fp16 weights
    compressed: list[str]
    fp16_layers: tuple[int, ...]
    plan_ref: PlanRef | None
    implied: int  # main.mlirb's weight bytes the choice implies
    auto: bool  # fp16_layers = "auto": the planner chooses at build time


@dataclass(frozen=True)
class Handoff:
    """What the export hands its gate: the release side of the weight comparison, started beside the
    export (``asset_readback.ExpectedDigests``), and the digests the streamed save took (``mlirb.Written``)."""

    expected_digests: Any = None
    written: Written | None = None
    report: Any = None  # asset_readback.WeightsReport: every weight located in main.mlirb (the weight map's source)


def compiles(recipe) -> bool:
    return False  # AOT of the stateful decoder is not offered yet
MARGIN = 64 << 20


def disk_need(asset_bytes: int, numeric: bool, fp16_bytes: int | None = None) -> int:
    """Bytes the build puts on the output's disk at its peak: ``main.mlirb`` (the weights once, as the
    scheme stores them: the large tensors, fp16 or codes and scales, are made straight into it,
    ``mlirb.inflate``; the scratch file's slots for them stay holes), and where the numeric gate runs,
    the runtime's compiled copy with fp32 weights."""
    fp16_bytes = asset_bytes if fp16_bytes is None else fp16_bytes
    return asset_bytes + (2 * fp16_bytes if numeric else 0) + MARGIN


def refuse(cfg: BuildConfig) -> None:
    """Options a backbone build cannot take: exit 2 naming the option and the model."""
    refuse_head_options(cfg, "a backbone", "a backbone bundle",
                        "its fixed record lengths (1, S - 1, S, S + 1, three chunks, near the context)")


def plan(cfg: BuildConfig, log=lambda m: None, defer: bool = False) -> BuildPlan:
    """Everything checked before work. ``defer``: the shards are checked to be pinned and present
    here, and hashed while the export runs (listed in "deferred": ``BackgroundHashes``, or for a
    compressed build the read that makes its codes, ``engine.shard_reads``); a dry run hashes them here."""
    recipe = cfg.recipe
    pins, final, source = resolve_output(cfg)
    if not source.is_dir():
        raise IntegrityError(f"{source}: source folder not found")
    names = read_files(source)
    auto = recipe.scheme is not None and recipe.fp16_layers == "auto"
    if auto:
        check_planner_inputs(cfg, source, pins)
    # "auto": the planner reads every shard first, so they are hashed here rather than beside the export
    later = [n for n in shard_files(source) if n in names] if defer and not auto else []
    check_pinned(source, pins, cfg.pins_path, later)  # the rest: verify_files
    digests = verify_files(source, pins, cfg.pins_path, [n for n in names if n not in later], log)
    text = release_config(source)
    chunking = Chunking(recipe.chunk, recipe.context, recipe.image_rows)
    try:
        check_contract(text, chunking)
    except ValueError as exc:
        raise IntegrityError(f"{source / BACKBONE_CONFIG}: {exc}") from None
    infos = locate(source, weight_names(text))
    scheme = recipe.scheme
    fp16_layers, plan_ref = resolve_fp16_layers(cfg, text, digests, pins)
    compressed = compressed_names(weight_names(text), scheme, fp16_layers) if scheme else []
    fp16 = scratch_bytes(infos)
    implied = asset_bytes(infos, scheme, compressed)  # "auto": every layer compressed until the plan chooses
    parameters = sum(math.prod(t.shape) for t in infos.values())
    gated = bool(cfg.verify and recipe.verify.enabled)
    # the runtime loads the asset (its compiled fp32 copy on disk) for the numeric check, and past
    # numeric_max_parameters for the spot check where the asset computes in fp32 (gate.backbone)
    numeric = gated and (parameters <= recipe.verify.numeric_max_parameters or recipe.compute == "fp32")
    what = "the backbone build (main.mlirb and the runtime's compiled fp32 copy)" if numeric else \
        "the backbone build (main.mlirb)"
    # "auto": the plan may keep any layers fp16, so the space for the largest main.mlirb (all fp16)
    check_free_space(final.parent, disk_need(asset_bytes(infos) if auto else implied, numeric, fp16), what)
    info = {"recipe": str(cfg.recipe_path), "name": final.name, "model": MODEL, "bundle": str(final),
            "source": str(source), "hf_id": pins.hf_id, "revision": pins.revision, "synthetic": pins.synthetic,
            "files": digests, "deferred": later,
            "functions": [f.name for f in decoder_functions(recipe.context, recipe.short_contexts)],
            "weights": recipe.weights, "compute": recipe.compute,
            "parameters": parameters, "weight_fp16_bytes": fp16, "text_config": text.as_dict()}
    if scheme:
        info.update({"block": scheme.block, "fp16_layers": "auto" if auto else list(fp16_layers),
                     "compressed_tensors": None if auto else len(compressed),
                     "implied_weight_bytes": None if auto else implied, "experimental": recipe.experimental,
                     "plan": f"chosen at build time by plan-weights (budget max |dp| {recipe.plan_budget_dp:g}), "
                             f"shipped as {PLAN_FILE}" if auto else plan_ref.model_dump() if plan_ref else None})
    return BuildPlan(cfg=cfg, pins=pins, source=source, bundle=final, files=digests, info=info, deferred=later,
                found=Found(text=text, chunking=chunking, infos=infos, scheme=scheme, compressed=compressed,
                            fp16_layers=fp16_layers, plan_ref=plan_ref, implied=implied, auto=auto))


def check_planner_inputs(cfg: BuildConfig, source: Path, pins) -> None:
    """``fp16_layers = "auto"`` measures end to end through the release's head, the author's code
    included: refused now (not after the shards are hashed) where its files are missing or the tool
    would not run the author's file (the pins always name the head's files)."""
    from ..sources.author import check_author_trusted
    from ..sources.pins import CODE_FILE, HEAD_FILES

    absent = [f for f in HEAD_FILES if not (source / f).is_file()]
    if absent:
        raise IntegrityError(f"{source / absent[0]}: pinned but missing; run `clef-export fetch` to download it")
    check_author_trusted(source / CODE_FILE, pins.files[CODE_FILE], pins.trusted_author_sha256)


def choose_layers(p: BuildPlan, tmp: Path, log=lambda m: None) -> None:
    """``fp16_layers = "auto"``: ``plan-weights`` on the release (in the worker: its memory goes back to
    the OS before the export starts), written into the staged bundle as ``weight-plan.json``; the
    layers it keeps fp16 become the plan's. A plan that did not meet its budget is a failed build."""
    from ..backbone.plan import check_plan_backs_choice, load_plan, plan_problems
    from .plan_weights import PLAN_JOB

    out = tmp / PLAN_FILE
    recipe = p.cfg.recipe
    log(f"choosing the layers kept fp16 (plan-weights, budget max |dp| {recipe.plan_budget_dp:g})")
    run_export(out, {"model": PLAN_JOB, "asset_dir": str(out), "release": str(p.source),
                     "recipe": recipe.model_dump(mode="json"), "recipe_path": str(p.cfg.recipe_path),
                     "pins_path": str(p.cfg.pins_path), "out": str(out), "checked": p.files}, log)
    plan = load_plan(out)
    check_plan_backs_choice(plan, out, len(p.found.text.layer_types))
    if not plan.minimal:  # it meets the budget; a smaller set not on the bisection's path also does
        log(f"note: {plan_problems(plan)[-1]}")
    f = p.found
    compressed = compressed_names(weight_names(f.text), f.scheme, plan.chosen)
    p.found = f = replace(f, fp16_layers=tuple(plan.chosen), compressed=compressed,
                          implied=asset_bytes(f.infos, f.scheme, compressed),
                          plan_ref=PlanRef(file=PLAN_FILE, sha256=sha256_file(out), budget_dp=plan.budget_dp,
                                           chosen=list(plan.chosen), shipped=True))
    p.info.update({"fp16_layers": list(plan.chosen), "compressed_tensors": len(compressed),
                   "implied_weight_bytes": f.implied, "plan": f.plan_ref.model_dump()})
    log(f"plan: fp16 layers {plan.chosen or 'none'} ({plural(len(compressed), 'tensor')} compressed; "
        f"minimal: {plan.minimal}; {plan.seconds['total']:.1f} s)")


def resolve_fp16_layers(cfg: BuildConfig, text: TextConfig, digests: dict[str, str], pins):
    """The decoder layers a compressed recipe keeps fp16, and the plan that chose them: the recipe's
    list, its plan file (checked to be this release's and this scheme's), or ``auto`` (nothing yet:
    ``choose_layers`` runs the planner at build time)."""
    from ..backbone.plan import check_plan_fits, load_plan
    from ..digest import sha256_file

    recipe = cfg.recipe
    if recipe.scheme is None:
        return (), None
    layers = len(text.layer_types)
    if recipe.plan:
        path = Path(recipe.plan)
        path = path if path.is_absolute() else Path(cfg.recipe_path).parent / path
        plan = load_plan(path)
        check_plan_fits(plan, path, recipe.scheme, {**pins.files, **digests}, layers)
        ref = PlanRef(file=path.name, sha256=sha256_file(path), budget_dp=plan.budget_dp, chosen=list(plan.chosen))
        return tuple(plan.chosen), ref
    if recipe.fp16_layers == "auto":
        return (), None  # chosen at build time (choose_layers), before the export
    bad = [i for i in recipe.fp16_layers if i >= layers]
    if bad:
        raise UsageError(f"{cfg.recipe_path}: fp16_layers names layer {bad[0]}; the decoder has {layers} layers")
    return tuple(sorted(set(recipe.fp16_layers))), None


def compression_section(p: BuildPlan, mlirb_bytes: int) -> Compression | None:
    """The manifest's account of what was compressed, per decoder layer, and what stayed fp16."""
    from ..engine.quantize import SCALE_FLOOR
    from ..backbone.contract import layer_of

    f = p.found
    scheme, compressed = f.scheme, set(f.compressed)
    if scheme is None:
        return None
    groups: dict[int | None, dict] = {}  # decoder layer (None: outside the layers' linears) -> its 2-D+ tensors
    for name, t in f.infos.items():
        if len(t.shape) >= 2:
            groups.setdefault(layer_of(name), {})[name] = t
    other = groups.pop(None, {})
    return Compression(
        bits=scheme.bits, block=scheme.block, scale_floor=SCALE_FLOOR,
        op="coreai.blockwise_shift_scale (torch.ops.coreai.constexpr_blockwise_shift_scale): fp16(scale * code)",
        experimental=p.cfg.recipe.experimental, fp16_layers=list(f.fp16_layers), plan=f.plan_ref,
        compressed_tensors=len(compressed),
        layers=[LayerWeights(layer=i, weights=scheme.weights if compressed & set(g) else "fp16", tensors=len(g),
                             bytes=asset_bytes(g, scheme, compressed)) for i, g in sorted(groups.items())],
        other={"tensors": len(other), "bytes": asset_bytes(other, scheme, compressed)},
        implied_bytes=f.implied, mlirb_over_implied=round(mlirb_bytes / max(f.implied, 1), 6))


def interface(text: TextConfig, chunking: Chunking, compute: str, short_contexts=()) -> Interface:
    from ..backbone.contract import NO_IMAGE, input_order
    from ..backbone.manifest import IMAGE_RULE, ImageInputs, ShortFunction

    state = "fp32" if compute == "fp32" else "fp16"
    shapes = text.state_shapes(chunking.context)
    inputs = {"input_ids": TensorSpec(shape=[1, chunking.chunk], dtype="int32"),
              "position_ids": TensorSpec(shape=[1, "seq"], dtype="int32")}
    vision = None
    if chunking.image_rows:
        n = chunking.image_rows
        inputs.update({"image_embeds": TensorSpec(shape=[n, text.hidden_size], dtype=state),
                       "image_rc": TensorSpec(shape=[n, 2], dtype="int32"),
                       "rope_shift_start": TensorSpec(shape=[1], dtype="int32"),
                       "rope_shift_amount": TensorSpec(shape=[1], dtype="int32")})
        vision = ImageInputs(image_rows=n, image_token_base=text.vocab_size, embeds_dtype=state, text_values=dict(NO_IMAGE),
                             mrope_section=list(text.mrope_section), rule=IMAGE_RULE)
    return Interface(
        function=FUNCTION,
        short_functions=[ShortFunction(function=f.name, context=f.context)
                         for f in decoder_functions(chunking.context, short_contexts)[:-1]],
        inputs=inputs,
        vision=vision,
        input_order=list(input_order(chunking)),
        states={n: TensorSpec(shape=list(shapes[n]), dtype=state) for n in STATE_ORDER},
        state_order=list(STATE_ORDER),
        outputs={OUTPUT_NAMES[0]: TensorSpec(shape=[1, chunking.chunk, text.hidden_size], dtype=state)},
        host_loop=HOST_LOOP,
    )


def export(p: BuildPlan, tmp: Path, log=lambda m: None) -> Made:
    """The worker's export into ``tmp`` (the shards hashed beside it), the tokenizer files, the
    manifest and the build record."""
    recipe, pins, source = p.cfg.recipe, p.pins, p.source
    if p.found.auto:
        choose_layers(p, tmp, log)
    f = p.found
    text, scheme = f.text, f.scheme
    asset_dir = tmp / f"{p.bundle.name}{aimodel.SUFFIX}"
    job = {"model": MODEL, "source": str(source), "asset_dir": str(asset_dir), "text_config": text.as_dict(),
           "chunk": recipe.chunk, "context": recipe.context, "short_contexts": list(recipe.short_contexts),
           "image_rows": recipe.image_rows, "compute": recipe.compute,
           "quantization": {"bits": scheme.bits, "block": scheme.block, "tensors": f.compressed} if scheme else None,
           # a compressed build's worker hashes the shards: its process making codes reads each once for both
           "hash_shards": list(p.deferred) if scheme and f.compressed else [],
           "description": {**asset_description(pins), "description": f"Qwen3.5 text decoder of {pins.label}, "
                           f"prefill chunk {recipe.chunk}, weights {recipe.weights}, compute {recipe.compute}"}}
    # the gate's release side (every tensor's expected digests) beside the export: the trace is one
    # core of Python, and this reads only the release; the gate joins it (asset_readback.ExpectedDigests)
    side = None
    if p.cfg.verify and recipe.verify.enabled:  # the gate will run (build.build's test)
        from ..engine.asset_readback import ExpectedDigests

        # a compressed export reads the release past the page cache (``shard_reads``): so does its gate's side
        side = ExpectedDigests(source, f.infos, recipe.compute == "fp32", scheme, f.compressed,
                           direct=bool(scheme and f.compressed)).start(background=True)
    p.handoff = Handoff(expected_digests=side)
    try:
        timings = run_export_hashing(p, asset_dir, job, read_files(source), log)
        p.handoff = Handoff(expected_digests=side, written=Written.from_json(timings["written"]))
        return _finish(p, tmp, asset_dir, timings, log)
    except BaseException:
        if side is not None:
            side.stop()
        raise


def _finish(p: BuildPlan, tmp: Path, asset_dir: Path, timings: dict, log=lambda m: None) -> Made:
    recipe, pins, source = p.cfg.recipe, p.pins, p.source
    text, chunking = p.found.text, p.found.chunking
    tok_dir = tmp / TOKENIZER_DIR
    tok_dir.mkdir()
    tokenizer = {}
    for f in TOKENIZER_FILES:
        if f in p.files:
            atomic_write_bytes(tok_dir / f, (source / f).read_bytes())
            digest = sha256_file(tok_dir / f)
            if digest != p.files[f]:  # the file changed since it was checked
                raise IntegrityError(f"{source / f}: changed while the bundle was built")
            tokenizer[f] = digest
    # main.hash: the sha256 save took of main.mlirb in the pass that named its blobs (not read again)
    outputs = asset_outputs(asset_dir)
    outputs.update({f"{TOKENIZER_DIR}/{k}": v for k, v in tokenizer.items()})
    if p.found.auto:
        outputs[PLAN_FILE] = p.found.plan_ref.sha256
    mlirb = asset_dir / "main.mlirb"
    seconds = export_seconds(timings)
    fp16 = int(timings["weight_fp16_bytes"])
    weight_map = _weight_map(p, tmp, mlirb, outputs, log)
    manifest = BackboneManifest(
        metadata_version=METADATA_VERSION, kind=KIND, name=p.bundle.name, assets={"main": asset_dir.name},
        language=Language(prefill_chunk=recipe.chunk, max_context=recipe.context, vocab_size=text.vocab_size,
                          hidden_size=text.hidden_size, pad_token_id=text.pad_token_id,
                          layer_types=list(text.layer_types), text_config=text.as_dict()),
        interface=interface(text, chunking, recipe.compute, recipe.short_contexts),
        source=release_source(pins, p.files),
        tokenizer=tokenizer,
        export=BackboneExport(weights=recipe.weights, compute=recipe.compute, aimodel_bytes=tree_bytes(asset_dir),
                              main_mlirb=mlirb_digest(asset_dir, outputs),
                              weight_fp16_bytes=fp16, mlirb_over_weights=round(mlirb.stat().st_size / max(fp16, 1), 6),
                              seconds=seconds, tolerances=tolerances(recipe.compute, recipe.weights),
                              compression=compression_section(p, mlirb.stat().st_size), weight_map=weight_map),
        compilation=Compilation(date=build_date(), targets=[]),
    )
    return made(p, tmp, manifest, outputs, text.hidden_size,
                {"model": MODEL, "text_config": text.as_dict(), "seconds": seconds,
                 # tensors stored as W * 2**k (fp32 compute: no fp16 subnormal, see engine.streamed_weights)
                 "scaled_tensors": int(timings.get("scaled_tensors", 0))}, seconds)


def _weight_map(p: BuildPlan, tmp: Path, mlirb: Path, outputs: dict[str, str], log=lambda m: None) -> FileDigest | None:
    """Every weight located in the saved main.mlirb (the gate's streamed comparison, run here, its
    report handed to the gate) and the weight map written from it (``engine.weight_map``: what the
    torch engine reads the asset through). A weight in no blob: no map, and the gate names it."""
    from ..engine.asset_readback import compare
    from ..engine.streamed_weights import read_f32
    from ..engine.weight_map import MAP_FILE, map_bytes

    f, handoff = p.found, p.handoff or Handoff()
    report = compare(mlirb, p.source, f.infos, scaled=p.cfg.recipe.compute == "fp32", log=log, scheme=f.scheme,
                     compressed=f.compressed, release=handoff.expected_digests, written=handoff.written)
    p.handoff = replace(handoff, report=report)
    if not report.ok:
        return None
    folded = {n: read_f32(p.source, t) for n, t in f.infos.items() if len(t.shape) < 2}
    atomic_write_bytes(tmp / MAP_FILE, map_bytes(report, folded))
    outputs[MAP_FILE] = sha256_file(tmp / MAP_FILE)
    return FileDigest(bytes=(tmp / MAP_FILE).stat().st_size, sha256=outputs[MAP_FILE])


def gate(p: BuildPlan, tmp: Path, log=lambda m: None):
    """The backbone's gate on the staged bundle (its compiled copy on the output's disk), with what
    the plan found: the digests it and the export checked, the configuration, the located tensors
    (nothing read or hashed again)."""
    recipe = p.cfg.recipe
    handoff = p.handoff or Handoff()
    side = handoff.expected_digests
    log("verifying the saved backbone against transformers' text model")
    try:
        return verify_backbone(BackboneVerifyConfig(bundle=tmp, source=p.source, pins_path=p.cfg.pins_path,
                                                    seed=recipe.verify.seed, long_record=recipe.long_record,
                                                    numeric_max_parameters=recipe.verify.numeric_max_parameters,
                                                    scratch=tmp, pins=p.pins, checked=p.files, text=p.found.text,
                                                    located=p.found.infos, expected_digests=side,
                                                    written=handoff.written, weights_report=handoff.report), log=log)
    finally:
        if side is not None:
            side.stop()  # done already, or the gate failed before it compared the weights


def summary(manifest) -> str:
    e = manifest.export
    if e.compression is not None:
        c = e.compression
        return (f"main.mlirb {e.main_mlirb.bytes:,} bytes, {e.weights} per block of {c.block} "
                f"({c.compressed_tensors} tensors; layers kept fp16: {c.fp16_layers or 'none'}): "
                f"{c.mlirb_over_implied:.4f} x the scheme's bytes, {e.mlirb_over_weights:.4f} x fp16"
                + ("; EXPERIMENTAL" if c.experimental else ""))
    return f"main.mlirb {e.main_mlirb.bytes:,} bytes ({e.mlirb_over_weights:.4f} x the fp16 weights)"


def export_job(job: dict, log) -> dict:
    """The worker's backbone job (``backbone.export``: weights streamed, traced, converted, saved)."""
    from ..backbone.export import export_job as run

    return run(job, log)
