"""A finished bundle, read back: re-hash it against its record and manifest; describe it from the
asset itself (functions, input / output shapes and dtypes, as the Core AI runtime reports them)."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path
from typing import Any

from .bundle import tree_files
from .errors import IntegrityError

RECORD_FILE = "build-record.json"


def check_artifact(bundle: Path) -> dict[str, Any]:
    """Every file of the bundle against the build record's digests, plus manifest and main.hash."""
    from .gate import asset_digest, check_bundle
    from .manifest import manifest_format

    bundle = Path(bundle)
    if not bundle.is_dir():
        raise IntegrityError(f"{bundle}: bundle folder not found")
    manifest, _asset, _checks = check_bundle(bundle)
    record_path = bundle / RECORD_FILE
    try:
        record = json.loads(record_path.read_text())
        expected: dict[str, str] = record["outputs"]
    except FileNotFoundError:
        raise IntegrityError(f"{record_path}: missing") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{record_path}: unreadable build record ({exc})") from None
    actual = tree_files(bundle)
    actual.pop(RECORD_FILE, None)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise IntegrityError(f"{bundle / name}: missing (listed in {RECORD_FILE})")
        if name not in expected:
            raise IntegrityError(f"{bundle / name}: not part of the build (absent from {RECORD_FILE})")
        if actual[name] != expected[name]:
            raise IntegrityError(f"{bundle / name}: sha256 differs from {RECORD_FILE}")
    return {"bundle": str(bundle), "files": len(actual), "name": manifest.name,
            "format": manifest_format(manifest), "asset_sha256": asset_digest(manifest)}


async def _describe(asset: Path) -> list[dict[str, Any]]:
    from coreai.authoring.asset import AIModelAsset

    out = []
    async with AIModelAsset.load(asset).executable() as model:
        for name in model.function_names:
            fn = model.load_function(name)
            d = fn.desc
            out.append({
                "name": name,
                "inputs": [{"name": n, "shape": list(d.input_descriptor(n).shape), "dtype": str(d.input_descriptor(n).dtype)}
                           for n in d.input_names],
                "outputs": [{"name": n, "shape": list(d.output_descriptor(n).shape), "dtype": str(d.output_descriptor(n).dtype)}
                            for n in d.output_names],
            })
    return out


def describe_asset(asset: Path) -> list[dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return asyncio.run(_describe(Path(asset)))


def inspect_bundle(bundle: Path) -> dict[str, Any]:
    """From the asset itself: the Core AI runtime's view of an ``.aimodel``, the saved spec of a
    ``.mlpackage`` (no Core ML runtime on Linux)."""
    from .gate import check_bundle
    from .manifest import MlpackageManifest, manifest_format

    manifest, asset, _ = check_bundle(bundle)
    order = {name: i for i, (name, _) in enumerate(manifest.head.buckets)}
    if isinstance(manifest, MlpackageManifest):
        from . import coreml

        functions = coreml.describe(coreml.read_package(asset))
        sizes = {"asset_bytes": manifest.export.mlpackage_bytes, "weight_bin_bytes": manifest.export.weight_bin.bytes}
    else:
        functions = describe_asset(asset)
        sizes = {"asset_bytes": manifest.export.aimodel_bytes, "main_mlirb_bytes": manifest.export.main_mlirb.bytes}
    return {
        "name": manifest.name,
        "kind": manifest.kind,
        "format": manifest_format(manifest),
        "weights": manifest.head.weights,
        **sizes,
        "source": manifest.head.source.model_dump(),
        "functions": sorted(functions, key=lambda f: order.get(f["name"], len(order))),
    }
