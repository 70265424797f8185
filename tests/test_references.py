"""Every reference the prose makes is alive: each repository path, Make target and ``module.function`` named in
backticks in README.md, ``docs/**/*.md`` and the module docstrings of ``overlay/``, ``tests/`` and ``scripts/``.

A docstring named a test file never committed, a guide a function that had gone, another a file that moved
(issue 52, item 2). What counts as a reference:

- a path: a backticked word that starts at the repository's top (``overlay/``, ``tests/``, ``docs/``, ``patches/``,
  ``scripts/``, ``docker/``, ``ci/``, ``.ci/``, ``Makefile``, ...), optionally ``:SYMBOL`` (which its file must
  define) or ``#anchor``; a pattern (``patches/<release>/``, ``tests/test_build*.py``) names no one file;
- a Make target: ``make <target>`` (the Makefile's targets, ``make help``'s list);
- a ``module.function``: ``overlay.x.y[.z]``, or ``<module>.<name>`` where ``<module>`` is the name of a module of
  ``overlay/`` (``workload.cases``): the name must be defined in one module of that name.

Left out: ``docs/records/`` (dated history, each record as it was) and ``patches/*/REBASE.md`` (a rebase's report);
the paths of ``docs/reliability/README.md``, whose backticked paths are the bad inputs it tried (its functions and
targets are held). A ``<module>.<name>`` written without ``overlay.`` may name a field its module reads
(``server.ready_timeout_s``): the name must be in that module's text; a qualified one must be defined there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_readme import make_targets

REPO = Path(__file__).resolve().parent.parent
TOPS = ("overlay/", "tests/", "docs/", "patches/", "scripts/", "docker/", "ci/", ".ci/", "Makefile", "README.md",
        "pyproject.toml")
PATTERN = re.compile(r"[<>*{}$]|\.\.\.|\[|x\.y\.z")  # a pattern or placeholder, not one file
FILE_SUFFIXES = {"json", "md", "py", "toml", "yaml", "yml", "txt", "whl", "log", "png", "sh", "lock", "patch", "gz",
                 "so", "tar", "csv", "xml", "html", "cfg", "ini", "c", "h", "cu", "cpp", "ninja"}
INPUTS = {"docs/reliability/README.md"}  # a catalogue of bad inputs: the paths it names are the inputs, never there


def texts() -> Iterator[tuple[str, str]]:
    """(where, text) for README.md, each guide under docs/ but the records, and every module docstring."""
    yield "README.md", (REPO / "README.md").read_text()
    for path in sorted((REPO / "docs").rglob("*.md")):
        if "records" not in path.relative_to(REPO / "docs").parts:
            yield str(path.relative_to(REPO)), path.read_text()
    for top in ("overlay", "tests", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            if "fixtures" in path.parts or "__pycache__" in path.parts:
                continue
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if doc:
                yield str(path.relative_to(REPO)), doc


def backticked(text: str) -> list[str]:
    """The backticked words of ``text`` (``x``, ``x`` and :role:`x` alike), each stripped of a trailing period."""
    words = re.findall(r"``([^`\n]+)``", text)
    words += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"``[^`\n]+``", "", text))
    return [w.strip().rstrip(".,;") for w in words]


def defines(path: Path, name: str) -> bool:
    """``path`` defines ``name``: a def, class, assignment, annotated name or import of it (or a dict key
    spelled as a string: a registry entry)."""
    source = path.read_text()
    first = name.split(".")[0]
    return bool(re.search(rf"(?m)^\s*(?:async\s+)?(?:def|class)\s+{re.escape(first)}\b|^\s*{re.escape(first)}\s*[:=]"
                          rf"|\bimport\b[^\n]*\b{re.escape(first)}\b|[\"']{re.escape(first)}[\"']", source))


def path_problem(word: str) -> str | None:
    """Why the path ``word`` names nothing (None when it is there, or a pattern)."""
    if " " in word or PATTERN.search(word):
        return None
    path, _, symbol = word.partition(":")
    path = path.split("#", 1)[0]
    target = REPO / path
    if not target.exists():
        return f"{path} is not there"
    if symbol and re.fullmatch(r"[A-Za-z_][\w.]*", symbol) and target.is_file() and not defines(target, symbol):
        return f"{path} defines no {symbol}"
    return None


def module_files() -> dict[str, list[Path]]:
    """The dotted name and the plain name of every module of ``overlay/`` -> its files."""
    out: dict[str, list[Path]] = {}
    for path in sorted((REPO / "overlay").rglob("*.py")):
        parts = ["overlay", *path.relative_to(REPO / "overlay").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out.setdefault(".".join(parts), []).append(path)
        out.setdefault(parts[-1], []).append(path)
    return out


MODULES = module_files()


def dotted_problem(word: str) -> str | None:
    """Why the ``module.function`` ``word`` names nothing (None when defined, or not such a reference)."""
    if not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?", word):
        return None
    parts = word.removesuffix("()").split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    if (REPO / "overlay" / parts[0] / "__init__.py").is_file():  # engine.workload: overlay.engine.workload
        parts = ["overlay", *parts]
    qualified = parts[0] == "overlay"
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module not in MODULES or (not qualified and cut > 1):
            continue
        name = ".".join(parts[cut:])
        if not name:
            return None
        files = MODULES[module]
        if any(defines(f, name) for f in files):
            return None
        if not qualified and any(re.search(rf"\b{re.escape(name)}\b", f.read_text()) for f in files):
            return None
        return f"no module {module} defines {name}"
    return "no such module" if qualified else None


def problems(where: str, text: str, targets: set[str]) -> list[str]:
    found = []
    for word in backticked(text):
        for target in re.findall(r"(?:^|\s)make ([a-zA-Z0-9_-]+)", word):
            if target not in targets:
                found.append(f"{where}: `make {target}`: no such target")
        if word.startswith(TOPS) and where not in INPUTS and (problem := path_problem(word)):
            found.append(f"{where}: `{word}`: {problem}")
        elif not word.startswith(TOPS) and (problem := dotted_problem(word)):
            found.append(f"{where}: `{word}`: {problem}")
    return found


def test_every_reference_is_alive() -> None:
    targets = make_targets() | {"help"}
    found = [p for where, text in texts() for p in problems(where, text, targets)]
    assert found == [], "dead references:\n" + "\n".join(found)


@pytest.mark.parametrize(("text", "dead"), [
    ("see `tests/test_project_default.py`", True),
    ("see `tests/test_readme.py`", False),
    ("the table `overlay/engine/variants.py:EXPECT`", False),
    ("the table `overlay/engine/variants.py:NO_SUCH_TABLE`", True),
    ("run ``make no-such-target``", True),
    ("`overlay.engine.workload.cases`", False),
    ("`overlay.engine.workload.no_such_function`", True),
    ("`workload.no_such_function`", True),
    ("`patches/<release>/series` and `tests/test_build*.py`", False),
    ("`verdict.json` and `meta.vllm`", False),
    ("`engine.workload.cases` and `regress.profiles`", False),
    ("`engine.workload.no_such_function`", True),
])
def test_a_dead_reference_is_named(text: str, dead: bool) -> None:
    assert bool(problems("x.md", text, make_targets() | {"help"})) is dead
