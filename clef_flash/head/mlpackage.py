"""Backend ``mlpackage``: the Core ML package, the same head for Macs without Core AI (macOS 15+).

How it works: docs/modules.md."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from pydantic import Field

from . import contract
from ..digest import tree_bytes
from ..errors import IntegrityError, ToolchainError
from ..manifest import Aot, Compilation, FileDigest, Head, Seconds, Strict, check_file, pads
from ..progress import plural

FORMAT = "mlpackage"
SUFFIX = ".mlpackage"
RECIPE = "head_bucket_fp16w32_mlpackage.toml"  # in conversion/: what `build --format mlpackage` builds
SCHEMA_FILE = "metadata-mlpackage.schema.json"
AOT = False  # coreai-build compiles .aimodel assets only
DEPLOYMENT_TARGET = "macOS15"  # the first release with multi-function models (spec 9, opset CoreML8)
OPSET = "CoreML8"
SPECIFICATION_VERSION = 9  # macOS 15 / iOS 18: multi-function models
FP16_MIN_ELEMENTS = 16  # smaller constants (scalars, shapes) stay as they are: no storage to save
MODEL_FILE = "Data/com.apple.CoreML/model.mlmodel"
WEIGHT_FILE = "Data/com.apple.CoreML/weights/weight.bin"
PREDICTIONS_NOTE = ("coremltools cannot run Core ML predictions on Linux: there `clef-export verify` checks the "
                    "package's functions, inputs, outputs, fp32 math and every stored weight against the "
                    "author's; on macOS 15+ it also runs each function against the author's head")
_ARRAY_DTYPES = {"FLOAT32": "f32", "INT32": "i32", "FLOAT16": "f16", "DOUBLE": "f64"}


# ---------------------------------------------------------------- manifest


class Export(Strict):
    """The ``export`` section of a Core ML package manifest."""

    mlpackage_bytes: int = Field(ge=0)
    model: FileDigest  # Data/com.apple.CoreML/model.mlmodel
    weight_bin: FileDigest  # Data/com.apple.CoreML/weights/weight.bin
    weight_storage: Literal["fp16", "fp32"]
    compute_precision: Literal["fp32"]
    minimum_deployment_target: str
    coremltools: str
    seconds: Seconds
    predictions: str


class Manifest(Strict):
    """``metadata.json`` of a Core ML package bundle: the same ``decision-head`` shape, naming its
    format (the published ``.aimodel`` manifest has no ``format`` key and stays key for key)."""

    metadata_version: str
    kind: str
    format: Literal["mlpackage"]
    name: str
    assets: dict[str, str]
    head: Head
    export: Export
    aot: Aot | None
    compilation: Compilation


def manifest(common: dict[str, Any], recipe, asset_dir: Path, outputs: dict[str, str], seconds: Seconds) -> Manifest:
    from ..provenance import tool_versions

    def part(rel: str) -> FileDigest:
        return FileDigest(bytes=(asset_dir / rel).stat().st_size, sha256=outputs[f"{asset_dir.name}/{rel}"])

    return Manifest(
        **common,
        format=FORMAT,
        export=Export(
            mlpackage_bytes=tree_bytes(asset_dir),
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


def record_parameters() -> dict[str, Any]:
    return {"package_item_ids": "uuid5 of each item's path", "spec_serialisation": "deterministic"}


def asset_digest(m: Manifest) -> str:
    """weight.bin's digest names the package (the spec is small and derived)."""
    return m.export.weight_bin.sha256


def sizes(m: Manifest) -> dict[str, int]:
    return {"asset_bytes": m.export.mlpackage_bytes, "weight_bin_bytes": m.export.weight_bin.bytes}


def summary(m: Manifest) -> str:
    return f"weight.bin {m.export.weight_bin.bytes:,} bytes ({m.export.weight_storage})"


def check_files(m: Manifest, asset: Path) -> list[tuple[str, bool, str]]:
    checks = []
    for rel, want in ((MODEL_FILE, m.export.model), (WEIGHT_FILE, m.export.weight_bin)):
        digest = check_file(asset / rel, want)
        checks.append((f"{Path(rel).name} sha256 = manifest", True, digest[:16]))
    return checks


