"""The head's asset formats, each one module with the same functions: the recipe's (or the manifest's)
``format`` picks the module once, and nothing else in the package branches on a format.

A third format is one new module with these functions, added to ``BACKENDS``, plus its recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Protocol

from pydantic import BaseModel

from . import aimodel, mlpackage
from ..errors import UsageError
from ..manifest import Seconds

# The published manifest has no ``format`` key: a manifest without one is a Core AI bundle.
DEFAULT_FORMAT = aimodel.FORMAT


class Backend(Protocol):
    FORMAT: str  # the recipe's ``format`` and the manifest's (absent for the default)
    SUFFIX: str  # the asset folder's suffix
    RECIPE: str  # its default recipe in conversion/
    SCHEMA_FILE: str  # its manifest's JSON Schema in manifests/
    AOT: bool  # whether `xcrun coreai-build` compiles it
    Manifest: type[BaseModel]

    def import_toolchain(self) -> Any: ...  # ToolchainError (exit 5) when missing

    def convert(self, graph: Any, recipe: Any, hidden_size: int, asset_dir: Path,
                log: Callable[[str], None]) -> Any: ...  # in the export worker

    def save(self, program: Any, asset_dir: Path, description: dict[str, str], log: Callable[[str], None]) -> None: ...

    def record_parameters(self) -> dict[str, Any]: ...

    def manifest(self, common: dict[str, Any], recipe: Any, asset_dir: Path, outputs: dict[str, str],
                 seconds: Seconds) -> BaseModel: ...

    def check_files(self, m: Any, asset: Path) -> list[tuple[str, bool, str]]: ...  # IntegrityError

    def asset_digest(self, m: Any) -> str: ...

    def sizes(self, m: Any) -> dict[str, int]: ...

    def summary(self, m: Any) -> str: ...

    def read_back(self, asset: Path, m: Any, hidden_size: int, params: dict[str, Any]) -> list[tuple[str, bool, str]]: ...

    def cannot_run(self) -> str | None: ...

    def runner(self, asset: Path, names: list[str]) -> Any: ...  # async context manager -> call(fn, arrays)

    def describe(self, asset: Path) -> list[dict[str, Any]]: ...


BACKENDS: dict[str, Backend] = {m.FORMAT: m for m in (aimodel, mlpackage)}  # type: ignore[misc]
FORMATS = tuple(BACKENDS)


def backend(fmt: str) -> Backend:
    try:
        return BACKENDS[fmt]
    except KeyError:
        raise UsageError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})") from None


def of_manifest(m: BaseModel) -> Backend:
    """The backend whose manifest model ``m`` is."""
    return next(b for b in BACKENDS.values() if isinstance(m, b.Manifest))


def load_manifest(data: bytes) -> BaseModel:
    """A bundle's ``metadata.json``, validated by its format's model. Raises ``ValueError``
    (pydantic's, or for JSON that is not an object or names an unknown format)."""
    raw = json.loads(data)
    if not isinstance(raw, dict):
        raise ValueError("a manifest is a JSON object")
    fmt = raw.get("format", DEFAULT_FORMAT)
    if fmt not in BACKENDS:
        raise ValueError(f"unknown format {fmt!r}")
    return BACKENDS[fmt].Manifest.model_validate(raw)


def json_schema(fmt: str = DEFAULT_FORMAT) -> dict[str, Any]:
    from ..manifest import json_schema_of

    b = backend(fmt)
    return json_schema_of(b.Manifest, b.SCHEMA_FILE)
