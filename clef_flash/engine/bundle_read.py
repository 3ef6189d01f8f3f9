"""A built bundle read back: its manifest and asset files checked, and the release it was built from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..digest import sha256_file
from ..errors import IntegrityError
from ..progress import plural


def read_asset_bundle(bundle: Path, model, what: str, hashed: bool = True):
    """A Core AI bundle's manifest (as ``model``), its asset folder, and ``main.mlirb`` / ``main.hash``
    against it (``aimodel.check_files``; ``hashed=False``: main.mlirb's sha256 left to the caller);
    ``IntegrityError`` naming the first broken file."""
    from ..formats.aimodel import check_files as check_asset
    from ..layout import MANIFEST_FILE

    path = Path(bundle) / MANIFEST_FILE
    try:
        m = model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except ValueError as exc:
        raise IntegrityError(f"{path}: not a {what} manifest ({str(exc).splitlines()[0]})") from None
    asset = Path(bundle) / m.assets["main"]
    return m, asset, check_asset(m, asset, hashed=hashed)


def check_built_from(bundle: Path, release: Path, files: dict[str, str], what: str,
                     digests: dict[str, str] | None = None) -> tuple[str, bool, str]:
    """The release's files against a bundle manifest's source digests (the bundle was built from this
    release); ``IntegrityError`` naming the first that is not. ``digests``: file -> sha256 already
    taken in this command (the backbone and the vision bundle name the same shards: hashed once)."""
    digests = {} if digests is None else digests
    for name, want in sorted(files.items()):
        path = release / name
        if not path.is_file():
            raise IntegrityError(f"{path}: missing; the {what} {bundle} was built from a release that has it")
        if name not in digests:
            digests[name] = sha256_file(path)
        if digests[name] != want:
            raise IntegrityError(f"{path}: sha256 differs from {bundle}'s manifest: the {what} was built from "
                                 f"another release")
    return (f"release {what} files = bundle's source", True, f"{plural(len(files), 'file')}")


@dataclass(frozen=True)
class OpenedBundle:
    """A bundle opened to run: its folder, its asset, its manifest, and the checks it passed."""

    bundle: Path
    asset: Path
    manifest: Any
    checks: list[tuple[str, bool, str]]
