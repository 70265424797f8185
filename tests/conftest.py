"""Shared fixtures. ``OVERLAY_VLLM_TREE=<dir>`` makes ``import vllm`` load that tree.

The patch tests use it to run against the unpatched base tree (see
``tests/test_patches_against_base.py``); without it they test the installed patched wheel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from overlay.build.pins import default_version

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
DEFAULT_VLLM = default_version(PATCHES)

_tree = os.environ.get("OVERLAY_VLLM_TREE")
if _tree:
    sys.path.insert(0, _tree)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests of one module that share a module-scoped fixture on one pytest-xdist worker, and
    skip ``gpu`` tests when CUDA is not available.

    ``make test`` runs the suite on several workers (``--dist loadgroup``): a module's fixture, such as
    the patch tests' spawned ranks (tens of seconds each), would otherwise run once on every worker that
    gets one of its tests. Tests without such a fixture are spread test by test.
    """
    _group_by_module_fixture(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either way
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_by_module_fixture(items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope == "module" for chain in defs for d in chain):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.fixture(autouse=True)
def _fresh_test_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every patch-test run a test starts really runs: none is read from the user's cache of runs
    (``overlay/maintain/rebase/runcache.py``; its own tests give it a folder of their own)."""
    monkeypatch.setenv("OVERLAY_TESTRUN_CACHE", "0")


@pytest.fixture(scope="session")
def base_wheel() -> Path:
    """The real, verified vLLM base wheel (downloaded once into the cache)."""
    from overlay.build.fetch import fetch_wheel
    from overlay.build.pins import load_pin

    return fetch_wheel(load_pin(PATCHES, DEFAULT_VLLM))


@pytest.fixture
def one_patch_release(tmp_path: Path) -> tuple[Path, Path]:
    """A synthetic release (patches root, base wheel) whose series holds one good patch."""
    from tests.wheelkit import BASE_FILES, good_patch, make_release, make_wheel

    d = tmp_path / "base"
    d.mkdir()
    wheel = make_wheel(d, BASE_FILES)
    return make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)}), wheel
