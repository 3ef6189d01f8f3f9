"""The package's shape: no import cycle among its modules (imports at any depth, as the code is
written), and each asset format is known by its backend module only."""

from __future__ import annotations

import ast
from pathlib import Path

from clef_flash import backends

from .conftest import ROOT

PKG = ROOT / "clef_flash"


def imports_of(path: Path) -> set[str]:
    """The package modules that ``path`` imports, at module level or inside functions."""
    names = {p.stem for p in PKG.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            targets = [node.module] if node.module else [a.name for a in node.names]
            out |= {t.split(".")[0] for t in targets if t and t.split(".")[0] in names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clef_flash."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("clef_flash.")}
    return out - {"__init__", path.stem}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycle_inside_the_package():
    edges = {p.stem: imports_of(p) for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert edges["build"] >= {"worker", "gate", "backends"}  # the walk sees real imports
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])
    # and the check itself sees a cycle when there is one
    assert find_cycle({**edges, "backends": edges["backends"] | {"build"}}) is not None


def test_only_a_backend_knows_its_format():
    """No module but the backend itself names its format or suffix as a string."""
    known = {b.FORMAT for b in backends.BACKENDS.values()} | {b.SUFFIX for b in backends.BACKENDS.values()}
    owners = {f"{b.__name__.rsplit('.', 1)[1]}.py" for b in backends.BACKENDS.values()}
    assert owners == {"aimodel.py", "mlpackage.py"}
    offenders = []
    for path in sorted(PKG.glob("*.py")):
        if path.name in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in known:
                offenders.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def test_every_backend_has_the_same_functions():
    wanted = [name for name in backends.Backend.__dict__ if not name.startswith("_")]
    wanted += list(backends.Backend.__annotations__)
    for fmt, module in backends.BACKENDS.items():
        missing = [name for name in wanted if not hasattr(module, name)]
        assert not missing, (fmt, missing)
        assert module.FORMAT == fmt
