"""Every carried release's patches, each judged once on its own release: their tests fail without the patch
(on the release plus the patches before it) and pass with the series.

The tests in ``tests/patches/test_<patch>.py`` (and its parts ``test_<patch>__<part>.py``) of the installed
release's series run in this process against the installed patched wheel (``tests/conftest.py`` collects
no others). Here each file is run again in a subprocess with ``OVERLAY_VLLM_TREE`` set to its release's
prefix tree, the base with every patch before this one (``overlay.maintain.trees.prefix_tree``), as ``make
rebase`` and the patch-tests matrix judge a patch: it must fail there by behaviour, which proves it tests its
own fix, not an earlier patch's (on the bare base a test can fail through an earlier patch's bug alone).

Every other carried release (``patches/<release>/``, found by :func:`overlay.build.pins.carried_releases`,
none named here) runs in an environment of its own: its whole resolved dependency set on its own torch
(``overlay.maintain.rebase.deps.release_deps``); its patch tests run there on its patched tree, where they
must pass, and on each prefix, where they must fail; so do the tools' tests that model vLLM's code
(``RELEASE_BOUND``) and GLM-5's steps (``GLM5_STEPS``) on its patched tree.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from overlay.build.fetch import fetch_wheel
from overlay.build.pins import carried_releases, load_pin
from overlay.build.series import Series
from overlay.maintain import rebase  # not its test_file/test_files by name: pytest would collect them
from overlay.maintain.rebase.testrun import describe, run_files
from overlay.maintain.trees import base_tree, prefix_tree
from tests.releasekit import installed_release

if TYPE_CHECKING:  # not imported by name at run time: pytest would collect a Test* class
    from overlay.maintain.rebase.testrun import TestRun

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
TESTS = REPO / "tests" / "patches"
RELEASES = carried_releases(PATCHES)
SERIES = {r: Series.load(PATCHES / r) for r in RELEASES}
INSTALLED = installed_release()


@functools.cache
def _deps(release: str) -> Path | None:
    """The environment ``release``'s runs get: None (this one) for the installed release, else its own."""
    if release == INSTALLED:
        return None
    from overlay.maintain.rebase.deps import release_deps

    return release_deps(release, fetch_wheel(load_pin(PATCHES, release)))


def _on_patched_tree(release: str, files: list[Path], marks: str = "not gpu") -> TestRun:
    """pytest on ``files`` against ``release`` with its whole series, in that release's environment."""
    tree = prefix_tree(PATCHES, release, SERIES[release].patches)
    return run_files(files, tree, cwd=REPO, timeout=900, deps=_deps(release), marks=marks)


def _files(release: str) -> list[tuple[int, Path]]:
    return [(i, f) for i, p in enumerate(SERIES[release].patches) for f in rebase.test_files(TESTS, p.name)]


def _id(value: object) -> str:
    return value.stem if isinstance(value, Path) else str(value)


