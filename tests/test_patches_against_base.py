"""Every patch's tests fail on the unpatched base (and pass on the patched tree).

The tests in ``tests/patches/test_<patch>.py`` (and its parts ``test_<patch>__<part>.py``) run
in this process against the installed patched wheel. Here each file is run again in a
subprocess with ``OVERLAY_VLLM_TREE`` set to the unpatched base tree: it must fail there,
which proves it tests the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay import rebase  # not its test_file/test_files by name: pytest would collect them
from overlay.series import Series
from overlay.trees import base_tree

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "patches"
VERSION = "0.28.0"
SERIES = Series.load(REPO / "patches" / VERSION)


def _run(file: Path, tree: Path | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("OVERLAY_VLLM_TREE", None)
    if tree is not None:
        env["OVERLAY_VLLM_TREE"] = str(tree)
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(file), "-m", "not gpu", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "--timeout=600"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )


@pytest.mark.parametrize("patch", SERIES.patches, ids=lambda p: p.name)
def test_patch_has_tests(patch) -> None:
    main = rebase.test_file(TESTS, patch.name)
    assert main.is_file(), f"{patch.name} has no {main.name}"


@pytest.mark.parametrize("file", [f for p in SERIES.patches for f in rebase.test_files(TESTS, p.name)],
                         ids=lambda f: f.stem)
def test_patch_tests_fail_on_base(file: Path) -> None:
    tree = base_tree(REPO / "patches", VERSION)
    proc = _run(file, tree)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    # Exit code 1 = tests ran and some failed; 2/3/4/5 would mean the file did not even run.
    assert proc.returncode == 1, f"expected failures on the unpatched base, got rc={proc.returncode}:\n{tail}"
    assert " failed" in proc.stdout, tail


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
