"""A patch's test runs kept by what they ran on, so that the same tests on the same tree in the
same environment are not run twice.

``make rebase`` runs each patch's tests on the old base (the default release plus the earlier
patches) before it looks at the target: that tree is the same whatever the target, so rebasing
onto 0.30.0, 0.31.0 and 0.32.0 ran those eight runs three times, and ``make patch-tests-matrix``
runs the release's own tree again for every patch that follows. A run is keyed by the digest of

- the tree (every file's path and bytes, ``__pycache__`` left out),
- the test folder (every file: the patch's tests and the shared harness modules beside them)
  and the ``conftest.py`` files above it up to the working folder,
- the tool's own test-running code (this package's ``testrun``, ``failkind`` and ``deps``),
- the patch's name, and what the run imports beside the tree: the release's whole dependency set
  (:func:`overlay.maintain.rebase.deps.environment_of`: its folder's resolved versions, this torch,
  Python), or, for a run in this environment, Python's version and every distribution installed here.

Only runs that judged the code are kept: ``passed``, ``failed`` (by behaviour) and ``skipped``,
and none with a harness error in it. A harness error or a run that did not finish may be the
machine's (a rank killed at its timeout under load) and is run again next time: kept, one such
test among 27 behaviour failures made a later ``make patch-tests-matrix`` cell red without running.
``OVERLAY_TESTRUN_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import distributions
from pathlib import Path

from overlay import digest, jsonfile
from overlay.build.series import Patch
from overlay.errors import OverlayError
from overlay.maintain.rebase.testrun import TestRun, TestRunner

KEPT = frozenset({"passed", "failed", "skipped"})
_SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache"})
_TOOL = ("testrun.py", "failkind.py", "deps.py")


def enabled() -> bool:
    """Whether runs are kept (``OVERLAY_TESTRUN_CACHE`` is not ``0``)."""
    return os.environ.get("OVERLAY_TESTRUN_CACHE", "1") != "0"


def folder_digest(root: Path) -> str:
    """Digest of every file under ``root`` (relative path and bytes), caches left out."""
    lines: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            lines.append(f"{path.relative_to(root).as_posix()} {digest.of_file(path)}")
    return digest.of_text("\n".join(lines))


def environment() -> str:
    """Python's version and every installed distribution, as one digest."""
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions())
    return digest.of_text("\n".join([sys.version, *dists]))


def _conftests(tests_dir: Path, cwd: Path) -> list[str]:
    """Digests of the ``conftest.py`` files from ``tests_dir``'s parent up to ``cwd``."""
    out: list[str] = []
    here, top = tests_dir.resolve().parent, cwd.resolve()
    while True:
        conftest = here / "conftest.py"
        if conftest.is_file():  # where it sits, not where the checkout is: two clones share runs
            out.append(f"{conftest.relative_to(top) if top in conftest.parents else conftest.name} "
                       f"{digest.of_file(conftest)}")
        if here == top or here.parent == here or top not in here.parents:
            return out
        here = here.parent


def cached(runner: TestRunner, tests_dir: Path, *, cwd: Path, cache: Path) -> TestRunner:
    """``runner`` with its judging runs kept under ``cache`` (a folder of ``<key>.json``)."""
    tool = Path(__file__).resolve().parent
    fixed = [folder_digest(tests_dir), *_conftests(tests_dir, cwd),
             *(digest.of_file(tool / name) for name in _TOOL)]
    here: list[str] = []  # this environment's digest, made when a run has no release environment of its own
    env_of = getattr(runner, "environment", None)

    def run_environment(tree: Path) -> str:
        found = env_of(tree) if env_of is not None else None
        if found is None:
            if not here:
                here.append(environment())
            found = here[0]
        return found

    def run(patch: Patch, tree: Path) -> TestRun | None:
        key = digest.of_text("\n".join([patch.name, folder_digest(tree), *fixed, run_environment(tree)]))
        path = cache / f"{key}.json"
        try:
            kept = TestRun.from_dict(jsonfile.read(path, OverlayError, "a kept test run")) if path.exists() else None
        except (OverlayError, ValueError, KeyError, TypeError):
            kept = None
        if kept is not None:
            print(f"  {patch.name}: its tests on this tree ran before, with these tests and packages: "
                  f"{kept.status} ({path.name[:12]})", file=sys.stderr, flush=True)
            return kept
        result = runner(patch, tree)
        if result is not None and result.status in KEPT and not result.harness_failed:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(result.to_dict(), indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        return result

    return run


def maybe_cached(runner: TestRunner, tests_dir: Path, *, cwd: Path) -> TestRunner:
    """:func:`cached` under ``<cache>/testruns/`` unless ``OVERLAY_TESTRUN_CACHE=0``."""
    if not enabled():
        return runner
    from overlay.build.fetch import cache_dir

    return cached(runner, tests_dir, cwd=cwd, cache=cache_dir() / "testruns")
