"""The pinned source: where it comes from (a Hub commit, or a local release folder), and file ->
sha256 for every file that may be read.

Pins are checked before any network access: a malformed pins file is a usage error (exit 2).
A Hub origin names a 40-hex commit; a local release names no commit at all (``revision`` null,
``hf_id`` ``local/<name>``) and records what the folder says of itself (``release``).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import UsageError, first_validation_error

CODE_FILE = "joint_schema_model.py"
WEIGHTS_FILE = "joint_head.safetensors"
CONFIG_FILE = "joint_head_config.json"
HEAD_FILES = (CODE_FILE, WEIGHTS_FILE, CONFIG_FILE)

HEX40 = r"^[0-9a-f]{40}$"
HEX64 = r"^[0-9a-f]{64}$"


class Pins(BaseModel):
    """``manifests/clef-flash.source.json``: what may be read, and what its bytes must hash to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hf_id: str = Field(min_length=3, description="Hub repo id, e.g. Cloudflare/clef-flash; local/<name> for a local release")
    revision: str | None = Field(default=None, pattern=HEX40,
                                 description="the pinned Hub commit, 40 lowercase hex; null for a local release")
    files: dict[str, str] = Field(description="repo-relative file name -> sha256 (64 lowercase hex)")
    synthetic: bool = Field(default=False, description="true for a snapshot made by `clef-export synth`")
    origin: Literal["hub", "local"] = Field(default="hub", description="a Hub commit, or a local release folder")
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_]*$",
                             description="the release's name in bundle names (default: from hf_id)")
    release: dict[str, Any] | None = Field(default=None, description="what a local release says of itself "
                                           "(CLEF_FINETUNE.json facts, a tiny-random marker)")
    trusted_author_sha256: str | None = Field(default=None, pattern=HEX64, description=(
        "a joint_schema_model.py the tool does not know, trusted by name with `pin --trust-author-code`"))
    note: str | None = None

    @model_validator(mode="after")
    def _origin(self) -> "Pins":
        if self.origin == "hub" and self.revision is None:
            raise ValueError("a Hub origin needs its commit (revision)")
        if self.origin == "local" and self.revision is not None:
            raise ValueError("a local release has no Hub commit; revision must be null")
        return self

    @property
    def label(self) -> str:
        """``repo@commit`` (12 hex), or ``local/<name> (local release)``."""
        return f"{self.hf_id}@{self.revision[:12]}" if self.revision else f"{self.hf_id} (local release)"

    @property
    def release_name(self) -> str:
        """The name bundles of this release start with: ``name``, else the repo's name
        (``Cloudflare/clef-flash`` -> ``clef_flash``)."""
        if self.name:
            return self.name
        if self.synthetic:  # a synthetic snapshot stands in for clef-flash: the published names
            return "clef_flash"
        return self.hf_id.rsplit("/", 1)[-1].replace("-", "_").replace(".", "_")

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
