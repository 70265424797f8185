"""A release's test runs get the dependencies it pins beyond this environment
(``overlay/maintain/rebase/deps.py``), found by the release its tree names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from overlay.errors import OverlayError
from overlay.maintain.rebase.deps import deps_for, release_deps, tree_version, unmet
from overlay.maintain.rebase.testrun import pytest_runner, run_files
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
        mp.setattr("overlay.maintain.rebase.deps.release_deps", lambda release, wheel: deps)
        run = runner(SimpleNamespace(name="p.patch"), tree)
    assert run is not None and run.status == "passed"


def _dist(dest: Path, name: str, ver: str, *requires: str) -> None:
    info = dest / f"{name.replace('-', '_')}-{ver}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {ver}",
             *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_what_the_installed_packages_require_is_installed_too(tmp_path: Path) -> None:
    """0.31.0 pins transformers<5.18, whose 5.17 requires huggingface-hub<2 where the environment has
    2.4: installing only the release's own pins left transformers refusing to import."""
    calls: list[list[str]] = []

    def install(reqs: list[str], dest: Path) -> None:
        calls.append(reqs)
        if reqs == ["no-such-package-overlay-test==2.0"]:
            _dist(dest, "no-such-package-overlay-test", "2.0", "packaging<0.1", "pytest>=1",
                  "torch==99.0", "winonly-overlay-test; sys_platform == 'win32'",
                  "extra-only-overlay-test; extra == 'dev'", "no-such-package-overlay-test>=1")
        else:
            _dist(dest, "packaging", "0.0.9", "other-overlay-test==1.0")
            _dist(dest, "other-overlay-test", "1.0")

    wheel = _wheel(tmp_path, "no-such-package-overlay-test==2.0")
    dest = release_deps("9.9.0", wheel, cache=tmp_path / "cache", installer=install)
    assert calls == [["no-such-package-overlay-test==2.0"], ["packaging<0.1"]]
    assert dest is not None
    assert (dest / ".complete").read_text().split() == ["no-such-package-overlay-test==2.0", "packaging<0.1"]


def test_a_closure_that_keeps_growing_is_refused(tmp_path: Path) -> None:
    def install(reqs: list[str], dest: Path) -> None:
        n = len(list(dest.glob("*.dist-info")))
        _dist(dest, f"chain{n}-overlay-test", "1.0", f"chain{n + 1}-overlay-test==1.0")

    wheel = _wheel(tmp_path, "chain0-overlay-test==1.0")
    with pytest.raises(OverlayError, match="still grow after 8 rounds"):
        release_deps("9.9.0", wheel, cache=tmp_path / "cache", installer=install)
    assert not any((tmp_path / "cache" / "deps").iterdir())  # nothing half-made is left to be reused
