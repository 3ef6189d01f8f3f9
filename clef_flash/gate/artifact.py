"""A finished head bundle, read back: its asset against its manifest (``check_bundle``), every
file of any bundle against its build record (``check_record``; ``gate.check_artifact`` adds the
model's own file checks), and what a head bundle holds (``inspect_bundle``: functions, inputs,
outputs, from the asset itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..head.backends import Backend, load_manifest, of_manifest
from ..digest import tree_files
from ..errors import IntegrityError
from ..layout import MANIFEST_FILE, RECORD_FILE


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


def check_recorded_small_files(bundle: Path, limit: int = 64 * 1024 * 1024) -> None:
    """The bundle's own files under ``limit`` bytes (its manifest, tokenizer, plan: what a hand
    edits) against the build record, before a gate's numeric work; the asset folder is the gate's
    own check (against the manifest). ``IntegrityError`` naming the first that differs."""
    from ..digest import sha256_file

    bundle = Path(bundle)
    record_path = bundle / RECORD_FILE
    if not record_path.is_file():
        return  # a bundle being built: its record comes after the gate
    try:
        expected: dict[str, str] = json.loads(record_path.read_text())["outputs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{record_path}: unreadable build record ({exc})") from None
    for name, want in sorted(expected.items()):
        path = bundle / name
        if "/" in name and name.split("/")[0].startswith(bundle.name + "."):  # the asset folder, of any format
            continue
        if path.is_file() and path.stat().st_size < limit and sha256_file(path) != want:
            raise IntegrityError(f"{path}: sha256 differs from {RECORD_FILE} (edited after the build)")


def check_record(bundle: Path) -> int:
    """Every file of the bundle against the build record's digests (any model); the file count."""
    bundle = Path(bundle)
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
    return len(actual)


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
