"""Stage 2: the author's code and weights, from verified bytes only.

``joint_schema_model.py`` is Cloudflare's code (Apache-2.0). It is never part of this repository:
``obtain_author_code`` takes it from the ``clef-finetune==0.1.0`` wheel at set-up time, and
``load_author_module`` executes it from exactly the bytes whose sha256 matched the pin (read once,
hashed, compiled from memory: no ``__pycache__`` is written next to cached files).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..bundle import atomic_write_bytes
from ..errors import IntegrityError, ToolchainError, first_validation_error
from ..digest import sha256_bytes

AUTHOR_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"
# The joint_schema_model.py files this tool executes without being told to: Cloudflare's published
# file (the pinned clef-flash commit, and the copy clef-finetune 0.1.0 vendors and writes into
# every release it merges).
KNOWN_AUTHOR_SHA256 = {AUTHOR_SHA256: "Cloudflare/clef-flash@17f0b0ad, clef-finetune 0.1.0"}
AUTHOR_WHEEL = "clef-finetune==0.1.0"
AUTHOR_MEMBER = "clef_finetune/_vendor/joint_schema_model.py"

_MODULES: dict[str, types.ModuleType] = {}
AUTHOR_ENV = "CLEF_AUTHOR_CODE"
CHECKOUT_COPY = Path(".cache/author/joint_schema_model.py")  # where `make setup` puts it in a checkout


def default_author_code() -> Path:
    """Where the author's file is looked for and, by ``author-code``, written: ``$CLEF_AUTHOR_CODE``,
    else a checkout's ``.cache/author/`` copy when the command runs in one, else the user's cache
    (``$XDG_CACHE_HOME`` or ``~/.cache``, ``clef-export/author/``): so an installed tool works from
    any folder."""
    import os

    if os.environ.get(AUTHOR_ENV):
        return Path(os.environ[AUTHOR_ENV])
    if CHECKOUT_COPY.is_file():
        return CHECKOUT_COPY
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "clef-export" / "author" / "joint_schema_model.py"


def require_author_code(path: Path | None) -> Path:
    """The author's file for the synthetic writers, checked to exist before any work."""
    from ..errors import UsageError

    path = Path(path) if path is not None else default_author_code()
    if not path.is_file():
        raise UsageError(f"{path}: the author's joint_schema_model.py is not there; run `clef-export author-code"
                         f"{'' if path == default_author_code() else f' --out {path}'}` first (or pass --author-code)")
    return path


