"""The package's shape, held: what one module takes from another is public, and the README's
Layout names every package and module there is.

A name with a leading underscore is its module's own: another module that imports it (or reaches it
as ``module._name``) ties itself to what its owner may change without a word. A Layout row that names
no longer existing modules, or leaves out new ones, sends a newcomer to the wrong file.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "overlay"


def private_crossings(path: Path) -> list[str]:
    """``from overlay.x import _y`` and ``module._y`` (``module`` an imported overlay module) in ``path``."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("overlay"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("overlay")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_takes_a_private_name_from_another() -> None:
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in private_crossings(path)]
    assert found == [], "make these public or move them:\n" + "\n".join(found)
