"""Where the project's data lives: the recipes (``conversion/``), the default pins and the JSON
Schemas (``manifests/``). In a checkout they are the top-level folders, the source of truth; an
installed wheel carries copies of them as package data under ``clef_flash/_data/``."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """``conversion`` or ``manifests``: the wheel's copy when installed from one, else the checkout's."""
    packaged = _HERE / "_data" / name
    return packaged if packaged.is_dir() else _HERE.parent / name


def default_pins() -> Path:
    """The pins of Cloudflare/clef-flash at the published commit."""
    return data_dir("manifests") / "clef-flash.source.json"