def obtain_author_code(out: Path, expected_sha256: str = AUTHOR_SHA256) -> Path:
    """``pip download --no-deps clef-finetune==0.1.0``, extract the one file, check, write atomically."""
    out = Path(out)
    if out.is_file() and sha256_bytes(out.read_bytes()) == expected_sha256:
        return out
    with tempfile.TemporaryDirectory(prefix="clef-author-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", AUTHOR_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("clef_finetune-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise ToolchainError(f"pip download {AUTHOR_WHEEL} failed: {tail[0]}")
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                data = zf.read(AUTHOR_MEMBER)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise IntegrityError(f"{wheels[0].name}: cannot read {AUTHOR_MEMBER} ({exc})") from None
    actual = sha256_bytes(data)
    if actual != expected_sha256:
        raise IntegrityError(
            f"{AUTHOR_WHEEL}:{AUTHOR_MEMBER}: sha256 mismatch (expected {expected_sha256[:12]}…, got {actual[:12]}…)"
        )
    atomic_write_bytes(out, data)
    return out


def read_verified(path: Path, expected_sha256: str, what: str = "refusing to use it") -> bytes:
    """Read a file once and return its bytes only if they hash to the pin."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing") from None
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot read ({exc.strerror or exc})") from None
    actual = sha256_bytes(data)
    if actual != expected_sha256:
        raise IntegrityError(
            f"{path}: sha256 mismatch, {what} (expected {expected_sha256[:12]}…, got {actual[:12]}…)"
        )
    return data


def load_author_module(path: Path, expected_sha256: str) -> types.ModuleType:
    """Execute the author's module from the verified bytes of ``path`` (and nothing else)."""
    path = Path(path)
    data = read_verified(path, expected_sha256, "refusing to execute")
    actual = expected_sha256
    if actual in _MODULES:
        return _MODULES[actual]
    name = f"clef_flash._author_{actual[:16]}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    # dataclasses resolve annotations through sys.modules, so the module must be registered
    # while it executes; the code object comes from the verified bytes, not from the path.
    sys.modules[name] = module
    try:
        exec(compile(data, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    for attr in ("JointSchemaHead", "EncodedRecord", "EncodedQuestion", "systemone_answer"):
        if not hasattr(module, attr):
            raise IntegrityError(f"{path}: the author's module has no {attr}")
    _MODULES[actual] = module
    return module


class HeadConfig(BaseModel):
    """``joint_head_config.json``: the ``JointSchemaHead`` constructor arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    hidden_size: int = Field(gt=0)
    width: int = Field(gt=0)
    routing_layers: int = Field(ge=0)
    layers: int = Field(ge=0)
    heads: int = Field(gt=0)
    feedforward: int = Field(gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    def model_post_init(self, _: Any) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")


def load_config(path: Path, expected_sha256: str | None = None) -> HeadConfig:
    path = Path(path)
    raw = read_verified(path, expected_sha256) if expected_sha256 else path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{path}: config is not UTF-8 ({exc.reason})") from None
    if isinstance(data, dict) and isinstance(data.get("dropout"), int):
        data["dropout"] = float(data["dropout"])
    try:
        return HeadConfig.model_validate(data)
    except ValidationError as exc:
        raise IntegrityError(f"{path}: invalid head config {first_validation_error(exc)}") from None


def load_state(path: Path, expected_sha256: str | None = None) -> dict[str, Any]:
    """Read a safetensors file from its verified bytes (nothing is unpickled); a corrupt header
    names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    path = Path(path)
    if path.suffix != ".safetensors":
        raise IntegrityError(f"{path}: only .safetensors weights are accepted")
    raw = read_verified(path, expected_sha256) if expected_sha256 else path.read_bytes()
    try:
        return load_bytes(raw)
    except (SafetensorError, ValueError) as exc:
        raise IntegrityError(f"{path}: corrupt safetensors ({str(exc).splitlines()[0]})") from None


def build_head(module: types.ModuleType, config: HeadConfig, state: dict[str, Any], dtype: Any, weights: Path):
    """``JointSchemaHead(**config)`` with ``load_state_dict(strict=True)``, in eval mode.

    Built on the meta device and loaded by assignment, so no random fp32 master copy is ever
    made; the checkpoint's tensors are cast once to ``dtype``.
    """
    import torch

    with torch.device("meta"):
        head = module.JointSchemaHead(**config.model_dump())
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise IntegrityError(f"{weights}: state dict is missing {len(missing)} key(s), first {missing[0]!r}")
    if unexpected:
        raise IntegrityError(f"{weights}: state dict has {len(unexpected)} unexpected key(s), first {unexpected[0]!r}")
    for k, shape in expected.items():
        got = tuple(state[k].shape)
        if got != shape:
            raise IntegrityError(f"{weights}: {k} has shape {list(got)}, the head expects {list(shape)}")
        if not state[k].is_floating_point():
            raise IntegrityError(f"{weights}: {k} has dtype {state[k].dtype}, expected a float")
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return head.eval().requires_grad_(False)


def check_author_trusted(path: Path, sha256: str, trusted: str | None = None) -> None:
    """Refuse to execute an author's file the tool does not know, unless the user trusted that
    exact sha256 (``pin --trust-author-code SHA256``)."""
    if sha256 in KNOWN_AUTHOR_SHA256 or sha256 == trusted:
        return
    raise IntegrityError(f"{path}: sha256 {sha256} is not a joint_schema_model.py this tool knows; refusing to "
                         f"execute it (to run this exact file, pin with --trust-author-code {sha256})")


def load_head(source: Path, pins: Any, dtype: Any):
    """Module, config and head from a source folder, each file read once and checked against
    its pin before use; the author's file only when its sha256 is known or trusted."""
    from .pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE

    source = Path(source)
    check_author_trusted(source / CODE_FILE, pins.files[CODE_FILE], pins.trusted_author_sha256)
    module = load_author_module(source / CODE_FILE, pins.files[CODE_FILE])
    config = load_config(source / CONFIG_FILE, pins.files[CONFIG_FILE])
    state = load_state(source / WEIGHTS_FILE, pins.files[WEIGHTS_FILE])
    head = build_head(module, config, state, dtype, source / WEIGHTS_FILE)
    return module, config, head


