"""A release's test runs get the dependencies it pins beyond this environment
(``overlay/rebase/deps.py``), found by the release its tree names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from overlay.rebase.deps import deps_for, release_deps, tree_version, unmet
from overlay.rebase.testrun import pytest_runner, run_files
from tests.wheelkit import make_wheel

VERSION_PY = "__version__ = version = '9.9.0'\n__version_tuple__ = version_tuple = (9, 9, 0)\n"


def _wheel(tmp_path: Path, *requires: str) -> Path:
    (tmp_path / "w").mkdir(parents=True, exist_ok=True)
    return make_wheel(tmp_path / "w", {"vllm/__init__.py": b""}, "9.9.0", requires=requires)


def test_the_tree_names_its_release(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    assert tree_version(tmp_path) is None
    (tmp_path / "vllm" / "_version.py").write_text("# generated\n" + VERSION_PY)
    assert tree_version(tmp_path) == "9.9.0"


def test_unmet_leaves_the_torch_family_and_other_machines_out(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "packaging>=1", "pytest==0.0.1", "torch==99.0", "torchvision==0.1",
                   "no-such-package-overlay-test[cu13]>=1", "pywin32==1; sys_platform == 'win32'")
    assert unmet(wheel) == ["no-such-package-overlay-test>=1", "pytest==0.0.1"]


def test_release_deps_installs_once_and_only_when_needed(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def install(reqs: list[str], dest: Path) -> None:
        calls.append(reqs)
        (dest / "dep_only_here.py").write_text("VALUE = 7\n")

    wheel = _wheel(tmp_path, "no-such-package-overlay-test==2.0")
    first = release_deps("9.9.0", wheel, cache=tmp_path / "cache", installer=install)
    again = release_deps("9.9.0", wheel, cache=tmp_path / "cache", installer=install)
    assert first == again and first is not None and first.name.startswith("9.9.0-")
    assert calls == [["no-such-package-overlay-test==2.0"]] and (first / "dep_only_here.py").is_file()
    satisfied = _wheel(tmp_path / "s", "packaging>=1")
    assert release_deps("9.9.0", satisfied, cache=tmp_path / "cache", installer=install) is None


def test_a_tree_runs_with_the_deps_of_its_release(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "_version.py").write_text(VERSION_PY)
    (tree / "vllm" / "kernels.py").write_text("import dep_only_here\n\n\ndef value():\n"
                                              "    return dep_only_here.VALUE\n")
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "dep_only_here.py").write_text("VALUE = 7\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_p.py").write_text("import vllm.kernels\n\n\ndef test_value():\n"
                                     "    assert vllm.kernels.value() == 7\n")
    without = run_files([tests / "test_p.py"], tree, cwd=tests)
    assert without.status == "harness"  # the release's dependency is missing here: not the behaviour
    assert "No module named 'dep_only_here'" in without.first_error()
    runner = pytest_runner(tests, deps=deps_for({"9.9.0": Path("unused.whl")}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("overlay.rebase.deps.release_deps", lambda release, wheel: deps)
        run = runner(SimpleNamespace(name="p.patch"), tree)
    assert run is not None and run.status == "passed"
