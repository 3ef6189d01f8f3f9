"""The ``clef-export`` command line. Each command resolves its options into a frozen config and
calls one library function; heavy imports (torch, coreai) happen inside commands, so ``--help``
is instant. Progress goes to stderr; stdout stays clean for ``--json``.

Exit codes: 0 ok, 1 unexpected, 2 usage, 3 integrity, 4 numeric validation, 5 toolchain missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import ClefError
from .interrupts import Interrupt
from .progress import plural

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Export a Clef release (its joint schema head, its Qwen3.5 decoder) to Apple Core AI assets, and prove them.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: rich's panels make `--help` half again slower
)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 160)  # one-line errors
results = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)  # results people read
_state = {"verbose": False}


def _version(value: bool) -> None:
    if value:
        from . import __version__

        sys.stdout.write(f"clef-export {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors, and the Core AI runtime's own lines.")] = False,
          version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    _state["verbose"] = verbose
    from .quiet import set_verbose

    set_verbose(verbose)


def _run(fn: Callable[[], Any]) -> Any:
    """Map errors to one line and an exit code."""
    try:
        return fn()
    except ClefError as exc:
        if _state["verbose"]:
            err.print_exception()
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except (KeyboardInterrupt, Interrupt):
        err.print("[bold red]interrupted[/]: nothing was written")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except OSError as exc:  # disk full, read-only file system: name the file and the cause
        where = exc.filename or "output"
        err.print(f"[bold red]error:[/] cannot write {escape(str(where))}: {escape(str(exc.strerror or exc))}")
        raise typer.Exit(1) from None
    except Exception as exc:  # unexpected: one line unless --verbose
        if _state["verbose"]:
            err.print_exception()
        err.print(f"[bold red]unexpected error:[/] {type(exc).__name__}: {escape(str(exc))} (rerun with --verbose)", soft_wrap=True)
        raise typer.Exit(1) from None


def _fail(failures: list[str], where_more: str) -> None:
    """Each failure a ``FAIL`` line on stderr (the first 20), then exit 4."""
    for f in failures[:20]:
        err.print(f"[bold red]FAIL[/] {escape(f)}")
    if len(failures) > 20:
        err.print(f"[bold red]FAIL[/] … and {len(failures) - 20} more ({where_more})")
    raise typer.Exit(4)


def _log(msg: str) -> None:
    from .interrupts import check_interrupted

    check_interrupted()  # a safe point: an interrupt deferred (inside an import, a native call) acts here
    err.print(f"[dim]·[/] {escape(msg)}", soft_wrap=True)


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


PinsOpt = Annotated[Optional[Path], typer.Option("--pins", help=(
    "Pins file: origin, file -> sha256 (default: SOURCE/pins.json when --source has one, else "
    "Cloudflare/clef-flash at the published commit)."))]
NameOpt = Annotated[Optional[str], typer.Option("--name", help="The release's name in bundle names (default: the pins').")]


def _pins(pins: Optional[Path], source: Optional[Path] = None) -> Path:
    """--pins, else the source folder's pins.json (written by `pin` and `synth`), else the default."""
    from .data import default_pins

    if pins is not None:
        return pins
    if source is not None and (Path(source) / "pins.json").is_file():
        return Path(source) / "pins.json"
    return default_pins()


SourceOpt = Annotated[Optional[Path], typer.Option("--source", help="Snapshot folder (default: the pinned revision in the HF cache).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON result on stdout.")]
EngineOpt = Annotated[str, typer.Option("--engine", help=(
    "What runs the decoder: coreai (the Core AI runtime), torch (the export's graph on the weights read back from "
    "main.mlirb), or auto: the runtime on a Mac and where it runs a chunk in seconds, torch on a GPU or past that."))]
EngineDeviceOpt = Annotated[str, typer.Option("--device", help="The torch engine's device: auto, cpu, cuda or mps.")]
RecipeArg = Annotated[Optional[Path], typer.Argument(help="Recipe TOML: a head one (default: conversion/head_bucket_fp16w32.toml) or a backbone one (conversion/backbone_pf64_*.toml).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output (atomically).")]


AuthorCodeOpt = Annotated[Optional[Path], typer.Option("--author-code", help=(
    "The verified joint_schema_model.py (default: where `clef-export author-code` writes it)."))]

# formats are the backends' names (backends.FORMATS), checked when the backend is looked up
FORMAT_HELP = "Asset format: aimodel (Core AI, macOS 27) or mlpackage (Core ML, macOS 15+)."
VerifyRecordsOpt = Annotated[Optional[int], typer.Option("--verify-records", help="Records per function for the gate.")]


@app.command("author-code")
def author_code(
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write joint_schema_model.py (default: $CLEF_AUTHOR_CODE, "
                                                              "a checkout's .cache/author/, else ~/.cache/clef-export/author/).")] = None,
) -> None:
    """Obtain the author's joint_schema_model.py from the clef-finetune==0.1.0 wheel, sha256-checked."""
    from .sources.author import default_author_code, obtain_author_code

    path = _run(lambda: obtain_author_code(out or default_author_code()))
    results.print(f"author code: {escape(str(path))} (sha256 verified)")


