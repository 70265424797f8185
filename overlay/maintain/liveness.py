"""Patch liveness: which of the lines a series adds to a release ran in a given run.

A test or an engine run that passes says nothing about a patch whose lines never ran in it (vLLM 0.33.0's
GLM-5 attention does not call the method our projection changed). This module answers, per patch, how
many of its added Python statements ran:

- :func:`attribution`: the lines of the patched tree each patch added, by ``git blame`` of the series
  replayed one commit per patch onto the release's files (git, not our own diff arithmetic: a later
  patch that moves an earlier patch's lines keeps them attributed);
- :func:`statements`: the lines of a file that start a statement (``ast``), so comments, blank lines
  and docstrings are not counted as "did not run";
- :func:`executed`: the lines a coverage.py data file saw run, per file of the package (any root it
  ran from: an installed tree, ``/tmp/site``, a rebase's release tree);
- :func:`liveness`: the three together, one :class:`Live` per patch.

The attribution is plain data (JSON as ``overlay.engine.liveness_lines`` writes it), so it is computed where
git and the series are and read where the run happened (the GPU device has neither).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.series import Patch
from overlay.git import git, git_text

PACKAGE = "vllm"


def file_problem(path: str) -> str | None:
    """None when ``path`` is a file of the package a lines file may name (``vllm/x/y.py``: relative, every part
    a name, no ``..``); else why not. The file is read from the tree that ran (``tree / path``): a lines file
    naming ``../../etc/shadow`` or ``/etc/shadow`` would have it read and counted into a patch."""
    parts = path.split("/")
    if path.startswith("/") or "\0" in path:
        return "an absolute path" if path.startswith("/") else "a NUL in it"
    if parts[0] != "vllm" or any(p in ("", ".", "..") for p in parts):
        return "not a file of the vllm package (vllm/..., no '.', '..' or empty parts)"
    return None


@dataclass(frozen=True)
class Live:
    """One patch in one run: its added statements, and how many of them ran."""

    patch: str
    added: int
    ran: int
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (added statements, ran)

    @property
    def acted(self) -> bool:
        return self.ran > 0

    def to_dict(self) -> dict[str, object]:
        return {"patch": self.patch, "added": self.added, "ran": self.ran,
                "files": {p: list(v) for p, v in sorted(self.files.items())}}


def attribution(base_tree: Path, patches: Iterable[Patch]) -> dict[str, dict[str, list[int]]]:
    """``{patch: {path: [line, ...]}}``: the lines of ``base_tree`` (a release's text tree) after every
    patch that each one added, ``path`` relative to the tree (``vllm/...``), Python files only."""
    patches = tuple(patches)
    touched = sorted({p for patch in patches for p in patch.touched if p.endswith(".py")})
    lines: dict[str, dict[str, list[int]]] = {p.name: {} for p in patches}
    with scratch("overlay-liveness-") as tmp:
        repo = Path(tmp)
        git(["init", "-q"], repo)
        for path in touched:
            data = _read(base_tree, path)
            if data is not None:
                (repo / path).parent.mkdir(parents=True, exist_ok=True)
                (repo / path).write_bytes(data)
        git(["add", "-A"], repo)
        git(["commit", "-q", "--allow-empty", "-m", "base"], repo)
        names: dict[str, str] = {}
        for patch in patches:
            git(["apply", "--whitespace=nowarn", "--include=*.py", "-"], repo, input=patch.raw)
            git(["add", "-A"], repo)
            git(["commit", "-q", "--allow-empty", "-m", patch.name], repo)
            names[git_text(["rev-parse", "HEAD"], repo).strip()] = patch.name
        for path in touched:
            if not (repo / path).is_file():
                continue
            for line, commit in _blame(repo, path):
                if commit in names:
                    lines[names[commit]].setdefault(path, []).append(line)
    return lines


def _read(tree: Path, path: str) -> bytes | None:
    file = tree / path
    return file.read_bytes() if file.is_file() else None


def _blame(repo: Path, path: str) -> list[tuple[int, str]]:
    """(final line number, commit) of every line of ``path`` at HEAD."""
    out = git_text(["blame", "-M", "--porcelain", "HEAD", "--", path], repo)  # -M: moved lines keep their author
    found = []
    for row in out.splitlines():
        parts = row.split()
        if len(parts) >= 3 and len(parts[0]) == 40 and all(c in "0123456789abcdef" for c in parts[0]):
            found.append((int(parts[2]), parts[0]))
    return found


def statements(source: str) -> set[int]:
    """The lines on which a statement starts (docstrings excepted): what can run."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            found.discard(body[0].lineno)
        if isinstance(node, ast.stmt) and not _is_docstring(node):
            found.add(node.lineno)
    return found


def body_statements(source: str) -> set[int]:
    """:func:`statements` inside a function's body: what runs when the code is called. A module's or a
    class's own statements (a ``def``, an import, a class attribute) run at import, in every run, and
    would make every patch look live."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found = {sub.lineno for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             for child in node.body for sub in ast.walk(child) if isinstance(sub, ast.stmt)}
    return found & statements(source)


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def package_path(path: str) -> str | None:
    """``.../vllm/x/y.py`` -> ``vllm/x/y.py`` (the first ``vllm`` folder of the path), else None."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if part == PACKAGE:
            return "/".join(parts[i:])
    return None


def executed(data_file: Path) -> dict[str, set[int]]:
    """The lines coverage.py's data file (combined, or one of a parallel run) saw run, per package path."""
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    ran: dict[str, set[int]] = {}
    for measured in data.measured_files():
        rel = package_path(measured)
        if rel is not None:
            ran.setdefault(rel, set()).update(data.lines(measured) or ())
    return ran


def liveness(lines: Mapping[str, Mapping[str, list[int]]], tree: Path, ran: Mapping[str, set[int]], *,
             counted: Callable[[str], set[int]] = statements) -> list[Live]:
    """Per patch (in ``lines``' order): its added lines in ``tree`` (the patched tree that ran, holding
    ``vllm/``) that ``counted`` keeps of the file (statements; :func:`body_statements` for a run where
    import-time lines say nothing), and how many of them are in ``ran``."""
    cache: dict[str, set[int]] = {}
    result = []
    for patch, files in lines.items():
        per_file: dict[str, tuple[int, int]] = {}
        for path, numbers in files.items():
            if file_problem(path):  # never read outside the tree (load_lines refuses such a file first)
                raise ValueError(f"{patch}: {path!r}: {file_problem(path)}")
            if path not in cache:
                source = tree / path
                cache[path] = counted(source.read_text(encoding="utf-8")) if source.is_file() else set()
            added = cache[path] & set(numbers)
            if added:
                per_file[path] = (len(added), len(added & ran.get(path, set())))
        result.append(Live(patch, sum(a for a, _ in per_file.values()), sum(r for _, r in per_file.values()),
                           per_file))
    return result


def enclosing(source: str, numbers: Iterable[int]) -> list[str]:
    """The qualified names of the innermost functions (or classes, or ``<module>``) holding ``numbers``:
    what a patch changes, as ``Class.method``."""
    tree = ast.parse(source)
    spans: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                spans.append((child.lineno, child.end_lineno or child.lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    names: list[str] = []
    for n in sorted(set(numbers)):
        inside = [s for s in spans if s[0] <= n <= s[1]]
        name = min(inside, key=lambda s: s[1] - s[0])[2] if inside else "<module>"
        if name not in names:
            names.append(name)
    return names
