"""The head's build steps: plan (pins, the head's three files, the author's code trusted, the
recipe's buckets), the export worker's job (``ClefHeadGraph`` per bucket through the recipe's
format), the manifest and the record, and the head's gate on the staged bundle."""

from __future__ import annotations

from pathlib import Path

from ..bundle import atomic_write_json, check_free_space
from ..digest import sha256_file, tree_files
from ..errors import UsageError
from ..head.backends import backend
from ..gate.head import VerifyConfig, verify_bundle
from ..head import contract
from ..layout import MANIFEST_FILE
from ..manifest import Seconds
from ..head.manifest import common_fields
from ..provenance import build_date, build_record
from ..sources.author import check_author_trusted
from ..sources.pins import CODE_FILE, WEIGHTS_FILE, load_pins
from .config import BuildConfig, Made, BuildPlan, resolve_output
from .process import run_export

MODEL = "head"
SHIPS_LM_HEAD_TABLE = False  # the head alone: a host with its own backbone brings its table


def compiles(recipe) -> bool:
    """Whether ``xcrun coreai-build`` AOT-compiles what this recipe builds."""
    return bool(backend(recipe.format).AOT)


def refuse(cfg: BuildConfig) -> None:
    """Options the head cannot take with this recipe: exit 2 naming the option."""
    fmt = backend(cfg.recipe.format)
    if cfg.format is not None and backend(cfg.format).FORMAT != fmt.FORMAT:
        raise UsageError(f"{cfg.recipe_path}: the recipe's format is {cfg.recipe.format}, not --format {cfg.format}")
    if cfg.aot and not fmt.AOT:
        raise UsageError(f"{cfg.recipe_path}: --aot compiles .aimodel assets with coreai-build; this recipe builds "
                         f"{cfg.recipe.format}")


def plan(cfg: BuildConfig, log=lambda m: None, defer: bool = False) -> BuildPlan:
    """What a build would do; checks everything that can be checked without heavy work."""
    from ..sources.fetch import require_verified

    recipe = cfg.recipe
    pins, final, source = resolve_output(cfg)
    checks = require_verified(source, pins)
    check_author_trusted(source / CODE_FILE, pins.files[CODE_FILE], pins.trusted_author_sha256)
    weights = (source / WEIGHTS_FILE).stat().st_size * (1 if recipe.weights == "fp16w32" else 2)
    check_free_space(final.parent, weights + (64 << 10), "the bundle")
    files = {c.name: c.actual for c in checks}
    info = {"recipe": str(cfg.recipe_path), "name": final.name, "model": MODEL, "format": recipe.format,
            "bundle": str(final), "source": str(source), "hf_id": pins.hf_id, "revision": pins.revision,
            "synthetic": pins.synthetic, "files": files,
            "functions": [contract.function_name(b) for b in recipe.buckets], "weights": recipe.weights}
    return BuildPlan(cfg=cfg, pins=pins, source=source, bundle=final, files=files, info=info)


def export(p: BuildPlan, tmp: Path, log=lambda m: None) -> Made:
    """The worker's export into ``tmp``, then the manifest and the build record."""
    recipe, pins = p.cfg.recipe, p.pins
    fmt = backend(recipe.format)
    asset_dir = tmp / f"{p.bundle.name}{fmt.SUFFIX}"
    timings = run_export(asset_dir, {"model": MODEL, "source": str(p.source), "pins": str(p.cfg.pins_path),
                                     "recipe": recipe.model_dump(mode="json"), "asset_dir": str(asset_dir)}, log)
    hidden_size = int(timings["hidden_size"])
    # every output hashed once: the manifest and the build record share these digests
    outputs = {f"{asset_dir.name}/{k}": v for k, v in tree_files(asset_dir).items()}
    seconds = Seconds(build=timings["build"], export=timings["export"], optimize=0.0, save=timings["save"],
                      total=timings["build"] + timings["export"] + timings["save"])
    common = common_fields(name=p.bundle.name, asset=asset_dir.name, buckets=recipe.buckets, weights=recipe.weights,
                           pins=pins, hidden_size=hidden_size, date=build_date(), q_pad=recipe.q_pad, o_pad=recipe.o_pad)
    manifest = fmt.manifest(common, recipe, asset_dir, outputs, seconds)
    atomic_write_json(tmp / MANIFEST_FILE, manifest.model_dump(mode="json"))
    outputs[MANIFEST_FILE] = sha256_file(tmp / MANIFEST_FILE)
    record = build_record(recipe, p.cfg.recipe_path, pins, dict(sorted(outputs.items())), hidden_size,
                          fmt.record_parameters())
    return Made(manifest=manifest, record=record,
                seconds={"load": timings["build"], "convert": timings["export"], "save": timings["save"]})