@app.command()
def fetch(
    pins: PinsOpt = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Commit to fetch (default: the pinned one).")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="huggingface_hub cache folder.")] = None,
    local_dir: Annotated[Optional[Path], typer.Option("--local-dir", help="Download into this folder instead of the cache.")] = None,
    allow_unpinned: Annotated[bool, typer.Option("--allow-unpinned", help="Allow a revision other than the pinned commit.")] = False,
    backbone: Annotated[bool, typer.Option("--backbone", help="Also every other pinned file: config, index, shards, tokenizer (a backbone build reads them).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Download a release's pinned files by commit: the head's, or with --backbone every file (HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE honoured)."""
    from .sources.pins import load_pins
    from .sources.fetch import fetch as do_fetch

    if cache_dir and local_dir:
        err.print("[bold red]error:[/] give --cache-dir or --local-dir, not both")
        raise typer.Exit(2)

    def go():
        p = load_pins(_pins(pins))
        return p, do_fetch(p, revision=revision, cache_dir=cache_dir, local_dir=local_dir, allow_unpinned=allow_unpinned,
                           backbone=backbone, log=_log)

    p, folder = _run(go)
    if json_out:
        _emit_json({"hf_id": p.hf_id, "revision": revision or p.revision, "folder": str(folder), "files": sorted(p.files)})
    else:
        err.print(f"fetched {plural(len(p.files), 'file')} of {p.hf_id}@{(revision or p.revision)[:12]} into {folder}")
        sys.stdout.write(f"{folder}\n")


@app.command()
def pin(
    target: Annotated[str, typer.Argument(help="A Hub repo id (with --revision) or a local release folder.")],
    revision: Annotated[Optional[str], typer.Option("--revision", help="The Hub commit to pin (40 hex).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Pins file to write (default: FOLDER/pins.json "
                                                              "for a folder, ./pins.json for a Hub repo).")] = None,
    name: NameOpt = None,
    trust_author_code: Annotated[Optional[str], typer.Option(
        "--trust-author-code", help="Run a joint_schema_model.py the tool does not know: its exact sha256.")] = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Pin a release: a Hub commit from the Hub's metadata, or a local release folder; writes pins.json."""
    from .errors import UsageError
    from .sources.pinning import pin_hub, pin_local

    def go():
        if Path(target).is_dir():
            if revision is not None:
                raise UsageError(f"{target}: a local folder has no --revision")
            return pin_local(Path(target), out, name=name, trust_author=trust_author_code, overwrite=overwrite, log=_log)
        if revision is None:
            raise UsageError(f"{target}: not a folder here; to pin a Hub repo give --revision COMMIT")
        path = out or Path("pins.json")
        return pin_hub(target, revision, path, name=name, trust_author=trust_author_code, overwrite=overwrite,
                       log=_log), path

    p, path = _run(go)
    if json_out:
        _emit_json({"pins": str(path), **p.model_dump(mode="json")})
    _human(json_out).print(f"[bold green]pinned[/] {escape(p.label)}: {plural(len(p.files), 'file')} -> {escape(str(path))}")


@app.command("verify-hashes")
def verify_hashes(source: SourceOpt = None, pins: PinsOpt = None, json_out: JsonOpt = False) -> None:
    """Streaming sha256 of every pinned file against the pins; exit 3 on a mismatch or a missing file."""
    from .sources.pins import load_pins
    from .sources.fetch import check_source, resolve_source

    def go():
        p = load_pins(_pins(pins, source))
        folder = resolve_source(source, p)
        return p, folder, check_source(folder, p)

    p, folder, checks = _run(go)
    if json_out:
        _emit_json({"source": str(folder), "hf_id": p.hf_id, "revision": p.revision, "synthetic": p.synthetic,
                    "ok": all(c.ok for c in checks),
                    "files": [{"file": c.name, "expected": c.expected, "actual": c.actual, "ok": c.ok, "cause": c.cause} for c in checks]})
    else:
        t = Table(title=f"{p.label}{' (synthetic)' if p.synthetic else ''}")
        for col in ("file", "expected", "actual", "ok"):
            t.add_column(col)
        for c in checks:
            t.add_row(c.name, c.expected[:16] + "…", (c.actual or "-")[:16] + ("…" if c.actual else ""),
                      ("[green]ok[/]" if c.cause == "ok" else f"[yellow]{c.cause}[/]") if c.ok else f"[red]{c.cause}[/]")
        results.print(t)
    bad = [c for c in checks if not c.ok]
    if bad:
        err.print(f"[bold red]error:[/] {escape(str(Path(folder) / bad[0].name))}: {escape(bad[0].cause)}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))
        raise typer.Exit(3)


@app.command()
def synth(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the synthetic snapshot into.")],
    config: Annotated[str, typer.Option("--config", help="Head configuration: real or tiny.")] = "real",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    author_code: AuthorCodeOpt = None,
    overwrite: OverwriteOpt = False,
    lm_head_vocab: Annotated[Optional[int], typer.Option("--lm-head-vocab", help="Also write an lm_head shard + index of this many rows (the real vocabulary is 248320).")] = None,
) -> None:
    """Write a synthetic snapshot (random bf16 weights, fixed seed) and its pins.json; labelled synthetic."""
    from .head.contract import CONFIGS
    from .synth.release import write_synth

    if config not in CONFIGS:
        err.print(f"[bold red]error:[/] --config must be one of {', '.join(sorted(CONFIGS))}, got {config!r}")
        raise typer.Exit(2)
    if lm_head_vocab is not None and lm_head_vocab < 1:
        err.print("[bold red]error:[/] --lm-head-vocab must be >= 1")
        raise typer.Exit(2)
    from .sources.author import require_author_code

    code = _run(lambda: require_author_code(author_code))
    pins = _run(lambda: write_synth(out_dir, config_name=config, seed=seed, author_code=code, overwrite=overwrite,
                                    lm_head_vocab=lm_head_vocab))
    err.print(f"synthetic snapshot ({config}, seed {seed}) in {out_dir}; pins {out_dir / 'pins.json'} ({pins.label})")


@app.command("synth-release")
def synth_release(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the release into.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    backbone: Annotated[str, typer.Option("--backbone", help="qwen3_5: a real tiny Qwen3.5 backbone and byte-level tokenizer (needs the reference extra); stub: the export's tensors only.")] = "qwen3_5",
    author_code: AuthorCodeOpt = None,
    variant: Annotated[str, typer.Option("--variant", help="tiny: make-tiny's configuration; other: another Qwen3.5 text "
                                         "configuration (widths, layer pattern, conv kernel), sharded with an index.")] = "tiny",
    size: Annotated[Optional[str], typer.Option("--size", help="9b: the 9B's text configuration at real width, written "
                                                "streamed (random bf16, 2 GiB shards, the real head configuration).")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="With --size: only the first N layers (4: 3 linear + 1 full).")] = None,
    vision: Annotated[bool, typer.Option("--vision", help="With --size: the 9B's vision tower too (27 blocks, 456M parameters, random bf16) and its preprocessor_config.json.")] = False,
    processor_file: Annotated[str, typer.Option("--processor-file", help="Where the tiny release keeps its image "
                                                "processor's settings: preprocessor_config.json (the older layout) or "
                                                "processor_config.json (transformers 5's, as make-tiny writes it).")] = "preprocessor_config.json",
    overwrite: OverwriteOpt = False,
) -> None:
    """Write a random release in clef-finetune's layout: tiny (make-tiny's head configuration), or at real width (--size)."""
    from .synth.release import MAKE_TINY_HEAD, OTHER_HEAD, VARIANTS, write_release
    from .sources.author import require_author_code

    if size is None and (layers is not None or vision):
        err.print(f"[bold red]error:[/] {'--layers' if layers is not None else '--vision'} needs --size "
                  f"(the tiny release always has its tiny tower)")
        raise typer.Exit(2)
    if size is not None:
        from .synth.wide import write_wide_release
        from .synth.tower import wide_tower

        code = _run(lambda: require_author_code(author_code))
        _run(lambda: write_wide_release(out_dir, size=size, layers=layers, seed=seed, author_code=code,
                                        overwrite=overwrite, log=_log, tower=wide_tower if vision else None))
        err.print(f"random {size} release{f' ({layers} layers)' if layers else ''}, seed {seed}, in {out_dir}; "
                  f"pin it with clef-export pin {out_dir}")
        return

    if backbone not in ("qwen3_5", "stub"):
        err.print(f"[bold red]error:[/] --backbone must be qwen3_5 or stub, got {backbone!r}")
        raise typer.Exit(2)
    if variant not in VARIANTS or (variant != "tiny" and backbone != "qwen3_5"):
        err.print(f"[bold red]error:[/] --variant must be one of {', '.join(VARIANTS)} (other needs --backbone qwen3_5), got {variant!r}")
        raise typer.Exit(2)

    from .layout import PROCESSOR_FILES

    if processor_file not in PROCESSOR_FILES:
        err.print(f"[bold red]error:[/] --processor-file must be one of {', '.join(PROCESSOR_FILES)}, got {processor_file!r}")
        raise typer.Exit(2)
    code = _run(lambda: require_author_code(author_code))  # before the 20 s import of the reference

    def go():
        if backbone == "qwen3_5":
            from .sources.reference import import_reference

            import_reference()
        return write_release(out_dir, config_name=MAKE_TINY_HEAD if variant == "tiny" else OTHER_HEAD, seed=seed,
                             author_code=code, backbone=backbone, overwrite=overwrite, variant=variant,
                             processor_file=processor_file)

    _run(go)
    err.print(f"tiny random release ({backbone} backbone, seed {seed}) in {out_dir}; pin it with clef-export pin {out_dir}")


@app.command()
def build(
    recipe: RecipeArg = None,
    source: SourceOpt = None,
    pins: PinsOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Output folder; the bundle lands in OUT/<recipe name>/.")] = Path("build"),
    overwrite: OverwriteOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check options, recipe, pins, source and output; build nothing.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Run the gate on the saved asset before it lands.")] = True,
    verify_records: Annotated[Optional[int], typer.Option("--verify-records", help="Records per function for a head's gate (a backbone's gate runs fixed lengths).")] = None,
    aot_compile: Annotated[bool, typer.Option("--aot", help="AOT-compile a head's .aimodel after the build (macOS, Xcode 27).")] = False,
    format: Annotated[Optional[str], typer.Option(
        "--format", help=FORMAT_HELP + " Picks the format's head recipe in conversion/ when none is named.")] = None,
    name: NameOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Build a head (ClefHeadGraph per bucket, one multi-function asset) or a backbone (the Qwen3.5 decoder with states) from its recipe, gated before it lands."""
    from .build import BuildConfig, build as do_build
    from .errors import UsageError
    from .head.backends import DEFAULT_FORMAT, backend
    from .recipe import format_recipe, load_recipe

    def go():
        if verify_records is not None and verify_records < 1:
            raise UsageError("--verify-records must be >= 1")
        if format is not None:
            backend(format)  # an unknown format: exit 2 naming it
        recipe_path = recipe or format_recipe(format or DEFAULT_FORMAT)
        r = load_recipe(recipe_path)
        cfg = BuildConfig(recipe=r, recipe_path=recipe_path, source=source, pins_path=_pins(pins, source), out=out, name=name,
                          overwrite=overwrite, dry_run=dry_run, verify=verify, verify_records=verify_records,
                          format=format, aot=aot_compile)
        if aot_compile and not dry_run:
            from .build import steps
            from .build.aot import find_coreai_build

            steps(r).refuse(cfg)  # --aot on a model or format that cannot take it: exit 2 first
            find_coreai_build()  # missing toolchain: exit 5 before the expensive work
        res = do_build(cfg, log=_log)
        if aot_compile and not dry_run:
            import time

            from .build.aot import AotConfig, aot_compile as compile_bundle

            t0 = time.perf_counter()
            res.manifest = compile_bundle(AotConfig(bundle=res.bundle), log=_log)
            res.seconds["aot"] = round(time.perf_counter() - t0, 3)
            res.seconds["total"] = round(res.seconds["total"] + res.seconds["aot"], 3)
        return r, res

    r, result = _run(go)
    human = _human(json_out)
    if dry_run:
        if json_out:
            _emit_json(result.plan)
        human.print(f"dry run: would build {escape(result.plan['bundle'])} from {escape(result.plan['source'])} "
                    f"({', '.join(result.plan['functions'])}); options, recipe, pins, hashes and free space checked")
        return
    if json_out:
        _emit_json(result.manifest.model_dump(mode="json"))  # the manifest, as written
    from .build import steps

    s = result.seconds
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in s.items() if k not in ("total", "export_stages"))
    human.print(f"[bold green]built[/] {escape(str(result.bundle))}: {steps(r).summary(result.manifest)}; "
                f"total {s['total']:.1f} s ({stages})" + (" [yellow](synthetic source)[/]" if result.record.get("synthetic") else ""))
    v = result.record.get("verify")
    if v is None:
        human.print("[yellow]not verified[/]: the gate was skipped (--no-verify or the recipe's verify.enabled)")
    else:
        human.print(f"verified: {escape(v['headline'])}")
        for note in v.get("notes", []):
            human.print(f"[yellow]not run here[/]: {escape(note)}")


@app.command("plan-weights")
def plan_weights_cmd(
    release: Annotated[Path, typer.Argument(help="The release folder (clef-finetune's layout) whose weights the plan measures.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="A compressed backbone recipe (conversion/backbone_pf64_int8.toml, _int8w32, _int4).")],
    out: Annotated[Path, typer.Option("--out", help="The plan file to write (JSON; a recipe names it with plan = \"...\").")],
    pins: PinsOpt = None,
    requests: Annotated[Optional[Path], typer.Option("--requests", help="JSONL of SystemOne request bodies: the calibration records (default: the project's set, conversion/requests.jsonl).")] = None,
    budget_dp: Annotated[Optional[float], typer.Option("--budget-dp", help="The end-to-end bar the chosen set meets: max |dp| over every option (default: the recipe's plan_budget_dp, 0.02).")] = None,
    records: Annotated[Optional[int], typer.Option("--records", help="At most this many calibration records (default: the recipe's plan_records, else every request).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where the plan's arithmetic runs: auto (CUDA, then Apple's MPS, then the CPU), cpu, cuda, mps. fp32 on each.")] = "auto",
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Rank the layers by one end-to-end pass each (the oracle, layers squared) instead of the one-pass first-order estimate.")] = False,
    estimate: Annotated[str, typer.Option("--estimate", help="How each record's per-layer changes are taken for the one-pass ranking: auto (the cheaper of carrying its options' gradients back and measuring each layer end to end, by its options and the layers), first-order (every record carried back).")] = "auto",
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure each decoder layer's sensitivity to the recipe's compression on the release's own weights, and choose the smallest set kept fp16 that meets the end-to-end budget."""
    from .build.plan_weights import PlanConfig, plan_weights
    from .recipe import load_recipe

    def go():
        cfg = PlanConfig(release=release, recipe=load_recipe(recipe), recipe_path=recipe, pins_path=_pins(pins, release),
                         out=out, requests=requests, budget_dp=budget_dp, records=records, overwrite=overwrite,
                         device=device, exhaustive=exhaustive, estimate=estimate)
        return plan_weights(cfg, log=_log)

    plan = _run(go)
    human = _human(json_out)
    if json_out:
        _emit_json(plan.model_dump(mode="json"))
    last = next((t for t in plan.trials if t.fp16_layers == plan.chosen), None)
    b = plan.bytes
    human.print(f"[bold green]planned[/] {escape(str(out))}: keep {plural(len(plan.chosen), 'layer')} fp16 "
                f"({plan.chosen or 'none'}) of {len(plan.ranking)} ranked; "
                + (f"max |dp| {last.max_abs_dp:.4g} <= {plan.budget_dp:g}; " if last else "")
                + f"weights {b['chosen']:,} bytes (all {plan.scheme.weights} {b['all_compressed']:,}, fp16 {b['fp16']:,})")


def _human(json_out: bool) -> Console:
    """Where the human-readable result goes: stdout, or stderr when stdout carries --json."""
    return err if json_out else results


def _print_report(report, console: Console) -> None:
    """Any gate's report: its table, its checks, its lines, its bars, its notes."""
    if report.columns():
        t = Table(title=escape(report.title()))
        for col in [*report.columns(), "result"]:
            t.add_column(col)
        for cells, verdict in report.rows():
            colour = {"pass": "green", "near-tie": "yellow"}.get(verdict, "red")
            t.add_row(*[escape(c) for c in cells], f"[{colour}]{verdict}[/]")
        console.print(t)
    for name, ok, detail in report.checks:
        console.print(f"  {'[green]✓[/]' if ok else '[red]✗[/]'} {escape(name)}: {escape(str(detail))}")
    for line in report.lines():
        console.print(f"  {escape(line)}")
    if report.bars():
        console.print("  bars: " + "; ".join(f"{k} {v:g}" for k, v in report.bars().items()))
    for note in report.notes:
        console.print(f"  [yellow]not run here[/]: {escape(note)}")


@app.command()
def verify(
    bundle: Annotated[Path, typer.Argument(help="A built bundle folder (with metadata.json): a head or a backbone.")],
    source: SourceOpt = None,
    pins: PinsOpt = None,
    records: Annotated[Optional[int], typer.Option("--records", help="Seeded random records per function (head; default 4).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    recorded: Annotated[Optional[Path], typer.Option("--recorded", help="An .npz of recorded records instead (head).")] = None,
    red: Annotated[bool, typer.Option("--red", help="Add perturbed arms that the gate must see (a backbone's always run).")] = False,
    transcript: Annotated[Optional[Path], typer.Option("--transcript", help="Write the JSON transcript here.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="A backbone's torch engine: auto, cpu, cuda or mps (default auto).")] = None,
    spot_check: Annotated[Optional[bool], typer.Option("--spot-check/--no-spot-check", help="A backbone too large for the runtime's numeric check: one chunk through the runtime against the torch engine (default: where it computes in fp32).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a head's asset against the author's head, or a backbone's against transformers' text model; exit 4 if any bar or check fails."""
    from .bundle import atomic_write_json
    from .gate import GateOptions, verify as do_verify

    if records is not None and records < 1:
        err.print("[bold red]error:[/] --records must be >= 1")
        raise typer.Exit(2)
    _run(lambda: _check_out_file(transcript, "--transcript"))
    opts = GateOptions(bundle=bundle, source=source, pins=pins, seed=seed, records=records, recorded=recorded, red=red,
                       device=device, spot_check=spot_check)
    report = _run(lambda: do_verify(opts, log=_log))
    if transcript:
        _run(lambda: atomic_write_json(transcript, report.transcript))
    if json_out:
        _emit_json(report.transcript)
    human = _human(json_out)
    _print_report(report, human)
    if not report.ok:
        for f in report.failures:
            err.print(f"[bold red]FAIL[/] {escape(f)}")
        raise typer.Exit(4)
    if report.notes and not getattr(report, "results", None):
        human.print(f"[bold green]checked[/]: {plural(len(report.checks), 'check')} passed; outputs not compared here (see above)")
    elif report.notes:
        human.print(f"[bold green]verified[/]: every bar passed; some checks not run here (see above)")
    else:
        human.print("[bold green]verified[/]: every bar passed")


def _check_out_file(path: Optional[Path], option: str) -> None:
    """An output file named by an option, checked before the work: not a folder, its folder writable."""
    from .errors import UsageError

    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder; name a file")
    parent = path.parent if str(path.parent) else Path(".")
    probe = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
    if not probe.is_dir():
        raise UsageError(f"{option} {path}: {probe} is not a folder")
    import os

    if not os.access(probe, os.W_OK):
        raise UsageError(f"{option} {path}: {probe} is not writable")


@app.command("check-release")
def check_release_cmd(
    release: Annotated[Path, typer.Argument(help="A release folder (clef-finetune's layout: backbone, tokenizer, head).")],
    bundle: Annotated[Path, typer.Option("--bundle", help="The bundle built from this release's head.")],
    table: Annotated[Optional[Path], typer.Option("--table", help="lm_head_fp16.bin of this release (default: built into a temporary folder).")] = None,
    requests: Annotated[Optional[Path], typer.Option("--requests", help="JSONL of SystemOne request bodies (default: the project's set, conversion/requests.jsonl).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where the author's model runs: cpu, cuda or mps.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="The author's model dtype: float32 or bfloat16.")] = "float32",
    backbone: Annotated[Optional[Path], typer.Option("--backbone", help="A backbone bundle of this release: its asset computes the hidden rows the head reads.")] = None,
    vision: Annotated[Optional[Path], typer.Option("--vision", help="A vision bundle of this release (with --backbone): its asset computes an image request's image rows at the image's native grid.")] = None,
    stream: Annotated[str, typer.Option("--stream", help="Run the author's model with one decoder layer's weights in memory at a time (text requests only): on, off, or auto (past 1e9 parameters: the 9B).")] = "auto",
    red: Annotated[Optional[str], typer.Option("--red", help="Perturb the shipped path (spans: one token late; lexical: another table's rows; state: the backbone's states reset every chunk; image: the image's rows zeroed); the run must fail.")] = None,
    transcript: Annotated[Optional[Path], typer.Option("--transcript", help="Write the JSON transcript here.")] = None,
    engine: EngineOpt = "auto",
    engine_device: Annotated[str, typer.Option("--engine-device", help="The torch engine's device: auto, cpu, cuda or mps (--device is the author's model's).")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Answer requests with the author's systemone and with the shipped path (the head asset on the same hidden rows, or with --backbone the backbone asset's rows); exit 4 on any disagreement."""
    from .bundle import atomic_write_json
    from .check import CheckConfig, check_release

    cfg = CheckConfig(release=release, bundle=bundle, table=table, requests=requests, device=device, dtype=dtype, red=red,
                      backbone=backbone, vision=vision, engine=engine, engine_device=engine_device, stream=stream)
    _run(lambda: _check_out_file(transcript, "--transcript"))  # before the run, not after it
    report = _run(lambda: check_release(cfg, log=_log))
    human = _human(json_out)
    if json_out:
        _emit_json(report.transcript["summary"])
    _print_report(report, human)
    if transcript:
        _run(lambda: atomic_write_json(transcript, report.transcript))
    if not report.ok:
        _fail(report.failures, "see --transcript")
    human.print(f"[bold green]answers agree[/]: {plural(report.transcript['summary']['checked'], 'request')}, "
                f"{plural(report.transcript['summary']['questions'], 'question')}")


@app.command()
def answer(
    dist: Annotated[str, typer.Argument(help="A release folder (what `release` writes), or a published one as OWNER/NAME@COMMIT.")],
    requests: Annotated[Optional[Path], typer.Option("--requests", help="JSONL of SystemOne request bodies; image paths relative to it, data URLs or {content_type, base64}.")] = None,
    vectors: Annotated[bool, typer.Option("--vectors", help="Check this host against the release's host/host-vectors.jsonl, step by step, instead.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the answers here (whole or not at all) instead of stdout.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out.")] = False,
    cache: Annotated[Optional[Path], typer.Option("--cache", help="Where a published release is downloaded (default: the Hub's cache).")] = None,
    engine: EngineOpt = "auto",
    device: EngineDeviceOpt = "auto",
) -> None:
    """Answer each request with the release's assets alone (no author code): one JSON line per request, in order; exit 4 if any could not be answered."""
    from .host.answer import AnswerConfig, answer_file

    if vectors == (requests is not None):
        err.print("[bold red]error:[/] answer takes --requests FILE or --vectors (one of them)")
        raise typer.Exit(2)
    if vectors:
        _answer_vectors(dist, cache, engine, device)
        return
    cfg = AnswerConfig(dist=dist, requests=requests, out=out, overwrite=overwrite, cache=cache, engine=engine, device=device)
    result = _run(lambda: answer_file(cfg, emit=lambda line: print(line, flush=True), log=_log))
    s = result.seconds
    _log(f"{plural(result.requests, 'request')} in {s['total']:.2f} s (encode {s['encode']:.2f}, vision {s['vision']:.2f}, "
         f"decoder {s['decoder']:.2f}, head {s['head']:.2f}, host {s['host']:.2f})" + (f"; answers in {out}" if out else ""))
    if result.failed:
        _fail(result.failed, "each failed line says why in the output")


def _answer_vectors(dist: str, cache: Optional[Path], engine: str, device: str) -> None:
    from .host.answer import check_release_vectors

    steps = _run(lambda: check_release_vectors(dist, cache, log=_log, engine=engine, device=device))
    table = Table("request", "step", "", "detail", box=None)
    for s in steps:
        table.add_row(s.request, s.step, "pass" if s.ok else "[bold red]FAIL[/]", escape(s.detail))
    results.print(table)
    bad = [f"{s.request}: {s.step}: {s.detail}" for s in steps if not s.ok]
    if bad:
        _fail(bad, "the table above")
    results.print(f"[bold green]host vectors agree[/]: {plural(len({s.request for s in steps}), 'request')}, "
                  f"{plural(len(steps), 'step')}")


@app.command()
def serve(
    dist: Annotated[str, typer.Argument(help="A release folder (what `release` writes), or a published one as OWNER/NAME@COMMIT.")],
    host: Annotated[str, typer.Option("--host", help="The address to bind (beyond loopback only with --token).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    token: Annotated[Optional[str], typer.Option("--token", envvar="CLEF_SERVE_TOKEN", help="Every request must carry Authorization: Bearer <token>.")] = None,
    queue: Annotated[int, typer.Option("--queue", help="Requests waiting behind the one answered, past which the server answers 429 with Retry-After.")] = 64,
    cache: Annotated[Optional[Path], typer.Option("--cache", help="Where a published release is downloaded (default: the Hub's cache).")] = None,
    engine: EngineOpt = "auto",
    device: EngineDeviceOpt = "auto",
    recycle_growth: Annotated[float, typer.Option("--recycle-growth", help="Replace the worker process that holds the assets once its memory grew this fraction past what it held after its first 10 answers (between two requests; none lost).")] = 0.05,
    recycle_after: Annotated[int, typer.Option("--recycle-after", help="Replace the worker after this many answers as well (0: by memory only).")] = 0,
) -> None:
    """Serve the release on Cloudflare's route and envelope (POST [/client/v4]/accounts/<account>/ai/run/@cf/cloudflare/<clef|clef-flash>, GET /health); SIGINT / SIGTERM finish what is in flight and exit 0."""
    from .host.server import ServeConfig, serve as serve_release

    cfg = ServeConfig(dist=dist, host=host, port=port, token=token, queue=queue, cache=cache, engine=engine, device=device,
                      recycle_growth=recycle_growth, recycle_after=recycle_after)
    result = _run(lambda: serve_release(cfg, log=_log))
    _log(f"stopped after {plural(result['answered'], 'answer')}")


@app.command()
def aot(
    bundle: Annotated[Path, typer.Argument(help="A built bundle folder.")],
    platform: Annotated[str, typer.Option("--platform")] = "macOS",
    preferred_compute: Annotated[str, typer.Option("--preferred-compute")] = "gpu",
    architecture: Annotated[str, typer.Option("--architecture")] = "h16c",
    json_out: JsonOpt = False,
) -> None:
    """AOT-compile the asset with `xcrun coreai-build` (macOS, Xcode 27); fills aot and compilation."""
    from .build.aot import AotConfig, aot_compile

    cfg = AotConfig(bundle=bundle, platform=platform, preferred_compute=preferred_compute, architecture=architecture)
    m = _run(lambda: aot_compile(cfg, log=_log))
    if json_out:
        _emit_json(m.model_dump(mode="json"))
    _human(json_out).print(f"[bold green]compiled[/] {escape(str(bundle))} for {architecture} in {m.aot.seconds:.2f} s")


@app.command()
def release(
    recipes: Annotated[Optional[list[Path]], typer.Argument(
        help="Recipe TOMLs, one bundle each (default: conversion/head_bucket_fp16w32.toml); with a backbone recipe, dist/ also holds host/lm_head_fp16.bin.")] = None,
    source: SourceOpt = None,
    pins: PinsOpt = None,
    dist: Annotated[Path, typer.Option("--dist", help="The release folder.")] = Path("dist"),
    overwrite: OverwriteOpt = False,
    verify_records: VerifyRecordsOpt = None,
    aot_mode: Annotated[str, typer.Option("--aot", help="auto (when xcrun coreai-build exists), on, off.")] = "auto",
    name: NameOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Build, verify, AOT where available, and write dist/ with SHA256SUMS for every file."""
    from .recipe import DEFAULT_RECIPE, load_recipe
    from .release import ReleaseConfig, release as do_release

    if aot_mode not in ("auto", "on", "off"):
        err.print(f"[bold red]error:[/] --aot must be auto, on or off, got {aot_mode!r}")
        raise typer.Exit(2)

    def go():
        paths = recipes or [DEFAULT_RECIPE]
        return do_release(ReleaseConfig(recipes=tuple((load_recipe(p), p) for p in paths), source=source,
                                        pins_path=_pins(pins, source), name=name, dist=dist, overwrite=overwrite, verify_records=verify_records, aot=aot_mode), log=_log)

    summary = _run(go)
    if json_out:
        _emit_json(summary)
    _human(json_out).print(f"[bold green]released[/] {escape(summary['dist'])}: {plural(len(summary['files']), 'file')} + SHA256SUMS")


@app.command()
def publish(
    dist: Annotated[Path, typer.Argument(help="A release's dist/ (from `clef-export release`).")],
    repo: Annotated[str, typer.Option("--repo", help="The Hub repo, OWNER/NAME (created when missing).")],
    revision: Annotated[str, typer.Option("--revision", help="The branch to commit to (created when missing).")] = "main",
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    check: Annotated[Optional[Path], typer.Option("--check", help="A check-release transcript of these assets: its summary goes in the card.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check dist/ and print the plan and the card; send nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Upload dist/ in one commit with a model card written from its records; read it back by commit."""
    from .release.publish import PublishConfig, publish as do_publish

    cfg = PublishConfig(dist=dist, repo=repo, revision=revision, private=private, check=check, dry_run=dry_run)
    result = _run(lambda: do_publish(cfg, log=_log))
    if json_out:
        _emit_json(result)
    elif dry_run:
        for f in result["files"]:
            err.print(f"  {f['bytes']:>14,}  {escape(f['path'])}")
        sys.stdout.write(result["card"])
    if dry_run:
        err.print(f"[bold green]plan[/] {plural(len(result['files']), 'file')}, {result['bytes']:,} bytes to {repo}@{revision}; nothing sent")
    else:
        _human(json_out).print(f"[bold green]published[/] {repo} commit {result['commit']}")


@app.command("lm-head-table")
def lm_head_table_cmd(
    source: SourceOpt = None,
    pins: PinsOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Folder for lm_head_fp16.bin and its sidecar.")] = Path("build/host"),
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write lm_head.weight as raw fp16 (the host's lexical table) with a checked JSON sidecar."""
    from .sources.lm_head import lm_head_table
    from .sources.pins import load_pins

    path = _pins(pins, source)
    result = _run(lambda: lm_head_table(source, load_pins(path), path, out, overwrite=overwrite, log=_log))
    if json_out:
        _emit_json(result)
    _human(json_out).print(f"[bold green]wrote[/] {escape(result['table'])}: {result['shape']} fp16, {result['bytes']:,} bytes, sha256 {result['sha256'][:16]}…")


@app.command("verify-artifact")
def verify_artifact(bundle: Annotated[Path, typer.Argument(help="A built bundle folder.")], json_out: JsonOpt = False) -> None:
    """Re-hash the bundle tree against its manifest, main.hash and build record; exit 3 on any change."""
    from .gate import check_artifact

    result = _run(lambda: check_artifact(bundle))
    if json_out:
        _emit_json(result)
    _human(json_out).print(f"[bold green]ok[/] {escape(str(bundle))}: {plural(result['files'], 'file')} match the build record and manifest")


@app.command()
def schema(format: Annotated[Optional[str], typer.Option("--format", help=FORMAT_HELP + " (a head's; a backbone is aimodel)")] = None,
           kind: Annotated[str, typer.Option("--kind", help="head (decision-head), backbone (decision-backbone), weight-plan (plan-weights' output), or weight-map (a backbone bundle's weight-map.safetensors metadata).")] = "head") -> None:
    """Print the JSON Schema of metadata.json for a head or a backbone, of a weight plan, or of a weight map (manifests/*.schema.json hold them)."""
    from .gate import model_named

    if kind in ("weight-plan", "weight-map"):
        from .backbone.plan import json_schema as plan_schema
        from .engine.weight_map import json_schema as map_schema

        _emit_json(plan_schema() if kind == "weight-plan" else map_schema())
        return
    _emit_json(_run(lambda: model_named(kind).schema(format)))


@app.command()
def inspect(bundle: Annotated[Path, typer.Argument(help="A built bundle folder: a head or a backbone.")], json_out: JsonOpt = False) -> None:
    """Functions, inputs, states, outputs, sizes and source, from the asset and the manifest (head or backbone)."""
    from .gate import inspect as inspect_bundle

    info = _run(lambda: inspect_bundle(bundle))
    if json_out:
        _emit_json(info)
        return
    extra = f", compute {info['compute']}" if "compute" in info else ""
    results.print(f"[bold]{escape(info['name'])}[/] ({info['kind']}, {info['format']}), weights {info['weights']}{extra}, "
              f"{info['asset_bytes']:,} bytes")
    src = info["source"]
    results.print(f"source: {escape(src['hf_id'])}" + (f"@{src['revision'][:12]}" if src.get("revision") else " (local release)"))
    if "language" in info:
        results.print("language: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in info["language"].items()))
    t = Table()
    kinds = [k for k in ("inputs", "states", "outputs") if any(k in fn for fn in info["functions"])]
    for col in ("function", *kinds):
        t.add_column(col)
    for fn in info["functions"]:
        t.add_row(fn["name"], *[", ".join(f"{i['name']} {i['shape']} {i['dtype']}" for i in fn.get(k, [])) for k in kinds])
    results.print(t)


def main() -> None:
    """The entry point. A signal raises ``interrupts.Interrupt`` (not a ``KeyboardInterrupt``, which
    click would turn into "Aborted!" and exit 1 outside ``_run``): one line and exit 130 everywhere."""
    from .interrupts import Interrupt, done, install, interrupted

    install()  # Ctrl-C and SIGTERM: exit 130 at any moment, nothing landed (interrupts; entry installs them first)
    try:
        app()
    except Interrupt:
        done()
        err.print("[bold red]interrupted[/]: nothing was written")
        sys.exit(130)
    except SystemExit as exc:
        # a signal held (a runtime call, a destructor) with no safe point after it: not a success;
        # a landing step raises on it, so nothing landed after it came
        if exc.code in (0, None) and interrupted():
            done()
            err.print("[bold red]interrupted[/]: nothing was written")
            sys.exit(130)
        done()  # the command's own exit code stands
        raise
    done()


if __name__ == "__main__":
    main()
