"""What the decoder's and the tower's gates share: a report of an asset's rows against a reference's,
per record (relative max |d|, minimum row cosine, the arm that ran), against bars by compute, with
red arms that must fail those bars; and the registry entry's reading of a Core AI bundle's source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..progress import plural
from ..report import Report


@dataclass
class RowsReport(Report):
    compute: str = "fp32"
    results: list[Any] = field(default_factory=list)  # each: name, rel_max_abs_d, min_row_cosine, arm
    red_arms: tuple[str, ...] = ()  # the arms this run had to run

    TOLERANCES: ClassVar[dict[str, dict[str, tuple[float, str]]]] = {}
    NOUN: ClassVar[str] = "record"
    REPORTED_ARMS: ClassVar[tuple[str, ...]] = ()  # arms reported beside the bars, neither gated nor red
    GATED_ARMS: ClassVar[tuple[str, ...]] = ()  # arms held to the bars as the main one is (not red)

    def _inside(self, r) -> bool:
        bars = self.TOLERANCES[self.compute]
        return r.rel_max_abs_d <= bars["rel_max_abs_d"][0] and r.min_row_cosine >= bars["min_row_cosine"][0]

    def _main_label(self, r) -> str:
        return f"{self.NOUN} {r.name}"

    def main_results(self) -> list[Any]:
        return [r for r in self.results if r.arm == "main"]

    def red_results(self) -> list[Any]:
        return [r for r in self.results if not self._gated(r) and r.arm not in self.REPORTED_ARMS]

    def _gated(self, r) -> bool:
        return r.arm == "main" or r.arm in self.GATED_ARMS

    def result_failures(self) -> list[str]:
        out, bars = [], self.TOLERANCES[self.compute]
        for r in self.results:
            if r.arm in self.REPORTED_ARMS:
                continue
            inside = self._inside(r)
            if self._gated(r) and not inside:
                out.append(f"{self._main_label(r)}{'' if r.arm == 'main' else ' (' + r.arm + ')'}: rel max |d| "
                           f"{r.rel_max_abs_d:.3g} (bar {bars['rel_max_abs_d'][0]:g}), "
                           f"min row cosine {r.min_row_cosine:.6f} (bar {bars['min_row_cosine'][0]:g})")
            if not self._gated(r) and inside:
                out.append(f"red arm {r.arm} on {self.NOUN} {r.name}: rel max |d| {r.rel_max_abs_d:.3g} passes the bar "
                           f"(the gate cannot see it)")
        if self.results:  # a numeric run: every arm it owed is there
            ran = {r.arm for r in self.red_results()}
            out.extend(f"red arm {arm} did not run (no gate passes without its red arms)"
                       for arm in self.red_arms if arm not in ran)
        return out

    def verdict(self, r) -> str:
        ok = self._inside(r) if self._gated(r) else not self._inside(r)
        return "pass" if ok else "FAIL"

    def bars(self) -> dict[str, float]:
        return {k: v[0] for k, v in self.TOLERANCES[self.compute].items()}

    def checks_headline(self) -> str:
        """The headline of a run without numeric results: how many of the asset's checks passed."""
        return f"{sum(ok for _, ok, _ in self.checks)}/{plural(len(self.checks), 'check')} of the saved asset passed"


def source_of(manifest) -> tuple[str, str | None]:
    """The release a Core AI model bundle names as its source (``gate.MODELS``' ``source_of``)."""
    return manifest.source.hf_id, manifest.source.revision


def asset_facts_of(read) -> tuple[str, str, str]:
    """(name, asset suffix, main.mlirb's sha256) of a Core AI bundle read back (``(manifest, asset, checks)``)."""
    m, asset, _ = read
    return m.name, asset.suffix[1:], m.export.main_mlirb.sha256


def core_ai_schema(fmt: str | None, what: str, json_schema) -> dict[str, Any]:
    """A Core AI model bundle's manifest schema; another ``--format`` is refused (``what``: "a backbone bundle")."""
    from ..errors import UsageError
    from ..formats import aimodel

    if fmt is not None and fmt != aimodel.FORMAT:
        raise UsageError(f"--format {fmt}: {what} is a Core AI asset only")
    return json_schema()
