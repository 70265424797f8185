"""Every patch's tests fail without it: on the release plus the patches before it (and pass on the patched tree).

The tests in ``tests/patches/test_<patch>.py`` (and its parts ``test_<patch>__<part>.py``) run
in this process against the installed patched wheel. Here each file is run again in a
subprocess with ``OVERLAY_VLLM_TREE`` set to the series' prefix tree, the base with every patch
before this one (``overlay.maintain.trees.prefix_tree``), as ``make rebase`` and the patch-tests
matrix judge a patch: it must fail there by behaviour, which proves it tests its own fix, not an
earlier patch's (on the bare base a test can fail through an earlier patch's bug alone).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.series import Series
from overlay.maintain import rebase  # not its test_file/test_files by name: pytest would collect them
from overlay.maintain.rebase.testrun import describe, run_files
from overlay.maintain.trees import base_tree, prefix_tree

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "patches"
VERSION = "0.28.0"
SERIES = Series.load(REPO / "patches" / VERSION)


@pytest.mark.parametrize("patch", SERIES.patches, ids=lambda p: p.name)
def test_patch_has_tests(patch) -> None:
    main = rebase.test_file(TESTS, patch.name)
    assert main.is_file(), f"{patch.name} has no {main.name}"


@pytest.mark.parametrize(("index", "file"), [(i, f) for i, p in enumerate(SERIES.patches)
                                             for f in rebase.test_files(TESTS, p.name)],
                         ids=lambda v: v.stem if isinstance(v, Path) else str(v))
def test_patch_tests_fail_without_the_patch(index: int, file: Path) -> None:
    """Some test fails on the release plus the patches before this one, and every failure there is about
    the behaviour: a harness error (the test's own setup, helpers or fixtures;
    ``overlay/maintain/rebase/failkind.py``) would prove nothing."""
    tree = prefix_tree(REPO / "patches", VERSION, SERIES.patches[:index])
    run = run_files([file], tree, cwd=REPO, timeout=900)
    before = SERIES.patches[index - 1].name if index else "none"
    assert run.behaviour_failed, (f"expected behaviour failures without {SERIES.patches[index].name} (the release "
                                  f"plus the patches up to {before}), got {describe(run)}")
    assert not run.harness_failed, f"harness errors without the patch: {run.first_error()}"


def test_the_prefix_tree_holds_the_earlier_patches_only() -> None:
    """The tree a patch is judged on carries every earlier patch's added lines and none of its own."""
    patches = SERIES.patches
    k = next(i for i, p in enumerate(patches) if i > 0 and any(f.endswith(".py") for f in p.touched))
    tree = prefix_tree(REPO / "patches", VERSION, patches[:k])
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
    tree = base_tree(REPO / "patches", VERSION)
    code = "import vllm, json; print(vllm.__file__); print(vllm.__version__)"
    env = dict(os.environ, OVERLAY_VLLM_TREE=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); {code}"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert out[0].startswith(str(tree))
    assert out[1] == VERSION
