"""Provenance: tool versions, the build date (``SOURCE_DATE_EPOCH``), what an asset says about
its origin, and the build record (``build-record.json``) that names everything a rebuild needs
to give the same bytes."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .errors import UsageError
from .sources.pins import Pins

# What decides the bytes of an asset, besides the sources: these packages' versions, and the
# platform (the Core AI compiler is one native build per platform).
TOOLS = ("torch", "coreai-core", "coreai-torch", "coremltools", "numpy", "safetensors", "huggingface_hub")


def tool_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Python, clef-export and each toolchain distribution's version (``extra``: more of them)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "clef-export": __version__}
    for dist in (*TOOLS, *extra):
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


def asset_description(pins: Pins) -> dict[str, str]:
    """What the asset itself says about its origin (a synthetic source is labelled as such)."""
    label = ("SYNTHETIC weights (not the real checkpoint)" if pins.synthetic
             else "a local release" if pins.origin == "local" else "Cloudflare clef-flash")
    return {"author": "clef-export", "license": "Apache-2.0", "version": __version__,
            "description": f"clef-flash joint schema head, {label}, {pins.label}",
            "synthetic": "true" if pins.synthetic else "false"}


def build_record(recipe: Any, recipe_path: Path, pins: Pins, outputs: dict[str, str], hidden_size: int,
                 backend_parameters: dict[str, Any]) -> dict[str, Any]:
    """``build-record.json``: recipe, source pins, every output's sha256, and the environment
    (tool versions, platform) that a rebuild must match to give the same bytes."""
    return {
        "record_version": "1",
        "tool": {"name": "clef-export", "version": __version__, "command": "build"},
        "parameters": {
            "recipe": recipe.model_dump(mode="json"),
            "recipe_file": Path(recipe_path).name,
            "hidden_size": hidden_size,
            **backend_parameters,
        },
        "source": {
            "hf_id": pins.hf_id,
            "revision": pins.revision,
            "origin": pins.origin,
            "release": pins.release,
            "synthetic": pins.synthetic,
            "files": {name: {"sha256": digest} for name, digest in sorted(pins.files.items())},
        },
        "outputs": outputs,
        "environment": {**tool_versions(), "platform": sys.platform, "machine": platform.machine()},
        "source_date_epoch": source_date_epoch(),
        "synthetic": pins.synthetic,
        "verify": None,
    }
