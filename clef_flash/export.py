"""Stage 4: export. Verified source -> ClefHeadGraph -> torch.export per bucket -> one coreai-torch
converter with one entrypoint per bucket -> one multi-function ``.aimodel`` -> ``metadata.json``.

The bundle is built in a temporary sibling folder and renamed into place (``bundle.staged_dir``):
it appears complete or not at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, contract
from .bundle import atomic_write_bytes, atomic_write_json, check_output_path, dumps_json, output_lock, staged_dir, tree_files
from .errors import ClefError, IntegrityError, NumericError, OutputError, ToolchainError, UsageError
from .manifest import (KIND, METADATA_VERSION, Compilation, Export, ExportAttempt, MainMlirb, Manifest, MlpackageExport,
                       MlpackageManifest, Seconds, Source, head_section)
from .pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, Pins, load_pins, sha256_file
from .recipe import Recipe

from .artifact import RECORD_FILE  # noqa: E402
NAMING_SEED = 0x0C1EF  # coreai's composite-graph suffixes, drawn from this seed: reproducible bytes


@dataclass(frozen=True)
class BuildConfig:
    recipe: Recipe
    recipe_path: Path
    source: Path | None
    pins_path: Path
    out: Path
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = True
    verify_records: int | None = None


@dataclass
class BuildResult:
    bundle: Path
    manifest: Manifest | MlpackageManifest
    record: dict[str, Any]
    plan: dict[str, Any] = field(default_factory=dict)


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "clef-export": __version__}
    for dist in ("torch", "coreai-core", "coreai-torch", "coremltools", "numpy", "safetensors", "huggingface_hub"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "missing"
    return out


def source_date_epoch() -> int | None:
    raw = os.environ.get("SOURCE_DATE_EPOCH")
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise UsageError(f"SOURCE_DATE_EPOCH={raw!r} is not a non-negative integer")
    return int(raw)


def build_date() -> str:
    epoch = source_date_epoch()
    when = dt.datetime.fromtimestamp(epoch, dt.timezone.utc) if epoch is not None else dt.datetime.now(dt.timezone.utc)
    return when.replace(microsecond=0).isoformat()


def _import_coreai():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import coreai_torch  # noqa: F401
            from coreai_torch import TorchConverter  # noqa: F401
    except ImportError as exc:
        raise ToolchainError(f"coreai-torch / coreai-core are required to export ({exc.name} missing)") from None
    import coreai_torch

    return coreai_torch


@contextlib.contextmanager
def deterministic_naming(seed: int = NAMING_SEED):
    """coreai names composite graphs with suffixes drawn from ``secrets``; draw them from a seed."""
    import coreai.authoring.graph_builder as gb

    rng = random.Random(seed)
    saved = gb.choice
    gb.choice = rng.choice
    try:
        yield
    finally:
        gb.choice = saved


def example_inputs(bucket: int, hidden_size: int, q_pad: int, o_pad: int):
    import torch

    shapes = contract.input_shapes(bucket, hidden_size, q_pad, o_pad)
    return tuple(
        torch.zeros(shapes[n], dtype=torch.int32 if contract.INPUT_SPECS[n][1] == "i32" else torch.float32)
        for n in contract.INPUT_ORDER
    )


def trace_groups(buckets: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Buckets that attend in one block (T <= KEY_BLOCK) share one trace with a dynamic T, later
    specialised statically per bucket; a larger bucket (key blocks) is traced on its own."""
    plain = tuple(b for b in buckets if b <= contract.KEY_BLOCK)
    groups: list[tuple[str, tuple[int, ...]]] = [("dynamic", plain)] if len(plain) >= 2 else [("static", (b,)) for b in plain]
    return groups + [("static", (b,)) for b in buckets if b > contract.KEY_BLOCK]


DYNAMIC_ENTRY = "tdyn"


def trace_program(graph, buckets: tuple[int, ...], hidden_size: int, q_pad: int, o_pad: int, coreai_torch):
    """torch.export (static T, or dynamic T over ``buckets``) and the coreai decompositions."""
    import torch
    from torch.export import Dim

    dynamic_shapes = None
    if len(buckets) > 1:
        t = Dim("T", min=min(buckets), max=max(buckets))
        axes = {"hidden": 0, "key_valid": 0, "q_avg": 1, "o_avg": 1, "g_avg": 1}
        dynamic_shapes = {n: ({axes[n]: t} if n in axes else None) for n in contract.INPUT_ORDER}
    args = example_inputs(max(buckets), hidden_size, q_pad, o_pad)
    with warnings.catch_warnings(), no_stack_traces():
        warnings.simplefilter("ignore")
        ep = torch.export.export(graph, args, dynamic_shapes=dynamic_shapes, strict=False)
        if needs_decomposition(ep):  # ClefHeadGraph is written in ops coreai lowers directly: never, so far
            ep = ep.run_decompositions(coreai_torch.get_decomp_table())
        return ep


