"""Every patch's tests fail on the unpatched base (and pass on the patched tree).

The tests in ``tests/patches/test_<patch>.py`` (and its parts ``test_<patch>__<part>.py``) run
in this process against the installed patched wheel. Here each file is run again in a
subprocess with ``OVERLAY_VLLM_TREE`` set to the unpatched base tree, as ``make rebase`` runs it:
it must fail there by behaviour, which proves it tests the fix.
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
from overlay.maintain.trees import base_tree

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "patches"
VERSION = "0.28.0"
SERIES = Series.load(REPO / "patches" / VERSION)


@pytest.mark.parametrize("patch", SERIES.patches, ids=lambda p: p.name)
def test_patch_has_tests(patch) -> None:
    main = rebase.test_file(TESTS, patch.name)
    assert main.is_file(), f"{patch.name} has no {main.name}"


@pytest.mark.parametrize("file", [f for p in SERIES.patches for f in rebase.test_files(TESTS, p.name)],
                         ids=lambda f: f.stem)
def test_patch_tests_fail_on_base(file: Path) -> None:
    """Some test fails on the base, and every failure there is about the behaviour: a harness error
    (the test's own setup, helpers or fixtures; ``overlay/maintain/rebase/failkind.py``) would prove nothing."""
    run = run_files([file], base_tree(REPO / "patches", VERSION), cwd=REPO, timeout=900)
    assert run.behaviour_failed, f"expected behaviour failures on the unpatched base, got {describe(run)}"
    assert not run.harness_failed, f"harness errors on the base: {run.first_error()}"


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