def gate(p: BuildPlan, tmp: Path, log=lambda m: None):
    """The head's gate on the staged bundle, with the digests the plan checked (not hashed again)."""
    recipe = p.cfg.recipe
    log("verifying the saved asset against the author's head")
    return verify_bundle(VerifyConfig(bundle=tmp, source=p.source, pins_path=p.cfg.pins_path,
                                      records=p.cfg.verify_records or recipe.verify.records, seed=recipe.verify.seed,
                                      pins=p.pins, checked=p.files), log=log)


def summary(manifest) -> str:
    """What was built, in the format's own words (sizes)."""
    from ..head.backends import of_manifest

    return of_manifest(manifest).summary(manifest)


def export_job(job: dict, log) -> dict:
    """The worker's head job: the author's head loaded from verified bytes, ``ClefHeadGraph``, the
    recipe's format converts and saves it; returns the timings and the hidden size."""
    import gc
    import time

    import torch

    from ..errors import ClefError, OutputError, ToolchainError
    from ..head.graph import ClefHeadGraph, cast_weights
    from ..provenance import asset_description
    from ..recipe import Recipe
    from ..sources.author import load_head
    from .process import root_cause

    recipe = Recipe.model_validate(job["recipe"])
    pins = load_pins(Path(job["pins"]))
    fmt = backend(recipe.format)
    fmt.import_toolchain()
    log("loading the author's head from verified bytes")
    t0 = time.perf_counter()
    dtype = torch.float16 if recipe.weights == "fp16w32" else torch.float32
    _module, config, head = load_head(Path(job["source"]), pins, dtype)
    head = cast_weights(head, recipe.weights)
    contract.check_contract(recipe.shape_contract, config.hidden_size)
    graph = ClefHeadGraph(head).eval()
    t_build = time.perf_counter() - t0
    asset_dir = Path(job["asset_dir"])
    t0 = time.perf_counter()
    try:
        program = fmt.convert(graph, recipe, config.hidden_size, asset_dir, log)
    except ClefError:
        raise
    except OSError as exc:
        raise OutputError(f"{asset_dir}: cannot write the asset ({root_cause(exc)})") from exc
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ToolchainError(f"export of {recipe.name} failed: {type(exc).__name__}: {first}") from exc
    t_export = time.perf_counter() - t0
    del graph, head
    gc.collect()  # the weights go before the backend saves (save_asset clones the module)
    t0 = time.perf_counter()
    log(f"saving {asset_dir.name}")
    try:
        fmt.save(program, asset_dir, asset_description(pins), log)
    except ClefError:
        raise
    except (OSError, RuntimeError) as exc:  # the native writers report a full disk as RuntimeError
        raise OutputError(f"{asset_dir}: cannot write the asset ({root_cause(exc)})") from exc
    except Exception as exc:
        raise ToolchainError(f"saving {asset_dir.name} failed: {type(exc).__name__}: {root_cause(exc)}") from exc
    return {"build": t_build, "export": t_export, "save": time.perf_counter() - t0, "hidden_size": config.hidden_size}
