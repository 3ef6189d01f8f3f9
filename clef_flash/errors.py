"""Typed errors, each with the exit code the CLI maps it to (one line, no traceback)."""

from __future__ import annotations


class ClefError(Exception):
    """Base: an expected failure with a one-line message and an exit code."""

    exit_code = 1


class OutputError(ClefError):
    """The output could not be written (disk full, read-only file system); nothing was left."""

    exit_code = 1


class UsageError(ClefError):
    """Bad arguments, malformed pins or recipe: nothing was touched."""

    exit_code = 2


class IntegrityError(ClefError):
    """A hash mismatch, a missing, unpinned or corrupt file."""

    exit_code = 3


class NumericError(ClefError):
    """A numeric gate failed."""

    exit_code = 4


class ToolchainError(ClefError):
    """A required toolchain (coreai, xcrun, pip) is missing or failed."""

    exit_code = 5


class RemoteError(ClefError):
    """The Hub refused a request or the connection failed mid-way; nothing was committed."""

    exit_code = 6


def first_validation_error(exc) -> str:
    """A pydantic ``ValidationError`` as one line: ``at <field path>: <message>``."""
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first["loc"]) or "(top level)"
    return f"at {where}: {first['msg']}"
