"""A finished bundle, read back: its asset against its manifest (``check_bundle``), every file
against its build record (``check_artifact``, ``verify-artifact``), and what it holds
(``inspect_bundle``: functions, inputs, outputs, from the asset itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .backends import Backend, load_manifest, of_manifest
from .digest import tree_files
from .errors import IntegrityError
from .layout import MANIFEST_FILE, RECORD_FILE


def check_bundle(bundle: Path) -> tuple[BaseModel, Backend, Path, list[tuple[str, bool, str]]]:
    """The bundle's asset against its manifest: (manifest, backend, asset path, checks). Raises
    ``IntegrityError`` naming the first broken file."""
    bundle = Path(bundle)
    meta = bundle / MANIFEST_FILE
    try:
        manifest = load_manifest(meta.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{meta}: missing") from None
    except ValueError as exc:
        raise IntegrityError(f"{meta}: not a valid manifest ({str(exc).splitlines()[0]})") from None
    fmt = of_manifest(manifest)
    asset = bundle / manifest.assets["main"]
    return manifest, fmt, asset, fmt.check_files(manifest, asset)


def check_artifact(bundle: Path) -> dict[str, Any]:
    """Every file of the bundle against the build record's digests, plus the manifest's checks."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise IntegrityError(f"{bundle}: bundle folder not found")
    if _kind(bundle) == "decision-backbone":  # the second model: its own manifest and file checks
        from .backbone.gate import check_files

        manifest, _asset, _checks = check_files(bundle)
        name, fmt_name, asset_sha = manifest.name, Path(manifest.assets["main"]).suffix[1:], manifest.export.main_mlirb.sha256
    else:
        manifest, fmt, _asset, _checks = check_bundle(bundle)
        name, fmt_name, asset_sha = manifest.name, fmt.FORMAT, fmt.asset_digest(manifest)
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
    return {"bundle": str(bundle), "files": len(actual), "name": name, "format": fmt_name, "asset_sha256": asset_sha}


def _kind(bundle: Path) -> str | None:
    try:
        kind = json.loads((Path(bundle) / MANIFEST_FILE).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None  # check_bundle names what is wrong with it
    return kind if isinstance(kind, str) else None


def inspect_bundle(bundle: Path) -> dict[str, Any]:
    """From the asset itself (the Core AI runtime's view of an ``.aimodel``, the saved spec of a
    ``.mlpackage``) and the manifest."""
    manifest, fmt, asset, _ = check_bundle(bundle)
    order = {name: i for i, (name, _) in enumerate(manifest.head.buckets)}
    return {
        "name": manifest.name,
        "kind": manifest.kind,
        "format": fmt.FORMAT,
        "weights": manifest.head.weights,
        **fmt.sizes(manifest),
        "source": manifest.head.source.model_dump(),
        "functions": sorted(fmt.describe(asset), key=lambda f: order.get(f["name"], len(order))),
    }
