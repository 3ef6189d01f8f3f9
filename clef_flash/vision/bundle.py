"""A vision bundle read back: its files against its manifest (``main.mlirb``, ``main.hash``). The
gate and check-release's vision side both start here."""

from __future__ import annotations

from pathlib import Path


def check_files(bundle: Path):
    """The manifest and its asset; ``IntegrityError`` naming the first broken file."""
    from ..engine.bundle_read import read_asset_bundle
    from .manifest import VisionManifest

    return read_asset_bundle(bundle, VisionManifest, "vision")
