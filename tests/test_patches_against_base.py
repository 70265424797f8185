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

from overlay.series import Series
from overlay.trees import base_tree

REPO = Path(__file__).resolve().parent.parent
VERSION = "0.28.0"
SERIES = Series.load(REPO / "patches" / VERSION)


def _test_file(patch_name: str) -> Path:
    return REPO / "tests" / "patches" / f"test_{patch_name.removesuffix('.patch').replace('-', '_')}.py"


def _test_files(patch_name: str) -> list[Path]:
    """``test_<patch>.py`` and its parts ``test_<patch>__<part>.py``: every one must fail on base."""
    main = _test_file(patch_name)
    return [main, *sorted(main.parent.glob(f"{main.stem}__*.py"))]


def _run(test_file: Path, tree: Path | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("OVERLAY_VLLM_TREE", None)
    if tree is not None:
        env["OVERLAY_VLLM_TREE"] = str(tree)
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-m", "not gpu", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "--timeout=600"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )


@pytest.mark.parametrize("patch", SERIES.patches, ids=lambda p: p.name)
def test_patch_has_tests(patch) -> None:
    assert _test_file(patch.name).is_file(), f"{patch.name} has no {_test_file(patch.name).name}"


@pytest.mark.parametrize("test_file", [f for p in SERIES.patches for f in _test_files(p.name)],
                         ids=lambda f: f.stem)
def test_patch_tests_fail_on_base(test_file: Path) -> None:
    tree = base_tree(REPO / "patches", VERSION)
    proc = _run(test_file, tree)
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