@pytest.mark.parametrize(("release", "patch"), [(r, p) for r in RELEASES for p in SERIES[r].patches],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_patch_has_tests(release: str, patch) -> None:
    main = rebase.test_file(TESTS, patch.name)
    assert main.is_file(), f"{release}: {patch.name} has no {main.name}"


def _prefix_cases() -> list[Any]:
    """Each patch test file of each carried release, at its patch's index. The series being worked on (the
    installed release's) is judged in ``make test``; every other carried release's series, which changes
    only by a rebase, with the long tests (``make test-long``: minutes of subprocess runs in its own
    environment on two cores). Their patched-tree runs (:func:`test_patch_tests_pass_on_their_release`)
    stay in ``make test``: a harness change that breaks them shows at once."""
    return [pytest.param(r, i, f, id=f"{r}-{i}-{f.stem}", marks=() if r == INSTALLED else pytest.mark.long)
            for r in RELEASES for i, f in _files(r)]


@pytest.mark.parametrize(("release", "index", "file"), _prefix_cases())
def test_patch_tests_fail_without_the_patch(release: str, index: int, file: Path) -> None:
    """Some test fails on the release plus the patches before this one, and every failure there is about
    the behaviour: a harness error (the test's own setup, helpers or fixtures;
    ``overlay/maintain/rebase/failkind.py``) would prove nothing."""
    series = SERIES[release]
    tree = prefix_tree(PATCHES, release, series.patches[:index])
    run = run_files([file], tree, cwd=REPO, timeout=900, deps=_deps(release))
    before = series.patches[index - 1].name if index else "none"
    assert run.behaviour_failed, (f"expected behaviour failures without {series.patches[index].name} (vLLM "
                                  f"{release} plus the patches up to {before}), got {describe(run)}")
    assert not run.harness_failed, f"harness errors without the patch: {run.first_error()}"


@pytest.mark.parametrize(("release", "file"), [(r, f) for r in RELEASES if r != INSTALLED for _, f in _files(r)],
                         ids=_id)
def test_patch_tests_pass_on_their_release(release: str, file: Path) -> None:
    """A carried release that is not installed here: its patches' tests pass on its patched tree, in its own
    environment (the installed release's pass in this process)."""
    run = _on_patched_tree(release, [file])
    assert run.status == "passed", f"vLLM {release} with its series: {describe(run)}: {run.first_error()}"


# Tests of a tool against vLLM's own code (not of a patch): every carried release's, each in its environment.
RELEASE_BOUND = [REPO / "tests" / "test_workspace_plan.py"]


@pytest.mark.parametrize(("release", "file"), [(r, f) for r in RELEASES if r != INSTALLED for f in RELEASE_BOUND],
                         ids=_id)
def test_tools_agree_with_each_release(release: str, file: Path) -> None:
    """The tools that model vLLM's own code (the workspace planner) agree with every carried release's, on its
    patched tree in its own environment (the installed release's run in this process)."""
    run = _on_patched_tree(release, [file])
    assert run.status == "passed", f"vLLM {release}: {describe(run)}: {run.first_error()}"


# GLM-5's own attention on every step a server hands it (``glm5_path.STEPS``) and the dense-MHA prefill's
# stand-ins it runs on: not a patch's tests but the build as a whole, so each carried release runs them on its
# patched tree (the installed release's run in this process). DCP 1 and 2 cost about 50 s in its environment on
# two cores (``make test``); DCP 4, about a minute more, runs with the long tests.
GLM5_STEPS = [TESTS / "test_glm5_prefill_standins.py", TESTS / "test_glm5_steps.py"]


def _glm5_steps_cases() -> list[Any]:
    return [pytest.param(r, marks, id=f"{r}-{part}", marks=long)
            for r in RELEASES if r != INSTALLED
            for part, marks, long in (("dcp2", "not gpu and not long", ()),
                                      ("dcp4", "long and not gpu", pytest.mark.long))]


@pytest.mark.parametrize(("release", "marks"), _glm5_steps_cases())
def test_glm5_steps_pass_on_each_release(release: str, marks: str) -> None:
    """Every GLM-5 step the release has (the dense-MHA prefill included, with its FlashAttention and merge
    stand-ins where the release has no CPU ones) at DCP 2 (``dcp2``: with DCP 1 against float64 attention) and
    DCP 4 (``dcp4``) equals DCP 1 on every transport and switch value, on the release's patched tree in its own
    environment; the stand-ins hold to their contracts there."""
    run = _on_patched_tree(release, GLM5_STEPS, marks)
    assert run.status == "passed", f"vLLM {release}: {describe(run)}: {run.first_error()}"
    assert run.passed, f"vLLM {release}: no GLM-5 step ran ({describe(run)})"


@pytest.mark.parametrize("release", RELEASES)
def test_the_prefix_tree_holds_the_earlier_patches_only(release: str) -> None:
    """The tree a patch is judged on carries every earlier patch's added lines and none of its own."""
    patches = SERIES[release].patches
    k = next((i for i, p in enumerate(patches) if i > 0 and any(f.endswith(".py") for f in p.touched)), None)
    if k is None:
        pytest.skip(f"vLLM {release}'s series has no second patch of Python files")
    tree = prefix_tree(PATCHES, release, patches[:k])
    for i, patch in enumerate(patches[:k + 1]):
        for f in patch.files:
            if not f.new_path or not f.new_path.endswith(".py") or not f.added:
                continue
            text = (tree / f.new_path).read_text(encoding="utf-8") if (tree / f.new_path).is_file() else ""
            mine = [line for line in f.added if line.strip() and line not in text]
            if i < k:
                assert not mine, f"{patch.name}: lines missing from the prefix tree: {mine[:3]}"
            else:
                assert mine, f"{patch.name}: the prefix tree already holds every line it adds"


def test_base_tree_is_importable_and_unpatched() -> None:
    """The switch itself works: the subprocess really imports the base tree."""
    release = INSTALLED or RELEASES[-1]
    tree = base_tree(PATCHES, release)
    code = "import vllm, json; print(vllm.__file__); print(vllm.__version__)"
    env = dict(os.environ, OVERLAY_VLLM_TREE=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); {code}"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert out[0].startswith(str(tree))
    assert out[1] == release
