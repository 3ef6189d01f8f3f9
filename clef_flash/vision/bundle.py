"""A vision bundle read back: its files against its manifest (``main.mlirb``, ``main.hash``). The
gate and check-release's vision side both start here."""

from __future__ import annotations

from pathlib import Path

from ..errors import IntegrityError


def check_files(bundle: Path):
    """The manifest and its asset; ``IntegrityError`` naming the first broken file."""
    from ..layout import MANIFEST_FILE
    from ..manifest import check_file
    from ..vision.manifest import VisionManifest

    path = Path(bundle) / MANIFEST_FILE
    try:
        m = VisionManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except ValueError as exc:
        raise IntegrityError(f"{path}: not a vision manifest ({str(exc).splitlines()[0]})") from None
    asset = Path(bundle) / m.assets["main"]
    digest = check_file(asset / "main.mlirb", m.export.main_mlirb)
    if not (asset / "main.hash").is_file() or (asset / "main.hash").read_bytes().hex() != digest:
        raise IntegrityError(f"{asset / 'main.hash'}: does not hold the sha256 of main.mlirb")
    return m, asset, [("main.mlirb sha256 = manifest", True, digest[:16]), ("main.hash = sha256(main.mlirb)", True, "ok")]
