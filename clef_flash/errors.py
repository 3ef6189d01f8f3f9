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


def not_a_config(where: str, what: str, exc: Exception) -> IntegrityError:
    """A configuration that did not parse, in one line naming the file and the field or the reason."""
    why = f"missing {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
    return IntegrityError(f"{where}: not a {what} ({why})")


def refuse_problems(where: str, problems: list[str], prefix: str = "") -> None:
    """The first of a parsed configuration's problems (what makes it unexportable), as an ``IntegrityError``."""
    if problems:
        raise IntegrityError(f"{where}: {prefix}{problems[0]}")
