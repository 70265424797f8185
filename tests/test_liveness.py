"""overlay.maintain.liveness: which lines each patch added (git blame of the series replayed), which of
them are statements, which ran (coverage data), per patch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from overlay.build.series import Patch
from overlay.maintain.liveness import attribution, enclosing, executed, liveness, package_path, statements
from tests.rebasekit import make_patch

BASE = {
    "vllm/__init__.py": "",
    "vllm/m.py": "def f(x):\n    return x\n\n\ndef g(x):\n    return -x\n",
}
FIRST = {"vllm/m.py": "def f(x):\n    y = x + 1\n    return y\n\n\ndef g(x):\n    return -x\n"}
# the second patch moves f below g: the first patch's line stays the first patch's
SECOND = {"vllm/m.py": ('def g(x):\n    """Negate."""\n    if x:\n        return -x\n    return 0\n\n\n'
                        "def f(x):\n    y = x + 1\n    return y\n")}


def _patches(tmp_path: Path) -> tuple[Patch, Patch]:
    one = make_patch(tmp_path, "one", FIRST, base=BASE)
    two = make_patch(tmp_path, "two", SECOND, base={**BASE, **FIRST})
    (tmp_path / "one.patch").write_bytes(one)
    (tmp_path / "two.patch").write_bytes(two)
    return (Patch.from_bytes("one.patch", one, tmp_path / "one.patch"),
            Patch.from_bytes("two.patch", two, tmp_path / "two.patch"))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_each_patch_is_given_the_lines_it_added_after_the_later_ones(tmp_path: Path) -> None:
    base = _tree(tmp_path / "base", BASE)
    lines = attribution(base, _patches(tmp_path))
    assert lines["one.patch"] == {"vllm/m.py": [9, 10]}  # "y = x + 1", "return y": moved by the second patch
    assert lines["two.patch"] == {"vllm/m.py": [1, 2, 3, 4, 5, 6, 7]}  # g rewritten above f (git blame -M)


def test_statements_leave_out_docstrings_and_blank_lines() -> None:
    assert statements(SECOND["vllm/m.py"]) == {1, 3, 4, 5, 8, 9, 10}


def test_liveness_counts_the_statements_that_ran(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree", {**BASE, **SECOND})
    lines = {"one.patch": {"vllm/m.py": [9]}, "two.patch": {"vllm/m.py": [2, 3, 4, 5, 8]}}
    live = {x.patch: x for x in liveness(lines, tree, {"vllm/m.py": {1, 3, 5, 8, 9, 10}})}
    assert (live["one.patch"].added, live["one.patch"].ran, live["one.patch"].acted) == (1, 1, True)
    assert (live["two.patch"].added, live["two.patch"].ran) == (4, 3)  # the docstring is not counted
    assert liveness(lines, tree, {})[0].acted is False


def test_executed_reads_coverage_data_under_any_root(tmp_path: Path) -> None:
    """A real coverage run of a module under a root named like the device's /tmp/site."""
    tree = _tree(tmp_path / "site", {**BASE, **SECOND})
    data = tmp_path / ".coverage"
    (tmp_path / "run.py").write_text("import vllm.m\nvllm.m.f(1)\nvllm.m.g(0)\n")
    subprocess.run([sys.executable, "-m", "coverage", "run", f"--data-file={data}", str(tmp_path / "run.py")],
                   cwd=tree, check=True, capture_output=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    ran = executed(data)
    assert ran["vllm/m.py"] >= {1, 3, 5, 8, 9, 10} and 4 not in ran["vllm/m.py"]  # g(0) never returns -x


def test_package_path_and_enclosing() -> None:
    assert package_path("/tmp/site/vllm/v1/x.py") == "vllm/v1/x.py"
    assert package_path("/elsewhere/y.py") is None
    source = "class A:\n    def m(self):\n        return 1\n\n\nX = 2\n"
    assert enclosing(source, [3, 6]) == ["A.m", "<module>"]