def import_toolchain():
    """coremltools, quietly (it warns about untested torch versions and missing macOS libraries;
    its progress bars would flood the build's log)."""
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            import coremltools as ct
    except ImportError as exc:
        raise ToolchainError(f"coremltools is required for the mlpackage format ({exc.name} missing)") from None
    return ct


_PASS = "clef::fp16_storage"
# While functions are converted for one package, equal fp16 constants are one array: the four
# functions' weights take the memory of one, and sharing them is an identity test (``share_weights``).
_INTERNED: dict[tuple, np.ndarray] | None = None


def _intern(a: np.ndarray) -> np.ndarray:
    if _INTERNED is None:
        return a
    key = (a.dtype.str, a.shape, hashlib.sha256(a.tobytes()).digest())
    return _INTERNED.setdefault(key, a)


@contextlib.contextmanager
def interning(seed: Any = ()):
    """Equal fp16 constants are one array while this is on; ``seed`` arrays (the graph's own fp16
    parameters, as numpy views) come first, so a weight stored as the parameter is that memory."""
    global _INTERNED
    _INTERNED = {}
    for a in seed:
        _intern(a)
    try:
        yield
    finally:
        _INTERNED = None


def _parameter_views(graph) -> list[np.ndarray]:
    """The graph's fp16 parameters as numpy views (no copy), with attention's packed in-projection
    also as its q, k, v thirds (each stored on its own)."""
    out = []
    for name, t in graph.state_dict().items():
        if t.dtype.is_floating_point and t.dtype.itemsize == 2 and t.numel() >= FP16_MIN_ELEMENTS:
            a = t.detach().numpy()
            out.extend(piece for _, piece in _pieces(name, a))
    return out


@contextlib.contextmanager
def validate_once():
    """coremltools validates the whole program after each of its ~100 passes (a fifth of a
    conversion, more on a four-function program); while this is on, a pipeline validates the
    program once, after its last pass, where the result is checked the same way."""
    from coremltools.converters.mil.mil import Program
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    validate, apply = Program.validate, PassPipelineManager.apply_pipeline

    def apply_then_validate(prog, pass_pipeline):
        Program.validate = lambda self, check_essential_scope=False: None
        try:
            apply(prog, pass_pipeline)
        finally:
            Program.validate = validate
        prog.validate(check_essential_scope=True)

    PassPipelineManager.apply_pipeline = staticmethod(apply_then_validate)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = staticmethod(apply)


def register_fp16_pass() -> str:
    """Register (once) the pass that stores exact fp16 constants as fp16.

    The torch frontend folds ``weight.float()`` into an fp32 constant, so ``compute_precision=FLOAT32``
    would store 4 bytes per parameter. Constants whose every value round-trips through fp16 go back
    to fp16 storage behind ``constexpr_cast`` (fp16 -> fp32 at load time): the math stays fp32 and
    no value changes, by construction."""
    import_toolchain()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.helper import block_context_manager
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY, register_pass

    if _PASS in PASS_REGISTRY:
        return _PASS

    class fp16_storage(AbstractGraphPass):  # noqa: N801 (coremltools names passes in snake case)
        def apply(self, prog):
            for func in prog.functions.values():
                self._block(func)

        @block_context_manager
        def _block(self, block):
            for op in list(block.operations):
                for inner in op.blocks:
                    self._block(inner)
                if op.op_type != "const":
                    continue
                val = op.outputs[0].val
                if not isinstance(val, np.ndarray) or val.dtype != np.float32 or val.size < FP16_MIN_ELEMENTS:
                    continue
                stored = val.view(np.ndarray)  # a weight the frontend kept in fp16 storage, or fp32
                if stored.dtype == np.float16:
                    half = np.ascontiguousarray(stored)  # fp16 values: exact by construction
                else:
                    half = stored.astype(np.float16)
                    if not np.array_equal(half.astype(np.float32), stored):
                        continue  # not exact in fp16: stays fp32
                half = _intern(half)
                new = mb.constexpr_cast(source_val=half, output_dtype="fp32", before_op=op, name=f"{op.name}_fp16")
                block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0], new_var=new)
                block.remove_ops([op])

    register_pass(namespace="clef")(fp16_storage)
    return _PASS


