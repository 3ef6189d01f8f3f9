"""What every gate returns: a ``Report`` of checks (name, ok, detail), a table of numeric results
with a verdict per row (pass, FAIL, near-tie), the bars, notes on what was not run, and the JSON
transcript. The CLI prints any report the same way, without asking which model made it; a
failure is collected, never raised early, and ``raise_for_failures`` turns them into exit 4."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import NumericError

Row = tuple[list[str], str]  # the cells, and the verdict: "pass", "FAIL" or "near-tie"


@dataclass(frozen=True)
class GateConfig:
    """What every gate is asked first: the bundle, the release folder (None: the pinned revision in
    the HF cache) and its pins; each model's gate adds its own options."""

    bundle: Path
    source: Path | None
    pins_path: Path


@dataclass
class Report:
    bundle: Path
    checks: list[tuple[str, bool, str]]
    transcript: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # what was not run here, and why

    # ---- what a model's gate fills in
    def result_failures(self) -> list[str]:
        return []

    def title(self) -> str:
        return f"verify {self.bundle}"

    def columns(self) -> list[str]:
        return []

    def rows(self) -> list[Row]:
        return []

    def lines(self) -> list[str]:
        """Further lines under the checks (red arms, near-ties), plain text."""
        return []

    def bars(self) -> dict[str, float]:
        return {}

    def headline(self) -> str:
        """One line of the numbers, for the build's summary."""
        return ""

    # ---- the same for every gate
    @property
    def failures(self) -> list[str]:
        return [f"{name}: {detail}" for name, ok, detail in self.checks if not ok] + self.result_failures()

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_for_failures(self) -> None:
        if self.failures:
            raise NumericError(f"{self.bundle}: verification failed: {self.failures[0]}"
                               + (f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""))
