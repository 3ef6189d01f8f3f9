"""The package's shape: stage folders (build/, gate/, release/) over three peer model folders (head/,
backbone/, vision/) over engine/, formats/ and sources/, leaves at the top. No import cycle among modules (at any
depth, as the code is written), no cycle among rooms (a folder counts as one room, so an import
that runs back up the layers shows as one), each asset format known by its backend module only,
and each stage picking the model in one place, from registries whose entries expose the same names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clef_flash import build, gate
from clef_flash.head import backends as formats

from .conftest import ROOT

PKG = ROOT / "clef_flash"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``path`` imports, at module level or inside functions."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".") if pkg else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("clef_flash"):
                target = node.module[len("clef_flash"):].lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules and m != me and m}


def graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob("*.py") if "_data" not in p.parts]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def rooms(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    room = lambda m: m.split(".")[0]  # noqa: E731
    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        out.setdefault(room(a), set()).update(room(b) for b in targets if room(b) != room(a))
    return out


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


def test_no_import_cycle_among_modules():
    edges = graph()
    assert edges["build"] >= {"build.config", "build.head", "build.backbone"}  # the walk sees real imports
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])
    assert find_cycle({**edges, "formats.aimodel": edges["formats.aimodel"] | {"build"}}) is not None  # and sees one when there is


def test_no_arrow_back_up_the_rooms():
    """Stages over models over formats and sources: a folder is one room, and no room imports one
    that imports it back (the arrows of the old shape, ``worker -> backbone.export``,
    ``artifact -> backbone.gate``, ``pinning -> backbone.weights``, would each show as a cycle)."""
    r = rooms(graph())
    assert find_cycle(r) is None, " -> ".join(find_cycle(r) or [])
    for low in ("head", "backbone", "formats", "sources"):
        assert not r.get(low, set()) & {"build", "gate", "release", "check", "cli"}, (low, r[low])
    assert not r["sources"] & {"head", "backbone", "formats"}
    broken = {**r, "sources": r["sources"] | {"backbone"}}  # pinning reading headers through backbone.weights
    assert find_cycle(broken) is not None


def test_only_a_backend_knows_its_format():
    """No module but the backend itself names its format or suffix as a string."""
    known = {b.FORMAT for b in formats.BACKENDS.values()} | {b.SUFFIX for b in formats.BACKENDS.values()}
    owners = {Path(b.__file__).relative_to(PKG).as_posix() for b in formats.BACKENDS.values()}
    assert owners == {"head/aimodel.py", "head/mlpackage.py"}
    owners |= {"formats/aimodel.py"}  # the Core AI format every model writes: its own name and suffix
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).as_posix() in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in known:
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


MODELS = ("head", "backbone", "vision")


def below(r: dict[str, set[str]], room: str) -> set[str]:
    """Every room that ``room`` reaches through its imports."""
    seen: set[str] = set()
    todo = [room]
    while todo:
        for nxt in r.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_models_are_peers_over_the_engine():
    """head/, backbone/ and vision/ side by side: none imports another, nor anything that does (the
    tower once imported the decoder's attention, export and manifest; the formats the head's contract),
    and what the tower shares with the decoder is the engine's or ``ops``'."""
    r = rooms(graph())
    for m in MODELS:
        assert not below(r, m) & set(MODELS), (m, sorted(below(r, m) & set(MODELS)))
        assert not below(r, m) & {"build", "gate", "release", "check", "cli", "synth"}, m
    assert "engine" in r["backbone"] and "engine" in r["vision"] and "ops" in r["vision"]
    assert not below(r, "engine") & set(MODELS) and not below(r, "formats") & set(MODELS)
    broken = {**r, "vision": r["vision"] | {"backbone"}}  # the tower reaching into the decoder again
    assert below(broken, "vision") & set(MODELS)
    broken = {**r, "formats": r["formats"] | {"head"}}  # a format reading the head's contract
    assert below(broken, "backbone") & set(MODELS)


def long_functions(limit: int) -> dict[str, int]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                out[f"{path.relative_to(PKG).as_posix()}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_function_over_100_lines():
    """A function the reader holds in one view; check-release reads as its steps (under 80)."""
    assert not long_functions(100), long_functions(100)
    assert long_functions(80).get("check/__init__.py:check_release") is None
    assert "check/__init__.py:check_release" in long_functions(20)  # the name the bar is held to is still there
    assert "backbone/stitch.py:stitch" in long_functions(40)  # the walk measures what it should


def test_every_backend_has_the_same_functions():
    wanted = [name for name in formats.Backend.__dict__ if not name.startswith("_")]
    wanted += list(formats.Backend.__annotations__)
    for fmt, module in formats.BACKENDS.items():
        missing = [name for name in wanted if not hasattr(module, name)]
        assert not missing, (fmt, missing)
        assert module.FORMAT == fmt


@pytest.mark.parametrize("registry, names", [
    (build.MODELS, ("MODEL", "SHIPS_LM_HEAD_TABLE", "compiles", "refuse", "plan", "export", "export_job", "gate", "summary")),
    (gate.MODELS, ("KIND", "MODEL", "OPTIONS", "FIXED_RECORDS", "manifest_of", "source_of", "run", "inspect", "asset_facts",
                    "schema")),
])
def test_every_model_of_a_stage_has_the_same_names(registry, names):
    assert set(registry) and len(registry) >= 2
    for key, module in registry.items():
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, (key, missing)
    assert {m.MODEL for m in build.MODELS.values()} == {m.MODEL for m in gate.MODELS.values()}


def test_the_model_is_chosen_in_one_place_per_stage():
    """Outside the registries, no stage module or the CLI asks which model it holds (no
    ``is_backbone``, no kind string compared): each stage looks the model up once."""
    offenders = []
    for path in sorted([*PKG.glob("cli.py"), *(PKG / "build").glob("*.py"), *(PKG / "gate").glob("*.py"),
                        *(PKG / "release").glob("*.py"), *(PKG / "check").glob("*.py")]):
        text = path.read_text()
        for needle in ("is_backbone", "_is_backbone_bundle", '== "decision-backbone"', "== KIND", '== "backbone"', '== "head"'):
            if needle in text:
                offenders.append(f"{path.relative_to(PKG)}: {needle}")
    assert not offenders, offenders


def test_no_package_file_is_ignored_by_git():
    """An ignore rule meant for the output folder (``build/``) once hid ``clef_flash/build/``: new
    files there were never committed and a clean clone could not import the package."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]
    r = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and not r.stdout.strip(), f"ignored by .gitignore: {r.stdout.split()}"
    # and the check sees an ignore rule when there is one
    r = subprocess.run(["git", "check-ignore", "--no-index", "build/x.py"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0
