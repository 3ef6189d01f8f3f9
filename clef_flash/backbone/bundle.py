"""A backbone bundle read back: its files against its manifest (``main.mlirb``, ``main.hash``, the
tokenizer files) and its descriptor (the runtime's, or the bytecode's without compiling it) against
the manifest's interface. The gate and check-release's backbone side both start here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..digest import sha256_file
from ..errors import IntegrityError
from .source import TOKENIZER_DIR
from ..engine.bundle_read import read_asset_bundle
from ..progress import plural


def check_files(bundle: Path, hashed: bool = True):
    """The manifest, its asset and tokenizer files; ``IntegrityError`` naming the first broken file.
    ``hashed=False``: main.mlirb's sha256 is left to the caller (``aimodel.check_files`` with a digest)."""
    from .manifest import BackboneManifest

    m, asset, checks = read_asset_bundle(bundle, BackboneManifest, "backbone", hashed)
    for name, want in m.tokenizer.items():
        f = Path(bundle) / TOKENIZER_DIR / name
        if not f.is_file() or sha256_file(f) != want:
            raise IntegrityError(f"{f}: missing or its sha256 differs from the manifest's")
    checks = checks + [("tokenizer files = manifest", True, f"{plural(len(m.tokenizer), 'file')}")]
    if m.export.weight_map is not None:  # the torch engine's way into main.mlirb (engine.weight_map)
        from ..engine.weight_map import MAP_FILE

        f = Path(bundle) / MAP_FILE
        if not f.is_file() or sha256_file(f) != m.export.weight_map.sha256:
            raise IntegrityError(f"{f}: missing or its sha256 differs from the manifest's")
        checks.append(("weight map = manifest", True, f"{m.export.weight_map.bytes:,} bytes"))
    c = m.export.compression
    if c is not None and c.plan is not None and c.plan.shipped:  # fp16_layers = "auto": the build's own plan
        from .plan import check_shipped_plan

        checks.append(("weight plan = manifest's fp16 layers", True, check_shipped_plan(bundle, c)))
    return m, asset, checks


_DTYPES = {"Float32": "fp32", "Float16": "fp16", "Int32": "int32"}


def bytecode_descriptor(asset: Path) -> dict[str, Any]:
    """Functions, inputs, states and outputs as the asset's bytecode declares them, read without
    compiling it: the runtime's load writes a compiled fp32 copy of the weights first (about 32 GB
    for a 9B), and coreai's ``AIModelAsset.summary`` reads the whole file into memory (16 GB), so it
    reads a skeleton of ``main.mlirb`` (``mlirb.skeleton``: every blob's data left out, a few KB)."""
    import shutil
    import tempfile

    from coreai.authoring.asset import AIModelAsset

    from ..formats.mlirb import skeleton

    with tempfile.TemporaryDirectory(prefix="clef-descriptor-") as tmp:
        copy = Path(tmp) / Path(asset).name
        copy.mkdir()
        shutil.copy2(Path(asset) / "metadata.json", copy / "metadata.json")
        skeleton(Path(asset) / "main.mlirb", copy / "main.mlirb")
        s = AIModelAsset.load(copy).summary(include_statistics=False)
        functions = list(s.function_names)
        raw = {f: {kind: list(read(f)) for kind, read in (("inputs", s.function_inputs), ("states", s.function_states),
                                                          ("outputs", s.function_outputs))} for f in functions}

    def spec(text: str) -> dict[str, Any]:  # "NDArray (Float32, 1 × 64 × 4096)", "NDArray (Int32, 1 × ?)"
        got = re.fullmatch(r"NDArray \((\w+), (.*)\)", text.strip())
        if not got:
            return {"shape": [], "dtype": text}
        dims = [-1 if d.strip() == "?" else int(d) for d in got.group(2).split("×")]
        return {"shape": dims, "dtype": _DTYPES.get(got.group(1), got.group(1))}

    return {"functions": functions, "signatures": {f: {kind: {n: spec(t) for n, t in pairs} for kind, pairs in io.items()}
                                                   for f, io in raw.items()}}


def descriptor_checks(asset: Path, m, compiled: bool = True) -> list[tuple[str, bool, str]]:
    """The manifest's interface against the runtime's descriptor (``compiled``) or the bytecode's:
    every function it names, each with its own states' slots."""
    from ..backbone.runtime import describe
    from .contract import states_at
    from .manifest import functions_of

    d = describe(asset) if compiled else bytecode_descriptor(asset)
    where = "runtime" if compiled else "bytecode"
    functions = functions_of(m)
    names = sorted(f.name for f in functions)
    out = [(f"functions = [{', '.join(names)}] ({where})", sorted(d["functions"]) == names, str(d["functions"]))]

    def same(fn: str, kind: str, got: dict[str, Any], want: dict[str, Any]) -> None:
        for name, (shape, dtype) in want.items():
            g = got.get(name)
            ok = g is not None and g["shape"] == shape and dtype in g["dtype"].replace("float", "fp").replace("int32", "int32")
            out.append((f"{fn} {kind} {name} {shape} {dtype}", ok, "ok" if ok else f"the {where} says {g}"))
        extra = sorted(set(got) - set(want))
        out.append((f"{fn}: no other {kind}", not extra, "ok" if not extra else ", ".join(extra)))

    def specs(tensors) -> dict[str, tuple[list, str]]:
        return {n: ([-1 if isinstance(x, str) else x for x in t.shape], t.dtype) for n, t in tensors.items()}

    state_dtype = {n: t.dtype for n, t in m.interface.states.items()}
    main_shapes = {n: tuple(t.shape) for n, t in m.interface.states.items()}
    for f in functions:
        sig = d.get("signatures", {}).get(f.name)
        if sig is None:
            continue
        states = {n: (list(s), state_dtype[n]) for n, s in states_at(main_shapes, f.context).items()}
        same(f.name, "input", sig["inputs"], specs(m.interface.inputs))
        same(f.name, "state", sig["states"], states)
        same(f.name, "output", sig["outputs"], specs(m.interface.outputs))
    return out
