"""The Core AI asset format (macOS 27), for every model: import the toolchain, name composite graphs
reproducibly, specialise a dynamic function per bucket, save (``main.mlirb`` with every blob named
after its bytes, ``main.hash``), check a saved asset against its manifest's digest, run and describe it
with the Core AI runtime (which runs on Linux CPUs). The bytes are the same on any machine with the
same tool versions."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from ..digest import sha256_file
from ..errors import IntegrityError, ToolchainError
from ..manifest import check_file, check_file_size
from .mlirb import Fill
from ..interrupts import run_async

FORMAT = "aimodel"
SUFFIX = ".aimodel"
AOT = True  # `xcrun coreai-build compile` takes this format
NAMING_SEED = 0x0C1EF  # coreai's composite-graph suffixes, drawn from this seed: reproducible bytes
MLIRB, HASH = "main.mlirb", "main.hash"


# ---------------------------------------------------------------- manifest


def check_files(m: Any, asset: Path, digest: str | None = None, hashed: bool = True) -> list[tuple[str, bool, str]]:
    """``main.mlirb`` against the manifest and ``main.hash``; raises ``IntegrityError`` naming the
    first broken file. ``digest``: main.mlirb's sha256 from a read the caller made anyway (the
    backbone gate's weight comparison); ``hashed=False``: sizes and ``main.hash`` only, the sha256
    left to a later call with ``digest``."""
    hash_file = asset / HASH
    if not hashed:
        check_file_size(asset / MLIRB, m.export.main_mlirb)
        if not hash_file.is_file():
            raise IntegrityError(f"{hash_file}: missing")
        return []
    digest = check_file(asset / MLIRB, m.export.main_mlirb, digest)
    try:
        stored = hash_file.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{hash_file}: missing") from None
    if stored.hex() != digest:
        raise IntegrityError(f"{hash_file}: does not hold the sha256 of main.mlirb")
    return [("main.mlirb sha256 = manifest", True, digest[:16]), ("main.hash = sha256(main.mlirb)", True, "ok")]


# ---------------------------------------------------------------- export


def import_toolchain():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import coreai_torch
            from coreai_torch import TorchConverter  # noqa: F401
    except ImportError as exc:
        raise ToolchainError(f"coreai-torch / coreai-core are required to export ({exc.name} missing)") from None
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


def specialise(program, entry: str, shapes: dict[int, dict[str, tuple[int, ...]]], name_of: Callable[[int], str]) -> None:
    """One static function per bucket from the dynamic entrypoint ``entry`` (``shapes``: bucket -> the
    dynamic inputs' static shapes), each named ``name_of(bucket)``."""
    from coreai._compiler.ir import StringAttr
    from coreai.authoring.graph_builder import GraphOp

    program.set_static_shape_config(entry, {f"b{b}": s for b, s in shapes.items()})  # -> graphs <entry>_b512, …
    prefix = f"{entry}_b"
    # coreai names the clones <entrypoint>_<key>; the manifest's names are the model's own (private IR
    # access, pinned to coreai-core 1.0.0b3)
    with program._module:  # noqa: SLF001
        for op in program._module._body.region.blocks[0].operations:  # noqa: SLF001
            if isinstance(op, GraphOp) and op.sym_name.value.startswith(prefix):
                op.attributes["sym_name"] = StringAttr.get(name_of(int(op.sym_name.value[len(prefix):])))


def save_streamed(program, asset_dir: Path, metadata, write_hash: bool = True):
    """``save_asset`` without reading ``main.mlirb`` back whole (it does, to hash it: 16 GB of
    anonymous memory for a 9B backbone): the asset folder and its metadata through coreai's own
    writer, the bytecode serialised to its file, ``main.hash`` its sha256 taken in blocks. Private
    coreai API, pinned with coreai-core 1.0.0b3; a test holds the files byte-equal to ``save_asset``."""
    from coreai.authoring.asset import _COREAI_PRODUCER, AIModelAsset, _AIModelAsset

    asset_dir = Path(asset_dir)
    if asset_dir.suffix != SUFFIX:
        raise ValueError(f"{asset_dir}: an asset folder ends in {SUFFIX}")
    asset_dir.mkdir(parents=True)
    asset = _AIModelAsset._create(path=str(asset_dir), metadata=metadata)  # noqa: SLF001
    program._save_bytecode(asset._program_bytecode_path)  # noqa: SLF001

    def _stamp(m) -> None:
        m.creation_date = time.time()
        m._producer = _COREAI_PRODUCER  # noqa: SLF001

    asset.update_metadata(updates=_stamp)
    if write_hash:  # ``save`` writes it once, after the blobs are renamed
        asset._program_hash_path.write_bytes(bytes.fromhex(sha256_file(asset._program_bytecode_path)))  # noqa: SLF001
    return AIModelAsset._wrap(asset)  # noqa: SLF001


def save(program, asset_dir: Path, description: dict[str, str], log: Callable[[str], None] = lambda msg: None,
         fill: Fill | None = None):
    """``save_asset``, then the same bytes from the same content on any machine: weight blobs named
    after their bytes (the compiler keys them by a per-process hash), ``main.hash`` to match, the
    asset's metadata in a fixed key order with ``SOURCE_DATE_EPOCH`` as its creation date.

    ``fill`` (``mlirb.Fill``): resources the program declares empty (``mlirb.inflate``): the bytecode is
    written small and ``main.mlirb`` rewritten once with their data, named as above.

    Returns what was hashed on the way (``mlirb.Written``: the file's sha256 and every resource's),
    for a gate that proves the file on disk is those bytes by one more hash of the file."""
    from coreai.runtime import AIModelAssetMetadata

    from ..bundle import atomic_write_bytes, dumps_json
    from .mlirb import inflate, stable_resource_names
    from ..provenance import source_date_epoch

    meta = AIModelAssetMetadata()
    meta.author = description["author"]
    meta.license = description["license"]
    meta.model_description = description["description"]
    asset = save_streamed(program, asset_dir, meta, write_hash=False)
    epoch = source_date_epoch()
    if epoch is not None:
        asset.update_metadata(lambda m: setattr(m, "creation_date", float(epoch)))
    t0 = time.perf_counter()
    if fill is None:
        # one read of main.mlirb: every blob's sha256 (its new name) and the renamed file's (main.hash)
        written = stable_resource_names(asset_dir / MLIRB)
    else:
        part = asset_dir / (MLIRB + ".part")
        written = inflate(asset_dir / MLIRB, part, fill.sizes, fill.supply, upcoming=fill.upcoming, planned=fill.planned)
        os.replace(part, asset_dir / MLIRB)
    labels = {"supply": "waiting for converted bytes", "hashes": "waiting for the hashes", "write": "copying and writing"}
    waits = ", ".join(f"{labels[k]} {v:.1f} s" for k, v in (written.waits or {}).items())
    log(f"{written.renamed} weight blobs named after their sha256 in {time.perf_counter() - t0:.2f} s"
        + (f", {len(fill.sizes)} of them converted into place ({waits})" if fill else ""))
    atomic_write_bytes(asset_dir / HASH, bytes.fromhex(written.sha256))
    # the runtime writes its keys in hash-map order; the same content in a fixed order
    meta_path = asset_dir / "metadata.json"
    atomic_write_bytes(meta_path, dumps_json(json.loads(meta_path.read_text(encoding="utf-8")), sort_keys=True))
    return written


# ---------------------------------------------------------------- read back, run, describe


def cannot_run() -> str | None:
    """Why outputs cannot be compared on this machine, or None: the Core AI runtime runs here."""
    return None


@contextlib.asynccontextmanager
async def runner(asset: Path, names: list[str]):
    """``call(function, arrays) -> logits`` through the Core AI runtime. All calls of all functions
    go through one bounded queue: the CPU runtime runs a call on about one core."""
    import asyncio

    import numpy as np
    from coreai.runtime import NDArray

    from .runtime_compile import executable
    from ..quiet import native_stderr

    slots = asyncio.Semaphore(max(1, min(4, os.cpu_count() or 1)))
    # the runtime's own lines (written as it loads) off the terminal unless --verbose; fd 2 captured
    # while loading only, so a server's own errors still reach its log
    async with contextlib.AsyncExitStack() as stack:
        with native_stderr():
            model = await stack.enter_async_context(executable(asset))
            fns = {name: model.load_function(name) for name in names}
        for name, fn in fns.items():
            if fn is None:
                raise IntegrityError(f"{asset}: function {name} not found")

        async def call(name: str, arrays: dict[str, Any]) -> Any:
            async with slots:
                out = await fns[name]({k: NDArray(np.ascontiguousarray(v)) for k, v in arrays.items()})
                return np.array(out["logits"].numpy(), dtype=np.float32, copy=True)

        yield call


async def _describe(asset: Path) -> list[dict[str, Any]]:
    from .runtime_compile import executable

    out = []
    async with executable(asset) as model:
        for name in model.function_names:
            d = model.load_function(name).desc
            out.append({
                "name": name,
                "inputs": [{"name": n, "shape": list(d.input_descriptor(n).shape), "dtype": str(d.input_descriptor(n).dtype)}
                           for n in d.input_names],
                "outputs": [{"name": n, "shape": list(d.output_descriptor(n).shape),
                             "dtype": str(d.output_descriptor(n).dtype)} for n in d.output_names],
            })
    return out


def describe(asset: Path) -> list[dict[str, Any]]:
    """Functions, inputs and outputs as the Core AI runtime reports them."""

    from ..quiet import native_stderr

    with warnings.catch_warnings(), native_stderr():
        warnings.simplefilter("ignore")
        return run_async(lambda: _describe(Path(asset)))
