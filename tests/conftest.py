"""Shared fixtures. ``OVERLAY_VLLM_TREE=<dir>`` makes ``import vllm`` load that tree.

The patch tests use it to run against the unpatched base tree (see
``tests/test_patches_against_base.py``); without it they test the installed patched wheel, and only the
tests of the patches in that wheel's series run here: every other carried release's patches are judged
once, on their own release, by ``tests/test_patches_against_base.py``.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from overlay.build.pins import default_version
from tests.releasekit import installed_release

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
DEFAULT_VLLM = default_version(PATCHES)

_tree = os.environ.get("OVERLAY_VLLM_TREE")
if _tree:
    sys.path.insert(0, _tree)


@functools.cache
def _owners() -> dict[str, tuple[str, ...]]:
    """Patch test stem (``flashmla_sparse_dcp``) -> the carried releases whose series hold that patch."""
    from overlay.build.pins import carried_releases
    from overlay.build.series import Series

    owners: dict[str, tuple[str, ...]] = {}
    for r in carried_releases(PATCHES):
        for p in Series.load(PATCHES / r).patches:
            stem = p.name.removesuffix(".patch").replace("-", "_")
            owners[stem] = (*owners.get(stem, ()), r)
    return owners


def _patch_test_owner(path: Path, release: str) -> str | None:
    """For a patch test file (``tests/patches/test_<patch>[__part].py``) of a patch some carried release has
    and ``release``'s series lacks: that release. None for every other file."""
    if path.parent != REPO / "tests" / "patches" or not path.name.startswith("test_"):
        return None
    found = _owners().get(path.stem.removeprefix("test_").split("__", 1)[0])
    if not found or release in found:
        return None
    return found[-1]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The tests of patches the installed release's series lacks are not collected here (not even imported:
    they are written for their own release's modules); ``tests/test_patches_against_base.py`` runs them
    there. A run on a given tree (``OVERLAY_VLLM_TREE``) collects what it is given."""
    release = installed_release()
    if release is None or _tree or collection_path.suffix != ".py":
        return None
    return True if _patch_test_owner(collection_path, release) is not None else None


def pytest_report_header(config: pytest.Config) -> str | None:
    release = installed_release()
    if release is None or _tree:
        return None
    others = sorted(p.name for p in (REPO / "tests" / "patches").glob("test_*.py")
                    if _patch_test_owner(p, release) is not None)
    return (f"vLLM {release} installed: {len(others)} patch test file(s) of other carried releases run on their "
            "own release in tests/test_patches_against_base.py") if others else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests when CUDA is not available."""
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


_MODULE_FIXTURE = re.compile(r"""@pytest\.fixture\(\s*scope\s*=\s*["']module["']""")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist (the device's pytest) it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``make test``): the tests of a module that defines a module-scoped fixture go
    to one worker together, every other test is spread on its own.

    A module's fixture, such as the patch tests' spawned ranks (tens of seconds each), would otherwise
    run once on every worker that gets one of its tests. pytest-xdist 3.8's own loadgroup groups by
    ``xdist_group`` marks written into ``item._nodeid``, which pytest 9 no longer reads (the node id is
    ``item._id``): it silently spread every group. The controller sees node ids only, so the module's
    source says whether it has such a fixture. Returns None (xdist's own scheduler) for other modes.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(str(config.rootpath))
    grouped: dict[str, bool] = {}  # module -> whether it defines a module-scoped fixture

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in grouped:
                path = root / module
                grouped[module] = path.is_file() and bool(_MODULE_FIXTURE.search(path.read_text()))
            return module if grouped[module] else nodeid

    return ModuleFixtureScheduling(config, log)


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
