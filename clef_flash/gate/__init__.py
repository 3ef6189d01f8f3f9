"""The gate stage: a finished bundle against the release it was built from.

The model is picked once, from the bundle's manifest ``kind``, in ``MODELS``: each entry is a
module with the same names (``KIND``, ``MODEL``, ``OPTIONS``, ``source_of``, ``run``, ``inspect``).
Every gate returns a ``report.Report``. The pins are found here for every model alike: ``--pins``,
else the source folder's ``pins.json``, else the published pins when the bundle names that commit;
a bundle built from anything else says which release to pass, before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..data import default_pins
from ..errors import IntegrityError, UsageError
from ..layout import MANIFEST_FILE
from . import backbone, head, vision

MODELS: dict[str, ModuleType] = {m.KIND: m for m in (head, backbone, vision)}


@dataclass(frozen=True)
class GateOptions:
    """``verify``'s options as given: None where the user did not name one."""

    bundle: Path
    source: Path | None = None
    pins: Path | None = None
    seed: int = 0
    records: int | None = None
    recorded: Path | None = None
    red: bool = False
    device: str | None = None  # a backbone's torch engine: auto | cpu | cuda | mps
    spot_check: bool | None = None  # a backbone past the runtime's size: one chunk through the runtime (None: by compute)


def model_named(name: str) -> ModuleType:
    """The gate of the model called ``name`` (``head``, ``backbone``): ``schema --kind``."""
    for gate in MODELS.values():
        if gate.MODEL == name:
            return gate
    raise UsageError(f"--kind must be one of {', '.join(g.MODEL for g in MODELS.values())}, got {name!r}")


def kind_of(bundle: Path) -> ModuleType:
    """The gate of the bundle's model, from its manifest's ``kind``."""
    meta = Path(bundle) / MANIFEST_FILE
    if not Path(bundle).is_dir():
        raise IntegrityError(f"{bundle}: bundle folder not found")
    try:
        kind = json.loads(meta.read_text(encoding="utf-8")).get("kind")
    except FileNotFoundError:
        raise IntegrityError(f"{meta}: missing") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise IntegrityError(f"{meta}: not a readable manifest ({exc})") from None
    if kind not in MODELS:
        raise IntegrityError(f"{meta}: kind {kind!r} is not one this tool knows ({', '.join(MODELS)})")
    return MODELS[kind]


def pins_for(bundle: Path, manifest: Any, gate: ModuleType, source: Path | None, pins: Path | None) -> Path:
    """The pins to check ``bundle`` against: named, beside the source, or the published ones when
    the bundle was built from the published commit. Anything else: say what to pass."""
    if pins is not None:
        return Path(pins)
    if source is not None:
        if (Path(source) / "pins.json").is_file():
            return Path(source) / "pins.json"
        raise UsageError(f"{source}: no pins.json here; pin it (clef-export pin {source}) or pass --pins")
    hf_id, revision = gate.source_of(manifest)
    from ..sources.pins import load_pins

    published = load_pins(default_pins())
    if hf_id == published.hf_id and revision == published.revision:
        return default_pins()
    if revision is None or hf_id.startswith("synthetic/"):
        what = "a synthetic snapshot" if hf_id.startswith("synthetic/") else "the local release"
        raise UsageError(f"{bundle}: built from {what} {hf_id}; pass its folder with --source")
    raise UsageError(f"{bundle}: built from {hf_id}@{revision[:12]}; pass --pins for that commit "
                     f"(clef-export pin {hf_id} --revision {revision}) or --source with its folder")


def verify(opts: GateOptions, log=lambda msg: None):
    """The bundle's own gate (exit 2 for an option its model does not take, before any work)."""
    gate = kind_of(opts.bundle)
    for option, value in (("--records", opts.records), ("--recorded", opts.recorded), ("--device", opts.device),
                          ("--spot-check", opts.spot_check)):
        if value is not None and option not in gate.OPTIONS:
            raise UsageError(f"{option} is not an option for a {gate.MODEL} bundle ({opts.bundle}): its gate "
                             f"{gate.FIXED_RECORDS}")
    if opts.recorded is not None and not Path(opts.recorded).is_file():
        raise UsageError(f"{opts.recorded}: recorded records not found")
    from .artifact import check_recorded_small_files

    check_recorded_small_files(opts.bundle)  # an edited manifest is refused before any numeric work
    manifest = gate.manifest_of(opts.bundle)
    return gate.run(opts, manifest, pins_for(opts.bundle, manifest, gate, opts.source, opts.pins), log)


def inspect(bundle: Path) -> dict[str, Any]:
    """What the bundle holds, from its asset and its manifest, for any model."""
    return kind_of(bundle).inspect(bundle)


def check_artifact(bundle: Path) -> dict[str, Any]:
    """``verify-artifact``: the model's own file checks, then every file against the build record."""
    from .artifact import check_record

    gate = kind_of(bundle)
    name, fmt, asset_sha = gate.asset_facts(bundle)
    files = check_record(bundle)
    return {"bundle": str(bundle), "files": files, "name": name, "format": fmt, "asset_sha256": asset_sha}
