"""Progress: a rich bar on a terminal, plain lines elsewhere, always on stderr (never stdout)."""

from __future__ import annotations

import io
import threading

from clef_flash import progress as progress_mod
from clef_flash.progress import progress


def test_plain_lines_when_not_a_terminal(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)
    with progress("gate: t512", 4, "calls", terminal=False, file=out) as tick:
        for _ in range(4):
            tick()
    lines = out.getvalue().splitlines()
    assert lines[:3] == [f"· gate: t512 (calls): {k}/4 (0 s, about 0 s left)" for k in (1, 2, 3)]
    assert lines[3].startswith("· gate: t512 (calls): 4/4 in ") and len(lines) == 4
    assert "\x1b[" not in out.getvalue()


def test_plain_mode_is_quiet_between_intervals_and_counts_across_threads():
    out = io.StringIO()
    with progress("rows", 4000, terminal=False, file=out) as tick:
        threads = [threading.Thread(target=lambda: [tick() for _ in range(1000)]) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
    assert out.getvalue().startswith("· rows: 4000/4000 in ")


def test_a_terminal_gets_a_rich_bar_and_one_summary_line():
    out = io.StringIO()
    with progress("backbone: 3 records", 6, "calls", terminal=True, file=out) as tick:
        for _ in range(6):
            tick()
    text = out.getvalue()
    assert "\x1b[" in text, "a terminal bar draws with escape codes"
    assert "backbone: 3 records (calls): 6/6 in" in text


def test_plain_lines_estimate_what_is_left_at_the_pace_so_far(monkeypatch):
    """Long work is never silent: each line says how long the rest will take at the pace so far."""
    out = io.StringIO()
    clock = iter(float(t) for t in range(0, 1000, 10))  # 10 s a step
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    with progress("engine", 4, "layers", terminal=False, file=out) as tick:
        for _ in range(4):
            tick()
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["· engine (layers): 1/4 (10 s, about 30 s left)", "· engine (layers): 2/4 (20 s, about 20 s left)",
                         "· engine (layers): 3/4 (30 s, about 10 s left)"]


def test_slow_progress_speaks_only_for_slow_work(monkeypatch):
    """A request's decoder on the torch engine: a line with an estimate every PLAIN_EVERY_S, none for
    work that ends sooner (a tiny release's request says nothing)."""
    clock = iter(float(t) for t in (0, 5, 11, 12, 30))
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    lines: list[str] = []
    step = progress_mod.slow_progress("request on line 2", lines.append)  # t0 = 0
    for done in (1, 2, 3, 4):  # at 5 s, 11 s, 12 s, 30 s
        step(done, 4)
    assert lines == ["request on line 2: decoder layer 2/4 (11 s, about 11 s left)"]
