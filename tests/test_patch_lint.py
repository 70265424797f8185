"""patch-lint: only the lines the series adds are judged, each finding named by the patch that wrote it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from overlay.build.pins import Pin
from overlay.build.series import Series
from overlay.git import git, init_repo
from overlay.maintain.patch_lint import PatchLintError, _commit_series, format_regions, lint_tree, ruff_version
from overlay.maintain.workspace import format_patch

VLLM_PRECOMMIT = """\
default_install_hook_types:
  - pre-commit
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
  - id: ruff-format
- repo: https://github.com/crate-ci/typos
  rev: v1.43.5
"""

PYPROJECT = """\
[tool.ruff.lint]
select = ["E", "F", "I"]
"""

BASE = {
    "vllm/__init__.py": "",
    # the release's own problem (an unused import): never held against a patch
    "vllm/a.py": "import os\n\n\ndef f(x):\n    return x + 1\n",
}


def _ruff() -> Path:
    exe = Path(sys.executable).parent / "ruff"
    return exe if exe.is_file() else Path(shutil.which("ruff") or "ruff")


def test_ruff_version_is_the_pre_commit_pin() -> None:
    assert ruff_version(VLLM_PRECOMMIT, "x/.pre-commit-config.yaml") == "0.14.0"
    with pytest.raises(PatchLintError, match=r"^x: no astral-sh/ruff-pre-commit hook"):
        ruff_version("repos:\n- repo: https://github.com/crate-ci/typos\n  rev: v1\n", "x")
    with pytest.raises(PatchLintError, match=r"rev 'main' is not a release version"):
        ruff_version("repos:\n- repo: https://github.com/astral-sh/ruff-pre-commit\n  rev: main\n", "x")


FROZEN_PRECOMMIT = """\
# Revs are frozen to commit SHAs, bump them with `pre-commit autoupdate --freeze [--repo <url>]`
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2
  hooks:
  - id: ruff-check
- repo: https://github.com/crate-ci/typos
  rev: 9023c1f779400877cafdd98052113fc777e2cfdc  # frozen: v1.51.1
"""


def test_ruff_version_of_a_frozen_rev_is_its_comment() -> None:
    """vLLM 0.34.0 freezes its hooks to commits (``pre-commit autoupdate --freeze``): the version is the
    ``# frozen:`` comment of the ruff hook's own rev line, not another hook's."""
    assert ruff_version(FROZEN_PRECOMMIT, "x") == "0.17.2"
    bare = FROZEN_PRECOMMIT.replace("  # frozen: v0.17.2", "")
    with pytest.raises(PatchLintError, match=r"rev 'f368fb36.*' is not a release version \(a commit without"):
        ruff_version(bare, "x")
    odd = FROZEN_PRECOMMIT.replace("frozen: v0.17.2", "frozen: main")
    with pytest.raises(PatchLintError, match=r"rev f368fb366ff7 is frozen at 'main', not a release version"):
        ruff_version(odd, "x")


def test_format_regions_are_original_line_numbers() -> None:
    diff = """\
--- vllm/a.py
+++ vllm/a.py
@@ -3,7 +3,9 @@
 ctx
 ctx
-x = f(a,b)
+x = f(a, b)
 ctx
@@ -20,3 +22,4 @@
 ctx
+
 ctx
"""
    assert format_regions(diff) == {"vllm/a.py": [(5, 5), (20, 20)]}


def _patch(tmp: Path, name: str, files: dict[str, str], before: dict[str, str]) -> bytes:
    repo = tmp / f"author-{name}"
    init_repo(repo)
    for rel, text in before.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(["add", "-A"], repo)
    git(["commit", "-q", "-m", "base"], repo)
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(["add", "-A"], repo)
    git(["commit", "-q", "-m", f"Fix {name}\n\nWhy.\n\nOrigin: vendor\nLast-Update: 2026-12-01\n"], repo)
    return format_patch(repo, "HEAD")


def _lint_repo(tmp_path: Path, patches: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    """The series ``patches`` committed over ``BASE`` in a lint repo with the release's pyproject.toml."""
    d = tmp_path / "patches" / "0.1.0"
    d.mkdir(parents=True)
    (d / "pin.toml").write_text(Pin("0.1.0", "vllm-0.1.0-cp38-abi3-manylinux_2_28_x86_64.whl", "ab" * 32).to_toml())
    (d / "series").write_text("".join(f"{n}\n" for n in patches))
    for n, raw in patches.items():
        (d / n).write_bytes(raw)
    base = tmp_path / "base"
    for rel, text in BASE.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    repo = tmp_path / "lint"
    repo.mkdir()
    owners = _commit_series(repo, Series.load(d), base)
    (repo / "pyproject.toml").write_text(PYPROJECT)
    return repo, owners


def test_only_the_patches_lines_are_judged_and_named(tmp_path: Path) -> None:
    clean = {"vllm/a.py": BASE["vllm/a.py"] + "\n\ndef g(y):\n    return y * 2\n"}
    long_line = "    return " + " + ".join(["y"] * 40) + "\n"
    sloppy = {"vllm/a.py": clean["vllm/a.py"] + "\n\ndef h(y):\n" + long_line,
              "vllm/b.py": "x = [1,2,\n  3]\n"}
    patches = {"clean.patch": _patch(tmp_path, "clean", clean, BASE),
               "sloppy.patch": _patch(tmp_path, "sloppy", sloppy, {**BASE, **clean})}
    repo, owners = _lint_repo(tmp_path, patches)
    found = lint_tree(repo, owners, ["vllm/a.py", "vllm/b.py"], _ruff())
    assert [str(f) for f in found] == [
        "sloppy.patch: vllm/a.py:13: E501 Line too long (168 > 88)",
        "sloppy.patch: vllm/a.py:13: format ruff format would rewrite line 13",
        "sloppy.patch: vllm/b.py:1: format ruff format would rewrite lines 1-2",
    ]
    assert not any(f.code == "F401" for f in found)  # the base's unused import is the release's own


def test_a_syntax_error_names_the_patch_file_and_line(tmp_path: Path) -> None:
    """Issue 25 item 12: a patch line ``... bool = = False`` gave only "error: ruff format: 7 files already
    formatted"; now the patch, the file, the line and the syntax error are named."""
    broken = {"vllm/a.py": BASE["vllm/a.py"] + "\n\ndef g(y: bool = = False):\n    return y\n"}
    patches = {"broken.patch": _patch(tmp_path, "broken", broken, BASE)}
    repo, owners = _lint_repo(tmp_path, patches)
    line = broken["vllm/a.py"].splitlines().index("def g(y: bool = = False):") + 1
    found = [str(f) for f in lint_tree(repo, owners, ["vllm/a.py"], _ruff()) if f.code == "syntax-error"]
    assert found == [f"broken.patch: vllm/a.py:{line}: syntax-error Expected an expression (column 17)"]