# ---------------------------------------------------------------- fp16 storage from the frontend

_F32 = np.dtype(np.float32)


def _as_f32(x: Any) -> Any:
    """A value with fp16 storage as a real fp32 array (anything else as it is); lists and tuples
    element by element."""
    if isinstance(x, Fp16AsFp32):
        return x.view(np.ndarray).astype(np.float32)
    if isinstance(x, (list, tuple)):
        return type(x)(_as_f32(v) for v in x)
    return x


def _differ_fp16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a != b`` for fp16 values given as their bits (uint16): the bits differ, unless both are
    zeros (+0 == -0); a NaN differs from everything, itself included."""
    if a.shape == b.shape and a.strides == b.strides and a.ctypes.data == b.ctypes.data:
        return (a & 0x7FFF) > 0x7C00  # the same memory (how coremltools mostly compares): only NaNs differ
    magnitude_a, magnitude_b = a & 0x7FFF, b & 0x7FFF
    differ = (a != b) & ~((magnitude_a == 0) & (magnitude_b == 0))
    return differ | (magnitude_a > 0x7C00) | (magnitude_b > 0x7C00)


# what only moves elements (views in the same dtype) or looks at the layout: these see the storage
_LAYOUT = frozenset({np.transpose, np.reshape, np.squeeze, np.expand_dims, np.swapaxes, np.moveaxis,
                     np.ravel, np.shape, np.ndim, np.size, np.shares_memory, np.may_share_memory})


class Fp16AsFp32(np.ndarray):
    """An fp32 value held in fp16 storage: what the torch frontend folds ``weight.float()`` into
    while ``fp16_frontend`` is on, instead of a 4-byte copy of every weight (487 MB at the real
    size, the largest part of a conversion's peak memory).

    To coremltools it is an fp32 array: ``dtype`` says fp32, and every computation (ufuncs, numpy
    functions other than pure layout ones, ``tobytes``, scalars) sees real fp32 values, upcast
    exactly. Transposes, slices and reshapes stay views of the fp16 storage, so the passes fold and
    fuse the weights as they do fp32 ones; ``clef::fp16_storage`` then stores that fp16 as it is.
    ``test_coreml`` checks the package is byte-identical to the one converted from real fp32
    constants."""

    @property
    def dtype(self):  # what coremltools reads to type the constant
        return _F32

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if (method == "__call__" and ufunc in (np.equal, np.not_equal) and not kwargs and len(inputs) == 2
                and all(isinstance(x, Fp16AsFp32) for x in inputs)):
            # coremltools compares values whenever it re-infers an op: on the fp16 bits, exactly
            # as on the fp32 values, without two 4-byte copies (numpy's fp16 compare is slow too)
            differ = _differ_fp16(*(x.view(np.ndarray).view(np.uint16) for x in inputs))
            return differ if ufunc is np.not_equal else ~differ
        if "out" in kwargs:
            kwargs["out"] = _as_f32(kwargs["out"])
        return getattr(ufunc, method)(*_as_f32(inputs), **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func in _LAYOUT:
            return super().__array_function__(func, types, args, kwargs)
        return func(*_as_f32(args), **{k: _as_f32(v) for k, v in kwargs.items()})

    def __getitem__(self, key):
        out = super().__getitem__(key)
        return out if isinstance(out, np.ndarray) else np.float32(out)

    def tobytes(self, order="C"):
        return _as_f32(self).tobytes(order)

    def dot(self, b, out=None):
        return np.dot(self, b, out=out)


def _is_fp16_weight(var) -> bool:
    val = var.val if var.can_be_folded_to_const() else None  # (an Fp16AsFp32 reads fp32: not one)
    return isinstance(val, np.ndarray) and val.dtype == np.float16 and val.size >= FP16_MIN_ELEMENTS


@contextlib.contextmanager
def fp16_frontend():
    """While on, the torch frontend folds ``x.to(float32)`` of an fp16 constant (the graph's
    ``weight.float()``) into an fp32 constant held in fp16 storage (``Fp16AsFp32``, the parameter's
    own memory) instead of materialising fp32; everything else converts as before. coremltools'
    in-function constant deduplication hashes those values as fp32, as it hashes real fp32 ones."""
    import_toolchain()
    import torch
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch import ops as torch_ops
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY
    from coremltools.converters.mil.frontend.torch.utils import NUM_TO_TORCH_DTYPE
    from coremltools.converters.mil.mil.passes.defs.cleanup import const_deduplication

    registry = _TORCH_OPS_REGISTRY.name_to_func_mapping
    original = {name: registry[name] for name in ("to", "_to_copy")}

    def to(context, node):
        # read without building anything: the frontend names constants by a counter, so one
        # more const (parsing a literal builds one) would rename every later one
        raw = (node.kwinputs or {}).get("dtype") if node.kind == "_to_copy" else None
        code = raw[0] if isinstance(raw, (list, tuple)) and len(raw) == 1 and isinstance(raw[0], int) else None
        x = context[node.inputs[0]] if code is not None and node.inputs and node.inputs[0] in context else None
        if x is not None and _is_fp16_weight(x) and NUM_TO_TORCH_DTYPE.get(code) == torch.float32:
            # what the original builds, in its order (its input parsing turns the dtype literal
            # into a const), then the folded value as an unnamed const: fp16 storage, not a copy
            torch_ops._get_inputs(context, node)
            torch_ops._get_kwinputs(context, node, "dtype")
            context.add(mb.const(val=x.val.view(Fp16AsFp32)), node.name)
            return
        original["to"](context, node)

    class _Numpy:  # numpy, with ascontiguousarray giving fp32 bytes for fp16-stored values
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def ascontiguousarray(a, *args, **kwargs):
            return np.ascontiguousarray(_as_f32(a), *args, **kwargs)

    for name in original:
        registry[name] = to
    const_deduplication.np = _Numpy()
    try:
        yield
    finally:
        registry.update(original)
        const_deduplication.np = np


def _check_no_fp16_frontend_values(prog) -> None:
    """Every fp16-stored value was stored by ``clef::fp16_storage``; one left would be written as
    whatever coremltools makes of it, so it is an error, not a guess."""
    for name, fn in prog.functions.items():
        for op in fn.operations:
            if op.op_type == "const" and isinstance(op.outputs[0].val, Fp16AsFp32):
                raise ToolchainError(f"coremltools conversion left constant {op.name} of function {name} "
                                     "in fp16 frontend storage (clef::fp16_storage did not store it)")


def _pipeline(ct, weights: str):
    pipeline = ct.PassPipeline.DEFAULT
    if weights == "fp16w32":
        pipeline.append_pass(register_fp16_pass())
    return pipeline


def convert_bucket(graph, bucket: int, hidden_size: int, q_pad: int, o_pad: int, weights: str):
    """One static-T trace of ``graph`` converted into an in-memory ML program (pymil), through
    the same pipelines ``ct.convert(convert_to="mlprogram")`` runs, short of writing a package."""
    from coremltools.converters.mil.converter import _construct_other_pipelines, _reset_conversion_state
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    from .tracing import export_graph

    ct = import_toolchain()
    # op names come from counters that only a finished conversion clears; a program built before
    # in this process (a test, a tool) would otherwise shift every name of this one
    _reset_conversion_state()
    # coremltools takes the ATen dialect; the graph is in core ATen already: nothing to decompose
    ep = export_graph(graph, (bucket,), hidden_size, q_pad, o_pad, decompositions={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = _pipeline(ct, weights)
        prog = ct.convert(
            ep,
            convert_to="milinternal",  # the program after the main pipeline, kept in memory
            minimum_deployment_target=getattr(ct.target, DEPLOYMENT_TARGET),
            compute_precision=ct.precision.FLOAT32,
            outputs=[ct.TensorType(name=name) for name in contract.OUTPUT_NAMES],
            pass_pipeline=pipeline,
        )
        _frontend, backend = _construct_other_pipelines(pipeline, "pytorch", "mlprogram")
        PassPipelineManager.apply_pipeline(prog, backend)
        prog._check_early_error_out_for_invalid_program()
    _check_no_fp16_frontend_values(prog)
    return prog


@dataclass
class Joined:
    """The functions converted so far, one multi-function program in memory (``save`` writes it)."""

    program: Any
    default: str


def convert(graph, recipe, hidden_size: int, asset_dir: Path, log: Callable[[str], None] = lambda msg: None) -> Joined:
    """Each bucket traced (static T) and converted on its own, then added to one multi-function
    program; equal fp16 weights are one array in memory (``interning``)."""
    import gc

    import_toolchain()
    from coremltools.converters.mil.mil import Program

    joined = Joined(program=Program(), default=contract.function_name(recipe.buckets[0]))
    with interning(_parameter_views(graph)), validate_once(), fp16_frontend():
        for bucket in recipe.buckets:
            name = contract.function_name(bucket)
            log(f"tracing and converting {name} (coremltools)")
            prog = convert_bucket(graph, bucket, hidden_size, recipe.q_pad, recipe.o_pad, recipe.weights)
            joined.program.add_function(name, prog.functions["main"])
            del prog
            gc.collect()
    return joined


def share_weights(prog) -> int:
    """Equal constants of different functions get one ``weight_id``, so the package stores them
    once. The numbering and the choice of constants are those of coremltools'
    ``const_deduplication._deduplicate_const_across_functions`` (which ``save_multifunction``
    runs), with equality tested on the bytes (sha256) instead of ``np.allclose`` over every pair
    of candidates (a fifth of the join). Returns the number of shared constants."""
    from coremltools.converters.mil.mil import ListVar

    digests: dict[int, bytes] = {}  # interned arrays are hashed once
    groups: dict[tuple, list] = {}
    for block in prog.functions.values():
        for op in list(block.operations):
            if op.op_type != "const" or isinstance(op.outputs[0], ListVar):
                continue
            if op.weight_id is not None:
                raise ValueError(f"const op {op.name} already has weight_id {op.weight_id}")
            var = op.outputs[0]
            val = var.val
            # coremltools lowers its threshold to 1 element here: every non-empty tensor or scalar
            if val is None or isinstance(val, (str, bool)) or np.prod(np.shape(val)) < 1:
                continue
            if id(val) not in digests:
                digests[id(val)] = hashlib.sha256(np.ascontiguousarray(val).tobytes()).digest()
            groups.setdefault((var.dtype, var.shape, digests[id(val)]), []).append(var)
    shared = 0
    for i, group in enumerate(groups.values()):
        if len(group) > 1:
            shared += 1
            for var in group:
                var.op.weight_id = str(i)
    return shared


def save(joined: Joined, asset_dir: Path, description: dict[str, str], log: Callable[[str], None] = lambda msg: None) -> None:
    """The multi-function program written as one package (weights shared, stored once), finalised."""
    ct = import_toolchain()
    from coremltools.converters.mil.converter import mil_convert

    prog = joined.program
    log(f"joining {len(prog.functions)} functions into {asset_dir.name}")
    shared = share_weights(prog)
    prog.default_function_name = joined.default
    prog.skip_all_passes = True  # every function went through the pipelines when converted
    prog.export_as_multifunction = True
    with warnings.catch_warnings(), validate_once():
        warnings.simplefilter("ignore")
        model = mil_convert(prog, convert_to="mlprogram", convert_from="milinternal",
                            specification_version=SPECIFICATION_VERSION, compute_units=ct.ComputeUnit.CPU_ONLY,
                            skip_model_load=True)
        # without the program, save() writes no ExecuTorch debug-handle map into the package (nor
        # the empty coremltools-version key that writing it adds to the spec): save_multifunction's bytes
        model._mil_program = None
        del prog, joined.program
        model.save(str(asset_dir))
    log(f"{shared} constants shared by the functions")
    finalize_package(asset_dir, description)


def finalize_package(package: Path, description: dict[str, str]) -> None:
    """Our metadata in the spec, and the same bytes from the same content: the spec serialised
    with sorted maps, the package manifest's random item identifiers replaced by name-based ones."""
    from ..bundle import atomic_write_bytes

    spec = load_spec(package)
    meta = spec.description.metadata
    meta.author = description.get("author", "")
    meta.license = description.get("license", "")
    meta.shortDescription = description.get("description", "")
    meta.versionString = description.get("version", "")
    for key, value in sorted(description.items()):
        if key not in ("author", "license", "description", "version"):
            meta.userDefined[key] = value
    atomic_write_bytes(package / MODEL_FILE, spec.SerializeToString(deterministic=True))

    manifest_path = package / "Manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    renamed = {old: str(uuid.uuid5(uuid.NAMESPACE_URL, f"clef-export:{item['path']}"))
               for old, item in manifest["itemInfoEntries"].items()}
    manifest["itemInfoEntries"] = {renamed[k]: v for k, v in manifest["itemInfoEntries"].items()}
    manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    # the layout libmodelpackage itself writes, so that a tool opening the package rewrites the same bytes
    atomic_write_bytes(manifest_path, (json.dumps(manifest, indent=4, sort_keys=True) + "\n").encode())


