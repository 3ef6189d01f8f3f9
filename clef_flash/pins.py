"""The pinned source: hf_id, a 40-hex commit, file -> sha256.

Pins are checked before any network access: a malformed pins file is a usage error (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import UsageError, first_validation_error

CODE_FILE = "joint_schema_model.py"
WEIGHTS_FILE = "joint_head.safetensors"
CONFIG_FILE = "joint_head_config.json"
HEAD_FILES = (CODE_FILE, WEIGHTS_FILE, CONFIG_FILE)

HEX40 = r"^[0-9a-f]{40}$"
HEX64 = r"^[0-9a-f]{64}$"


class Pins(BaseModel):
    """``manifests/clef-flash.source.json``: what may be read, and what its bytes must hash to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hf_id: str = Field(min_length=3, description="Hub repo id, e.g. Cloudflare/clef-flash")
    revision: str = Field(pattern=HEX40, description="the pinned commit, 40 lowercase hex")
    files: dict[str, str] = Field(description="repo-relative file name -> sha256 (64 lowercase hex)")
    synthetic: bool = Field(default=False, description="true for a snapshot made by `clef-export synth`")
    note: str | None = None

    @field_validator("files")
    @classmethod
    def _check_files(cls, files: dict[str, str]) -> dict[str, str]:
        import re

        for name, digest in files.items():
            p = PurePosixPath(name)
            if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
                raise ValueError(f"file name {name!r} must be a relative path inside the repo")
            if not re.match(HEX64, digest):
                raise ValueError(f"sha256 of {name} is not 64 lowercase hex: {digest!r}")
        missing = [f for f in HEAD_FILES if f not in files]
        if missing:
            raise ValueError(f"pins lack the head's files: {', '.join(missing)}")
        return files


def load_pins(path: Path) -> Pins:
    """Read and validate a pins file; any problem is a one-line ``UsageError`` naming the file."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: pins file not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read pins file ({exc.strerror})") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: pins file is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        return Pins.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"{path}: invalid pins {first_validation_error(exc)}") from None
