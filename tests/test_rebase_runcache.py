"""A patch's test runs are kept by what they ran on (``overlay/maintain/rebase/runcache.py``): the same
tests on the same tree in the same environment run once; any change to the tree, the tests or the
harness beside them runs them again, and a run that did not judge the code is never kept."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from overlay.maintain.rebase import runcache
from overlay.maintain.rebase.testrun import TestRun

PATCH = SimpleNamespace(name="fix-a.patch")


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "a.py").write_text("X = 1\n")
    tests = tmp_path / "repo" / "tests" / "patches"
    tests.mkdir(parents=True)
    (tests / "test_fix_a.py").write_text("def test_x():\n    pass\n")
    (tests / "harness.py").write_text("H = 1\n")
    return tree, tests, tmp_path / "cache"


def _counting(status: str = "passed") -> tuple[list[Path], object]:
    calls: list[Path] = []

    def run(patch, tree: Path) -> TestRun:
        calls.append(tree)
        return TestRun(status, passed=("test_x",), summary=f"1 {status}")

    return calls, run


def test_the_same_run_is_read_back(layout) -> None:
    tree, tests, cache = layout
    calls, inner = _counting()
    runner = runcache.cached(inner, tests, cwd=tests.parent.parent, cache=cache)
    first = runner(PATCH, tree)
    (tree / "vllm" / "__pycache__").mkdir()
    (tree / "vllm" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")  # caches are not content
    second = runner(PATCH, tree)
    assert len(calls) == 1 and first == second
    again = runcache.cached(inner, tests, cwd=tests.parent.parent, cache=cache)(PATCH, tree)  # a new rebase
    assert len(calls) == 1 and again == first


@pytest.mark.parametrize("change", ["tree", "test", "harness", "conftest", "patch"])
def test_any_change_runs_again(layout, change: str) -> None:
    tree, tests, cache = layout
    calls, inner = _counting()
    cwd = tests.parent.parent
    runcache.cached(inner, tests, cwd=cwd, cache=cache)(PATCH, tree)
    patch = PATCH
    if change == "tree":
        (tree / "vllm" / "a.py").write_text("X = 2\n")
    elif change == "test":
        (tests / "test_fix_a.py").write_text("def test_x():\n    assert True\n")
    elif change == "harness":
        (tests / "harness.py").write_text("H = 2\n")
    elif change == "conftest":
        (cwd / "tests" / "conftest.py").write_text("# a fixture changed\n")
    else:
        patch = SimpleNamespace(name="fix-b.patch")
    runcache.cached(inner, tests, cwd=cwd, cache=cache)(patch, tree)
    assert len(calls) == 2


@pytest.mark.parametrize("status", ["harness", "error"])
def test_a_run_that_did_not_judge_the_code_is_not_kept(layout, status: str) -> None:
    tree, tests, cache = layout
    calls, inner = _counting(status)
    runner = runcache.cached(inner, tests, cwd=tests.parent.parent, cache=cache)
    runner(PATCH, tree)
    runner(PATCH, tree)
    assert len(calls) == 2 and not list(cache.glob("*.json"))


def test_a_damaged_entry_runs_again(layout) -> None:
    tree, tests, cache = layout
    calls, inner = _counting()
    runner = runcache.cached(inner, tests, cwd=tests.parent.parent, cache=cache)
    runner(PATCH, tree)
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    assert runner(PATCH, tree).status == "passed" and len(calls) == 2


def test_off_by_environment(layout, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, tests, cache = layout
    calls, inner = _counting()
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    monkeypatch.setenv("OVERLAY_TESTRUN_CACHE", "0")
    assert runcache.maybe_cached(inner, tests, cwd=tests.parent.parent) is inner
    monkeypatch.setenv("OVERLAY_TESTRUN_CACHE", "1")
    runner = runcache.maybe_cached(inner, tests, cwd=tests.parent.parent)
    runner(PATCH, tree)
    runner(PATCH, tree)
    assert len(calls) == 1 and list((cache / "testruns").glob("*.json"))


def test_two_checkouts_of_the_same_commit_share_runs(tmp_path: Path) -> None:
    """The key is what the files say, not where the checkout is: a second clone (a worktree, CI's
    checkout) reads the runs the first one kept."""
    calls, inner = _counting()
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "a.py").write_text("X = 1\n")
    for clone in ("one", "two"):
        tests = tmp_path / clone / "tests" / "patches"
        tests.mkdir(parents=True)
        (tests / "test_fix_a.py").write_text("def test_x():\n    pass\n")
        (tests.parent / "conftest.py").write_text("# shared fixtures\n")
        runcache.cached(inner, tests, cwd=tmp_path / clone, cache=tmp_path / "cache")(PATCH, tree)
    assert len(calls) == 1


def test_a_run_with_one_harness_error_among_behaviour_failures_is_not_kept(layout) -> None:
    """27 behaviour failures and one rank killed at its timeout: the run judged most of the code, but
    the killed test is the machine's; kept, it would come back red without running again."""
    tree, tests, cache = layout
    calls: list[Path] = []

    def inner(patch, tree: Path) -> TestRun:
        calls.append(tree)
        return TestRun("failed", failed=("test_a", "test_b"), kinds=("behaviour", "harness"),
                       reasons=("AttributeError: W_UV_dcp", "compat.HarnessError: rank 0 did not finish"))

    runner = runcache.cached(inner, tests, cwd=tests.parent.parent, cache=cache)
    runner(PATCH, tree)
    runner(PATCH, tree)
    assert len(calls) == 2