def load_spec(package: Path):
    """The package's spec, parsed straight from its file: opening a package through coremltools'
    ``ModelPackage`` rewrites ``Manifest.json``, and a check must not touch what it checks."""
    import_toolchain()
    from coremltools.proto import Model_pb2

    path = Path(package) / MODEL_FILE
    spec = Model_pb2.Model()
    try:
        spec.ParseFromString(path.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except Exception as exc:  # protobuf's DecodeError: a truncated or foreign file
        raise IntegrityError(f"{path}: not a Core ML model ({type(exc).__name__})") from None
    return spec


# ---------------------------------------------------------------- read back


@dataclass
class Blob:
    offset: int
    dtype: str  # "FLOAT16" / "FLOAT32"
    shape: tuple[int, ...]
    functions: set[str] = field(default_factory=set)


@dataclass
class FunctionSpec:
    name: str
    inputs: list[tuple[str, tuple[int, ...], str]]
    outputs: list[tuple[str, tuple[int, ...], str]]
    opset: str
    ops: Counter
    fp16_outputs: list[str]  # ops other than constexpr_cast that produce fp16 (math must be fp32)


@dataclass
class PackageInfo:
    path: Path
    specification_version: int
    default_function: str
    functions: list[FunctionSpec]
    weight_bytes: int
    blobs: dict[int, Blob]


def _shape(tensor_type) -> tuple[int, ...]:
    return tuple(int(d.constant.size) for d in tensor_type.dimensions)


def read_package(package: Path) -> PackageInfo:
    """The saved spec, read back: what a Core ML host will see (no Core ML runtime needed)."""
    package = Path(package)
    spec = load_spec(package)
    from coremltools.proto import FeatureTypes_pb2, MIL_pb2

    array_name = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name

    def features(items) -> list[tuple[str, tuple[int, ...], str]]:
        return [(f.name, tuple(int(s) for s in f.type.multiArrayType.shape),
                 _ARRAY_DTYPES.get(array_name(f.type.multiArrayType.dataType), "?")) for f in items]

    blobs: dict[int, Blob] = {}
    functions = []
    # a one-function model describes its function at the top level, under the name "main"
    described = list(spec.description.functions) or [spec.description]
    for fd in described:
        fd_name = fd.name if spec.description.functions else "main"
        fn = spec.mlProgram.functions[fd_name]
        block = fn.block_specializations[fn.opset]
        ops: Counter = Counter()
        fp16_out = []
        for op in block.operations:
            ops[op.type] += 1
            values = [op.attributes["val"]] if op.type == "const" else [
                arg.value for binding in op.inputs.values() for arg in binding.arguments if arg.HasField("value")]
            for value in values:
                if value.WhichOneof("value") == "blobFileValue":
                    t = value.type.tensorType
                    blob = blobs.setdefault(value.blobFileValue.offset, Blob(
                        offset=value.blobFileValue.offset, dtype=MIL_pb2.DataType.Name(t.dataType), shape=_shape(t)))
                    blob.functions.add(fd_name)
            if op.type != "constexpr_cast":
                fp16_out += [o.name for o in op.outputs
                             if o.type.WhichOneof("type") == "tensorType"
                             and MIL_pb2.DataType.Name(o.type.tensorType.dataType) == "FLOAT16"]
        functions.append(FunctionSpec(name=fd_name, inputs=features(fd.input), outputs=features(fd.output),
                                      opset=fn.opset, ops=ops, fp16_outputs=fp16_out))
    weight = package / WEIGHT_FILE
    return PackageInfo(
        path=package, specification_version=spec.specificationVersion,
        default_function=spec.description.defaultFunctionName, functions=functions,
        weight_bytes=weight.stat().st_size if weight.is_file() else 0, blobs=blobs,
    )


def blob_reader(package: Path) -> Callable[[Blob], np.ndarray]:
    """Reads blobs out of the package's weight.bin, one reader for all of them."""
    from coremltools.libmilstoragepython import _BlobStorageReader

    path = Path(package) / WEIGHT_FILE
    reader = _BlobStorageReader(str(path))

    def read(blob: Blob) -> np.ndarray:
        if blob.dtype == "FLOAT16":
            return np.asarray(reader.read_fp16_data(blob.offset)).view(np.float16)
        if blob.dtype == "FLOAT32":
            return np.asarray(reader.read_float_data(blob.offset), dtype=np.float32)
        raise IntegrityError(f"{path}: blob at {blob.offset} has dtype {blob.dtype}")

    return read


def check_package(info: PackageInfo, buckets: list[tuple[str, int]], hidden_size: int, weights: str,
                  params: dict[str, np.ndarray], q_pad: int = contract.Q_PAD,
                  o_pad: int = contract.O_PAD) -> list[tuple[str, bool, str]]:
    """The checks that need no Core ML runtime; each row is (check, ok, detail)."""
    rows: list[tuple[str, bool, str]] = []
    names = [name for name, _ in buckets]
    got = [f.name for f in info.functions]
    rows.append(("functions = manifest", sorted(got) == sorted(names), ", ".join(got)))
    rows.append(("default function", info.default_function == names[0], info.default_function or "none"))
    rows.append((f"spec >= 9, opset {OPSET}", info.specification_version >= 9 and all(f.opset == OPSET for f in info.functions),
                 f"spec {info.specification_version}, " + ", ".join(sorted({f.opset for f in info.functions}))))
    by_name = {f.name: f for f in info.functions}
    for name, bucket in buckets:
        fn = by_name.get(name)
        if fn is None:
            continue
        shapes = contract.input_shapes(bucket, hidden_size, q_pad, o_pad)
        want_in = [(n, tuple(shapes[n]), contract.INPUT_SPECS[n][1]) for n in contract.INPUT_ORDER]
        bad = [f"{n} {s} {d}" for (n, s, d) in fn.inputs if (n, s, d) not in want_in]
        ok_in = [n for n, _, _ in fn.inputs] == list(contract.INPUT_ORDER) and not bad
        rows.append((f"{name} inputs", ok_in, "10 named, shapes and dtypes as the contract" if ok_in
                     else f"got {[n for n, _, _ in fn.inputs]}" + (f"; wrong: {bad[0]}" if bad else "")))
        want_out = [(contract.OUTPUT_NAMES[0], (o_pad,), "f32")]
        rows.append((f"{name} outputs", fn.outputs == want_out, f"{fn.outputs}"))
        rows.append((f"{name} math fp32", not fn.fp16_outputs,
                     "no fp16 op outputs" if not fn.fp16_outputs else f"fp16 outputs: {fn.fp16_outputs[:3]}"))
    rows.extend(check_weights(info, weights, params))
    return rows


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _pieces(name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """How the graph uses a parameter: attention's packed in-projection as its q, k, v thirds."""
    if name.endswith(("in_proj_weight", "in_proj_bias")) and value.shape[0] % 3 == 0:
        third = value.shape[0] // 3
        return [(f"{name}[{part}]", value[i * third:(i + 1) * third]) for i, part in enumerate("qkv")]
    return [(name, value)]


def check_weights(info: PackageInfo, weights: str, params: dict[str, np.ndarray]) -> list[tuple[str, bool, str]]:
    """Every stored weight is one of the author's (bit for bit, as stored or transposed), every
    author weight is stored, each once, in the recipe's storage dtype."""
    storage = np.float16 if weights == "fp16w32" else np.float32
    wanted: dict[str, str] = {}
    for name, value in params.items():
        if value.size < FP16_MIN_ELEMENTS:
            continue
        for label, piece in _pieces(name, value.astype(storage)):
            wanted.setdefault(_digest(piece), label)
            if piece.ndim == 2:
                wanted.setdefault(_digest(piece.T), label)
    found: dict[str, int] = {}
    stray: list[str] = []
    wrong_dtype = 0
    big_dtype = "FLOAT16" if weights == "fp16w32" else "FLOAT32"
    read = blob_reader(info.path)
    for blob in sorted(info.blobs.values(), key=lambda b: b.offset):
        data = read(blob)
        name = wanted.get(_digest(data))
        if name is None:
            # the graph's own constants: small ones (masks, scales), and all-zero biases that
            # coremltools adds when it turns a bias-free matmul into `linear`
            if int(np.prod(blob.shape)) >= 1024 and np.any(data):
                stray.append(f"{blob.dtype} {list(blob.shape)} at {blob.offset}")
            continue
        if blob.dtype != big_dtype:
            wrong_dtype += 1
        found[name] = found.get(name, 0) + 1
    missing = sorted(set(wanted.values()) - set(found))
    twice = sorted(n for n, c in found.items() if c > 1)
    stored = sum(int(np.prod(p.shape)) for n, v in params.items() for label, p in _pieces(n, v) if label in found)
    stored *= np.dtype(storage).itemsize
    return [
        ("every author weight stored", not missing, f"{plural(len(found), 'tensor')}" if not missing else f"missing: {missing[:3]}"),
        ("each weight stored once", not twice, "shared by all functions" if not twice else f"twice: {twice[:3]}"),
        (f"weights stored {'fp16' if weights == 'fp16w32' else 'fp32'}", wrong_dtype == 0,
         f"{stored:,} bytes of weights in a {info.weight_bytes:,}-byte weight.bin" if wrong_dtype == 0
         else f"{wrong_dtype} weights in another dtype"),
        ("no unknown large constants", not stray, "none" if not stray else f"{len(stray)}: {stray[0]}"),
    ]


# ---------------------------------------------------------------- read back, run, describe


def read_back(asset: Path, m: Manifest, hidden_size: int, params: dict[str, np.ndarray]) -> list[tuple[str, bool, str]]:
    """What a Core ML host will see, from the saved spec: functions, inputs, outputs, fp32 math,
    and every stored weight against the author's."""
    q_pad, o_pad = pads(m.head)
    return check_package(read_package(asset), m.head.buckets, hidden_size, m.head.weights, params, q_pad, o_pad)


def cannot_run() -> str | None:
    """Why outputs cannot be compared here (Core ML predictions need macOS), or None."""
    return None if sys.platform == "darwin" else PREDICTIONS_NOTE


def predictor(package: Path, function: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """A function of the package, run by Core ML (macOS only)."""
    ct = import_toolchain()
    model = ct.models.MLModel(str(package), function_name=function, compute_units=ct.ComputeUnit.CPU_ONLY)

    def run(arrays: dict[str, np.ndarray]) -> np.ndarray:
        out = model.predict({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        return np.asarray(out[contract.OUTPUT_NAMES[0]], dtype=np.float32).reshape(-1)

    return run


@contextlib.asynccontextmanager
async def runner(asset: Path, names: list[str]):
    """``call(function, arrays) -> logits`` through Core ML (macOS; one call at a time)."""
    fns = {name: predictor(asset, name) for name in names}

    async def call(name: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.array(fns[name](arrays), dtype=np.float32, copy=True)

    yield call


def describe(asset: Path) -> list[dict[str, Any]]:
    """Functions, inputs and outputs from the saved spec (no Core ML runtime on Linux)."""
    return [{"name": f.name,
             "inputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in f.inputs],
             "outputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in f.outputs]}
            for f in read_package(asset).functions]
