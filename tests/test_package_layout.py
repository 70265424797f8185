"""The package's shape, held: what one module takes from another is public, and the Layout of
``docs/ARCHITECTURE.md`` ("Package layout") names every package and module there is.

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


def packages() -> dict[str, set[str]]:
    """``overlay/<pkg>/`` -> its modules and subpackages (``name/``), as the tree has them."""
    out = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if "__pycache__" in folder.parts:
            continue
        names = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
        names |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
        out[f"{folder.relative_to(REPO)}/"] = names
    return out


def layout_rows(text: str | None = None) -> dict[str, set[str]]:
    """The ``overlay/...`` rows of ARCHITECTURE's "Package layout" -> the module names they give (backticked
    words). A row whose first cell is empty continues the row above (lines stay short)."""
    import re

    text = (REPO / "docs" / "ARCHITECTURE.md").read_text() if text is None else text
    section = text.split("\n## Package layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    current = None
    for line in section.splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) != 4:
            continue
        first = cells[1].strip()
        if first:  # a new row: an overlay package's, or another path's
            path = re.fullmatch(r"`(overlay/[a-z_/]*)`", first)
            current = path[1] if path else None
            if current:
                rows[current] = set()
        if current:
            rows[current] |= set(re.findall(r"`([a-z_0-9]+/?|__main__)`", cells[2])) - {"__init__"}
    return rows


def test_a_layout_row_may_continue_on_the_next_lines() -> None:
    readme = ("\n## Package layout\n\n| path | holds |\n| --- | --- |\n| `overlay/a/` | `x`, `y` |\n| | and `z` |\n"
              "| `scripts/` | `s.sh` |\n| | `t` |\n\n## Next\n")
    assert layout_rows(readme) == {"overlay/a/": {"x", "y", "z"}}


def test_the_readme_layout_names_every_package_and_module() -> None:
    rows, tree = layout_rows(), packages()
    assert sorted(rows) == sorted(tree), f"Layout rows {sorted(rows)} vs packages {sorted(tree)}"
    for pkg, names in tree.items():
        assert rows[pkg] == names, (f"ARCHITECTURE.md Package layout, {pkg}: leaves out {sorted(names - rows[pkg])}, "
                                    f"names what is not there {sorted(rows[pkg] - names)}")
