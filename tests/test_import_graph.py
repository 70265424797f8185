"""The package's import graph, held: no module imports a package above its own, and no modules import in a circle.

The floors, lowest first (:data:`FLOORS`): the shared rooms (``overlay/*.py`` but the front door), then the
packages by what they build on, then the verbs (``commands/``) and the front door (``cli``, ``__main__``).
A module may import its own package's modules and any floor below its own, never one beside or above it
(``maintain/`` reading ``engine/`` was one: the facts both need live in ``releases/engine_cases``). Every
import counts: at the top of a module, inside a function and under ``TYPE_CHECKING`` (a circle of type hints
is a circle a reader walks). Among the modules themselves, no import circle (``regress/``'s checks, profiles,
results and server were one: the step's context now lives in ``regress/step``, above them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "overlay"

FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"(shared)"}),  # overlay/__init__ (the version), errors, digest, lock, git, atomic, jsonfile, ...
    frozenset({"build"}),
    frozenset({"releases"}),
    frozenset({"maintain", "kernels", "device"}),
    frozenset({"engine", "image"}),
    frozenset({"regress"}),
    frozenset({"bench"}),
    frozenset({"commands"}),
    frozenset({"(front door)"}),  # cli, __main__
)
FRONT_DOOR = {"overlay.cli", "overlay.__main__"}


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module and package of ``root`` (the ``overlay`` folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) for every import of a module of ``known`` anywhere in ``path`` (the most specific module
    each names: ``from overlay.regress import yamltext`` imports ``overlay.regress.yamltext``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield node.lineno, target


def graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the first line that does}."""
    known = modules(root)
    out: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = out.setdefault(name, {})
        for line, target in imported(name, path, known):
            edges.setdefault(target, line)
    return out


def room(module: str) -> str:
    """The package ``module`` lives in (its first part below ``overlay``), or its floor's name."""
    if module in FRONT_DOOR:
        return "(front door)"
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "(shared)"


def floor(module: str, rooms: dict[str, str] | None = None) -> int:
    name = (rooms or {}).get(module) or room(module)
    found = [i for i, names in enumerate(FLOORS) if name in names]
    assert found, f"{module}: its package {name!r} is on no floor of tests/test_import_graph.py's FLOORS"
    return found[0]


def upward(edges: dict[str, dict[str, int]], rooms: dict[str, str] | None = None) -> list[str]:
    """Every import of a module beside or above the importer's floor, from another package."""
    def where(module: str) -> str:
        return (rooms or {}).get(module) or room(module)

    return [f"{a} (line {line}) imports {b}: {where(a)} may not import {where(b)}"
            for a, targets in sorted(edges.items()) for b, line in sorted(targets.items())
            if where(a) != where(b) and floor(b, rooms) >= floor(a, rooms)]


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_its_floor() -> None:
    rooms = {room(m) for m in modules(PACKAGE)}
    declared = set().union(*FLOORS)
    assert rooms == declared, f"packages without a floor {sorted(rooms - declared)}, floors naming none " \
                              f"{sorted(declared - rooms)}"


def test_no_import_runs_up() -> None:
    found = upward(graph())
    assert found == [], "imports that run up or sideways:\n" + "\n".join(found)


def test_no_modules_import_in_a_circle() -> None:
    found = circles(graph())
    assert found == [], f"import circles: {found}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "overlay"
    for rel, text in {"__init__.py": "", "errors.py": "", "low/__init__.py": "", "high/__init__.py": "",
                      "low/a.py": "def f():\n    from overlay.high import b\n",
                      "high/b.py": "from overlay.low import a\nfrom overlay import errors\n",
                      "high/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import x\n",
                      "high/d.py": "from overlay.high.c import y\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_an_import_inside_a_function_that_runs_up_is_found(tree: Path) -> None:
    """The test can fail: ``low.a`` importing ``high.b`` inside a function is named, ``high.b``'s imports not."""
    rooms = {"overlay.low.a": "build", "overlay.high.b": "engine", "overlay.high.c": "engine",
             "overlay.high.d": "engine", "overlay.errors": "(shared)"}
    edges = graph(tree)
    assert edges["overlay.high.b"] == {"overlay.low.a": 1, "overlay.errors": 2}
    found = upward({m: edges[m] for m in rooms}, rooms)
    assert found == ["overlay.low.a (line 2) imports overlay.high.b: build may not import engine"], found


def test_a_circle_through_type_hints_and_relative_imports_is_found(tree: Path) -> None:
    assert circles(graph(tree)) == [["overlay.high.b", "overlay.low.a"], ["overlay.high.c", "overlay.high.d"]]