@contextlib.contextmanager
def no_stack_traces():
    """FX records a symbolised Python stack per node (a third of a static trace); the converter's
    debug locations built from them are stripped before saving anyway."""
    import torch.fx.config as fx_config

    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def needs_decomposition(ep) -> bool:
    """Whether coreai-torch would refuse ``ep`` as it is (an op it neither lowers nor keeps).

    ``run_decompositions`` re-traces the whole program and is over half of a trace's time; a graph
    already in the ops coreai lowers skips it. The check is coreai-torch's own validator (private,
    pinned with coreai-torch 0.4.3)."""
    from coreai_torch._validate import validate_exported_program

    try:
        validate_exported_program(ep, {})
    except ValueError:
        return True
    return False


def _specialise(program, buckets: tuple[int, ...], hidden_size: int, q_pad: int, o_pad: int) -> None:
    """One static function per bucket from the dynamic-T graph, named like the rest (t512 …)."""
    from coreai._compiler.ir import StringAttr
    from coreai.authoring.graph_builder import GraphOp

    config = {}
    for b in buckets:
        shapes = contract.input_shapes(b, hidden_size, q_pad, o_pad)
        config[f"b{b}"] = {n: shapes[n] for n in ("hidden", "key_valid", "q_avg", "o_avg", "g_avg")}
    program.set_static_shape_config(DYNAMIC_ENTRY, config)  # -> graphs tdyn_b512, tdyn_b1024, …
    prefix = f"{DYNAMIC_ENTRY}_b"
    # coreai names the clones <entrypoint>_<key>; the manifest's names are t<T> (private IR access,
    # pinned to coreai-core 1.0.0b3)
    with program._module:  # noqa: SLF001
        for op in program._module._body.region.blocks[0].operations:  # noqa: SLF001
            if isinstance(op, GraphOp) and op.sym_name.value.startswith(prefix):
                op.attributes["sym_name"] = StringAttr.get(contract.function_name(int(op.sym_name.value[len(prefix):])))


def convert(graph, recipe: Recipe, hidden_size: int, coreai_torch, log=lambda msg: None):
    """One converter, one entrypoint per trace group: returns the optimized multi-function program
    with one function per bucket."""
    from coreai_torch import TorchConverter
    from coreai_torch.debugging.debug_info import strip_debug_info

    converter = TorchConverter(mode=TorchConverter.Mode.RELEASE)
    dynamic: tuple[int, ...] = ()
    for kind, buckets in trace_groups(recipe.buckets):
        names = ", ".join(contract.function_name(b) for b in buckets)
        log(f"tracing {names}" + (" (one trace, dynamic T)" if kind == "dynamic" else ""))
        ep = trace_program(graph, buckets, hidden_size, recipe.q_pad, recipe.o_pad, coreai_torch)
        ep.example_inputs = None  # up to 64 MB of zeros per program that nothing reads again
        gc.collect()  # the tracer's fake tensors and graphs hold cycles
        entry = DYNAMIC_ENTRY if kind == "dynamic" else contract.function_name(buckets[0])
        dynamic = buckets if kind == "dynamic" else dynamic
        converter.add_exported_program(
            ep,
            input_names=list(contract.INPUT_ORDER),
            output_names=list(contract.OUTPUT_NAMES),
            entrypoint_name=entry,
        )
    log("converting")
    with deterministic_naming(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        program = converter.to_coreai()
        if dynamic:
            _specialise(program, dynamic, hidden_size, recipe.q_pad, recipe.o_pad)
    strip_debug_info(program)  # source locations would embed this machine's paths
    return program


def _source_section(pins: Pins) -> Source:
    return Source(
        hf_id=pins.hf_id,
        revision=pins.revision,
        joint_schema_model_sha256=pins.files[CODE_FILE],
        joint_head_safetensors_sha256=pins.files[WEIGHTS_FILE],
        joint_head_config_sha256=pins.files[CONFIG_FILE],
    )


def check_free_space(final: Path, weight_bytes: int) -> None:
    """Fail before the expensive work when the bundle cannot fit (weights once, plus the graph)."""
    probe = next(p for p in [final.parent, *final.parent.parents] if p.exists())
    need = weight_bytes + (64 << 10)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise OutputError(f"{probe}: not enough free space for the bundle (needs about {need:,} bytes, {free:,} free)")


def plan(cfg: BuildConfig) -> dict[str, Any]:
    """What a build would do; checks everything that can be checked without heavy work."""
    from .source import require_verified, resolve_source

    recipe = cfg.recipe
    pins = load_pins(cfg.pins_path)
    final = Path(cfg.out) / recipe.name
    check_output_path(final, cfg.overwrite)
    source = resolve_source(cfg.source, pins)
    checks = require_verified(source, pins)
    check_free_space(final, (source / WEIGHTS_FILE).stat().st_size * (1 if recipe.weights == "fp16w32" else 2))
    return {
        "recipe": str(cfg.recipe_path),
        "name": recipe.name,
        "bundle": str(final),
        "source": str(source),
        "hf_id": pins.hf_id,
        "revision": pins.revision,
        "synthetic": pins.synthetic,
        "files": {c.name: c.actual for c in checks},
        "functions": [contract.function_name(b) for b in recipe.buckets],
        "weights": recipe.weights,
    }


def build(cfg: BuildConfig, log=lambda msg: None) -> BuildResult:
    """Verify, trace, convert, save, write the manifest (and verify the saved asset)."""
    recipe = cfg.recipe
    t_start = time.perf_counter()
    info = plan(cfg)
    pins = load_pins(cfg.pins_path)
    source = Path(info["source"])
    final = Path(info["bundle"])
    if cfg.dry_run:
        return BuildResult(bundle=final, manifest=None, record={}, plan=info)  # type: ignore[arg-type]
    with output_lock(final), staged_dir(final, cfg.overwrite) as tmp:
        asset_dir = tmp / f"{recipe.name}{recipe.asset_suffix}"
        timings = run_export_worker(source, cfg.pins_path, cfg.recipe_path, recipe, asset_dir, log)
        t_build, t_export, t_save = timings["build"], timings["export"], timings["save"]
        hidden_size = int(timings["hidden_size"])

        # every output hashed once: the manifest and the build record share these digests
        outputs = {f"{asset_dir.name}/{k}": v for k, v in tree_files(asset_dir).items()}
        seconds = Seconds(build=t_build, export=t_export, optimize=0.0, save=t_save,
                          total=t_build + t_export + t_save)
        if recipe.format == "mlpackage":
            manifest = _mlpackage_manifest(recipe, pins, asset_dir, outputs, seconds, hidden_size)
        else:
            manifest = _aimodel_manifest(recipe, pins, asset_dir, outputs, seconds, hidden_size)
        atomic_write_json(tmp / "metadata.json", manifest.model_dump(mode="json"))
        outputs["metadata.json"] = sha256_file(tmp / "metadata.json")
        record = build_record(cfg, pins, dict(sorted(outputs.items())), hidden_size)
        record["parameters"]["aslr_disabled_for_naming"] = bool(timings.get("aslr_disabled"))

        if cfg.verify and recipe.verify.enabled:
            from .gate import VerifyConfig, verify_bundle

            log("verifying the saved asset against the author's head")
            report = verify_bundle(
                VerifyConfig(bundle=tmp, source=source, pins_path=cfg.pins_path,
                             records=cfg.verify_records or recipe.verify.records, seed=recipe.verify.seed),
                log=log,
            )
            record["verify"] = report.summary()
            report.raise_for_failures()  # the staged bundle is discarded: nothing lands
        atomic_write_json(tmp / RECORD_FILE, record)
        log(f"built in {time.perf_counter() - t_start:.1f} s")
    return BuildResult(bundle=final, manifest=manifest, record=record, plan=info)


def _manifest_common(recipe: Recipe, pins: Pins, asset_dir: Path, hidden_size: int) -> dict[str, Any]:
    """What every bundle's manifest says the same way, whatever the format."""
    return {
        "metadata_version": METADATA_VERSION,
        "kind": KIND,
        "name": recipe.name,
        "assets": {"main": asset_dir.name},
        "head": head_section(buckets=recipe.buckets, weights=recipe.weights, source=_source_section(pins),
                             hidden_size=hidden_size),
        "aot": None,
        "compilation": Compilation(date=build_date(), targets=[]),
    }


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _aimodel_manifest(recipe: Recipe, pins: Pins, asset_dir: Path, outputs: dict[str, str], seconds: Seconds,
                      hidden_size: int) -> Manifest:
    """The published manifest's shape, key for key."""
    mlirb = asset_dir / "main.mlirb"
    return Manifest(
        **_manifest_common(recipe, pins, asset_dir, hidden_size),
        export=Export(
            aimodel_bytes=_tree_bytes(asset_dir),
            main_mlirb=MainMlirb(bytes=mlirb.stat().st_size, sha256=outputs[f"{asset_dir.name}/main.mlirb"]),
            seconds=seconds,
            export_attempts=[ExportAttempt(externalize="no externalize specs", ok=True, seconds=seconds.export)],
        ),
    )


def _mlpackage_manifest(recipe: Recipe, pins: Pins, asset_dir: Path, outputs: dict[str, str], seconds: Seconds,
                        hidden_size: int) -> MlpackageManifest:
    """The same decision-head shape for a Core ML package, with ``format`` and its own export facts."""
    from .coreml import DEPLOYMENT_TARGET, MODEL_FILE, PREDICTIONS_NOTE, WEIGHT_FILE

    def part(rel: str) -> MainMlirb:
        return MainMlirb(bytes=(asset_dir / rel).stat().st_size, sha256=outputs[f"{asset_dir.name}/{rel}"])

    return MlpackageManifest(
        **_manifest_common(recipe, pins, asset_dir, hidden_size),
        format="mlpackage",
        export=MlpackageExport(
            mlpackage_bytes=_tree_bytes(asset_dir),
            model=part(MODEL_FILE),
            weight_bin=part(WEIGHT_FILE),
            weight_storage="fp16" if recipe.weights == "fp16w32" else "fp32",
            compute_precision="fp32",
            minimum_deployment_target=DEPLOYMENT_TARGET,
            coremltools=tool_versions()["coremltools"],
            seconds=seconds,
            predictions=PREDICTIONS_NOTE,
        ),
    )


ADDR_NO_RANDOMIZE = 0x0040000


def _no_aslr() -> None:
    """In the export worker (before exec): no address randomisation. The compiler names weight
    blobs by ``llvm::hash_value``, whose seed is the address of a static; with a fixed layout the
    names, and so the bytes of ``main.mlirb``, repeat from build to build."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = libc.personality(0xFFFFFFFF)
        if current != -1:
            libc.personality(current | ADDR_NO_RANDOMIZE)
    except (OSError, AttributeError):
        pass


def _aslr_disabled() -> bool:
    try:
        return bool(int(Path("/proc/self/personality").read_text(), 16) & ADDR_NO_RANDOMIZE)
    except (OSError, ValueError):
        return False


def run_export_worker(source: Path, pins_path: Path, recipe_path: Path, recipe: Recipe, asset_dir: Path, log) -> dict:
    """Trace + convert + save in a child process (fixed address layout, its memory returned to
    the OS when it ends); errors come back as the same typed error, one line."""
    job = {"source": str(source), "pins": str(pins_path), "recipe": recipe.model_dump(mode="json"),
           "recipe_path": str(recipe_path), "asset_dir": str(asset_dir)}
    cmd = [sys.executable, "-m", "clef_flash.export", json.dumps(job)]
    preexec = _no_aslr if sys.platform.startswith("linux") else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    other: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip()
            if line.startswith("LOG "):
                log(line[4:])
            elif line.strip() and not line.startswith("ODIE"):
                other = (other + [line])[-3:]
            if line.startswith("ERROR "):
                kind, _, msg = line[6:].partition(" ")
                proc.wait()
                raise _ERRORS.get(kind, ToolchainError)(msg)
        out = proc.stdout.read() if proc.stdout else ""
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.wait() != 0:
        last = other[-1] if other else "no message"
        if "No space left on device" in last or "Read-only file system" in last:
            cause = "No space left on device" if "No space" in last else "Read-only file system"
            raise OutputError(f"{asset_dir.parent}: cannot write the asset ({cause})")
        raise ToolchainError(f"export worker exited with status {proc.returncode}: {last}")
    return json.loads(out.strip().splitlines()[-1])


def _worker_main(job_text: str) -> int:
    """The export worker: verified head -> ClefHeadGraph -> torch.export per bucket -> .aimodel."""
    import torch

    from .author import load_head
    from .graph import ClefHeadGraph, cast_weights
    from .recipe import Recipe as _Recipe

    def log(msg: str) -> None:
        print(f"LOG {msg}", file=sys.stderr, flush=True)

    try:
        job = json.loads(job_text)
        recipe = _Recipe.model_validate(job["recipe"])
        pins = load_pins(Path(job["pins"]))
        if recipe.format == "mlpackage":
            os.environ["TQDM_DISABLE"] = "1"  # coremltools' progress bars would flood the log
            from .coreml import import_coremltools

            import_coremltools()
        else:
            coreai_torch = _import_coreai()
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
            if recipe.format == "mlpackage":
                from .coreml import export_mlpackage

                t_export, t_save = export_mlpackage(graph, recipe, config.hidden_size, asset_dir,
                                                    asset_description(pins), log)
            else:
                # not under inference_mode: torch.export traces twice as fast without it
                program = convert(graph, recipe, config.hidden_size, coreai_torch, log)
        except ClefError:
            raise
        except OSError as exc:
            raise OutputError(f"{asset_dir}: cannot write the asset ({_root_cause(exc)})") from exc
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolchainError(f"export of {recipe.name} failed: {type(exc).__name__}: {first}") from exc
        if recipe.format == "aimodel":
            t_export = time.perf_counter() - t0
            del graph, head
            gc.collect()  # free the fp16 weights before save_asset clones the module (+244 MB)
            t0 = time.perf_counter()
            log(f"saving {asset_dir.name}")
            try:
                _save_asset(program, asset_dir, pins)
            except (OSError, RuntimeError) as exc:
                raise OutputError(f"{asset_dir}: cannot write the asset ({_root_cause(exc)})") from exc
            t_save = time.perf_counter() - t0
    except ClefError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(json.dumps({"build": t_build, "export": t_export, "save": t_save, "hidden_size": config.hidden_size,
                      "aslr_disabled": _aslr_disabled()}))
    return 0


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]


def asset_description(pins: Pins) -> dict[str, str]:
    """What the asset itself says about its origin (a synthetic source is labelled as such)."""
    label = "SYNTHETIC weights (not the real checkpoint)" if pins.synthetic else "Cloudflare clef-flash"
    return {"author": "clef-export", "license": "Apache-2.0", "version": __version__,
            "description": f"clef-flash joint schema head, {label}, {pins.hf_id}@{pins.revision}",
            "synthetic": "true" if pins.synthetic else "false"}


def _save_asset(program, asset_dir: Path, pins: Pins) -> None:
    from coreai.runtime import AIModelAssetMetadata

    desc = asset_description(pins)
    meta = AIModelAssetMetadata()
    meta.author = desc["author"]
    meta.license = desc["license"]
    meta.model_description = desc["description"]
    asset = program.save_asset(asset_dir, metadata=meta)
    epoch = source_date_epoch()
    if epoch is not None:
        asset.update_metadata(lambda m: setattr(m, "creation_date", float(epoch)))
    # the runtime writes its keys in hash-map order; the same content in a fixed order
    meta_path = asset_dir / "metadata.json"
    atomic_write_bytes(meta_path, dumps_json(json.loads(meta_path.read_text(encoding="utf-8")), sort_keys=True))


def build_record(cfg: BuildConfig, pins: Pins, outputs: dict[str, str], hidden_size: int) -> dict[str, Any]:
    recipe = cfg.recipe
    return {
        "record_version": "1",
        "tool": {"name": "clef-export", "version": __version__, "command": "build"},
        "parameters": {
            "recipe": recipe.model_dump(mode="json"),
            "recipe_file": Path(cfg.recipe_path).name,
            "hidden_size": hidden_size,
            "naming_seed": NAMING_SEED,
        },
        "source": {
            "hf_id": pins.hf_id,
            "revision": pins.revision,
            "synthetic": pins.synthetic,
            "files": {name: {"sha256": digest} for name, digest in sorted(pins.files.items())},
        },
        "outputs": outputs,
        "environment": {**tool_versions(), "platform": sys.platform, "machine": platform.machine()},
        "source_date_epoch": source_date_epoch(),
        "synthetic": pins.synthetic,
        "verify": None,
    }


_ERRORS = {cls.__name__: cls for cls in (UsageError, IntegrityError, NumericError, ToolchainError, OutputError, ClefError)}

if __name__ == "__main__":
    status = _worker_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is written and closed by now; skip tearing down torch, coreai and ~900 MB of
    # objects one by one (about 2 s), the OS takes the memory back at once
    os._exit(status)
