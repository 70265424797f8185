"""Running a patch's own tests on a tree: pytest with a JUnit report, and what each test did
(passed, failed with the first error line, skipped), each failure told as the harness's or the
behaviour's (:mod:`overlay.maintain.rebase.failkind`, loaded into the run)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.fetch import recorded_path
from overlay.build.series import Patch
from overlay.interrupt import bound_to_parent

STATUSES = {
    "passed": "passed",  # rc 0, at least one test passed, none failed
    "failed": "fail",  # some test failed by behaviour: an assertion about what the code did
    "harness": "cannot run",  # every failure is a harness error (setup, helpers, fixtures, imports)
    "skipped": "cannot run",  # nothing ran: every test skipped or deselected
    "error": "cannot run",  # pytest itself did not finish (timeout, internal or usage error)
}


@dataclass(frozen=True)
class TestRun:
    """One run of a patch's own tests against one tree."""

    __test__ = False  # not a pytest test class, whatever its name

    status: str  # a key of STATUSES
    passed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    summary: str = ""
    reasons: tuple[str, ...] = ()  # per failed test, the first line of its failure message
    kinds: tuple[str, ...] = ()  # per failed test, "harness", "behaviour" or "off-path" (failkind)
    where: tuple[str, ...] = ()  # per failed test, file:line of the innermost test-code frame, or ""
    skipped: tuple[str, ...] = ()  # tests skipped, with the first reason in skip_reason
    skip_reason: str = ""
    retried: tuple[str, ...] = ()  # ranks killed at their timeout and started again (tests/patches/ranks.py)
    environment: str = ""  # the release's dependency folder the run had (``<cache>/deps/...``), or "" for this one

    def to_dict(self) -> dict[str, object]:
        return {"status": self.status, "passed": list(self.passed), "failed": list(self.failed),
                "summary": self.summary, "reasons": list(self.reasons), "kinds": list(self.kinds),
                "where": list(self.where), "skipped": list(self.skipped), "skip_reason": self.skip_reason,
                "retried": list(self.retried), "environment": self.environment}

    @classmethod
    def from_dict(cls, d: dict) -> TestRun:
        # Reports written before failures were told apart have no kinds: every failure counted.
        failed = tuple(d["failed"])
        kinds = tuple(d.get("kinds") or ("behaviour",) * len(failed))
        return cls(d["status"], tuple(d["passed"]), failed, d["summary"], tuple(d.get("reasons", ())), kinds,
                   tuple(d.get("where", ())), tuple(d.get("skipped", ())), d.get("skip_reason", ""),
                   tuple(d.get("retried", ())), d.get("environment", ""))

    def _of(self, kind: str) -> tuple[str, ...]:
        return tuple(t for t, k in zip(self.failed, self.kinds, strict=False) if k == kind)

    @property
    def behaviour_failed(self) -> tuple[str, ...]:
        """Tests that failed by an assertion about what the code did (off the model's path included)."""
        return tuple(t for t, k in zip(self.failed, self.kinds, strict=False) if k in ("behaviour", "off-path"))

    @property
    def off_path_failed(self) -> tuple[str, ...]:
        """Tests that found the patch in the tree but off the path the model runs (``compat.OffModelPath``)."""
        return self._of("off-path")

    @property
    def harness_failed(self) -> tuple[str, ...]:
        """Tests whose own setup, helpers or fixtures failed: they judged nothing."""
        return self._of("harness")

    @property
    def cannot_run(self) -> bool:
        """Nothing in the run judged the behaviour: harness errors only, all skipped, or no run."""
        return STATUSES.get(self.status) == "cannot run"

    def first_error(self) -> str:
        """The first harness error (test, why, where), else the summary: what to fix first."""
        for test, kind, why, at in zip(self.failed, self.kinds, self.reasons, self.where or [""] * len(self.failed),
                                       strict=False):
            if kind == "harness":
                return f"{why or 'error'} ({test}" + (f", at {at})" if at else ")")
        if self.status == "skipped":
            return f"every test skipped: {self.skip_reason or self.summary}"
        return self.summary


def describe(run: TestRun) -> str:
    """What a run says, in words: it passed, some tests fail by behaviour, or it cannot run (why);
    and the ranks that were killed at their timeout and started again."""
    retried = f" [{'; '.join(run.retried)}]" if run.retried else ""
    if run.status == "passed":
        return f"pass: {run.summary}{retried}"
    if run.cannot_run:
        return f"cannot run: {run.first_error()}{retried}"
    harness = f"; {len(run.harness_failed)} cannot run ({run.first_error()})" if run.harness_failed else ""
    return f"fail: {len(run.behaviour_failed)} by behaviour{harness} ({run.summary}){retried}"


TestRunner = Callable[[Patch, Path], TestRun | None]
"""``run(patch, tree)`` runs the patch's tests with ``import vllm`` resolving to ``tree``;
``None`` when the patch has no tests."""


def test_file(tests_dir: Path, patch_name: str) -> Path:
    """``tests/patches/test_<name>.py`` for ``<name>.patch`` (dashes become underscores)."""
    return tests_dir / f"test_{patch_name.removesuffix('.patch').replace('-', '_')}.py"


def test_files(tests_dir: Path, patch_name: str) -> list[Path]:
    """A patch's test files: ``test_<name>.py`` and its parts ``test_<name>__<part>.py``."""
    main = test_file(tests_dir, patch_name)
    return [main, *sorted(main.parent.glob(f"{main.stem}__*.py"))]


Deps = Callable[[str], Path | None]
"""``deps(release)``: the folder of that release's whole dependency set
(:func:`overlay.maintain.rebase.deps.release_deps`), or None (the run then has this environment)."""

RETRIES_ENV = "OVERLAY_RANK_RETRIES"  # a file tests/patches/ranks.py adds a JSON line to per retry
LIBRARIES_ENV = "OVERLAY_TEST_LIBRARIES"  # the run's dependency folders: library code for failkind


class PytestRunner:
    """Run a patch's :func:`test_files` in a subprocess with ``OVERLAY_VLLM_TREE=<tree>``.

    Like ``tests/test_patches_against_base.py``: the repository's ``conftest.py`` puts the
    tree first on ``sys.path``; ``PYTHONPATH`` does the same for test folders without it, then
    the release's whole dependency set (``deps``, by the release ``vllm/_version.py`` names) and this
    environment's torch, with nothing else of this environment (``python -S``), and this tool's folder
    so that :mod:`overlay.maintain.rebase.failkind` loads.
    """

    def __init__(self, tests_dir: Path, *, cwd: Path | None = None, timeout: float = 1800,
                 deps: Deps | None = None) -> None:
        self.tests_dir, self.cwd, self.timeout, self.deps = tests_dir, cwd, timeout, deps

    def _deps_of(self, tree: Path) -> Path | None:
        from overlay.maintain.rebase.deps import tree_version

        release = tree_version(tree) if self.deps is not None else None
        return self.deps(release) if self.deps is not None and release else None

    def environment(self, tree: Path) -> str | None:
        """The digest of what a run on ``tree`` imports beside the tree, or None for this environment."""
        from overlay.maintain.rebase.deps import environment_of

        deps = self._deps_of(tree)
        return environment_of(deps) if deps is not None else None

    def __call__(self, patch: Patch, tree: Path) -> TestRun | None:
        files = test_files(self.tests_dir, patch.name)
        if not files[0].is_file():
            return None
        return run_files(files, tree, cwd=self.cwd or self.tests_dir, timeout=self.timeout, deps=self._deps_of(tree))


def pytest_runner(tests_dir: Path, *, cwd: Path | None = None, timeout: float = 1800,
                  deps: Deps | None = None) -> TestRunner:
    """A :class:`PytestRunner`."""
    return PytestRunner(tests_dir, cwd=cwd, timeout=timeout, deps=deps)


def run_files(files: list[Path], tree: Path, *, cwd: Path, timeout: float = 900, deps: Path | None = None,
              marks: str = "not gpu") -> TestRun:
    """pytest on ``files`` with ``import vllm`` resolving to ``tree``; what each test did. ``marks``: the
    run's marker expression (``-m``; every test but the GPU ones unless told).

    With ``deps`` (a release's dependency folder) the run's Python starts with ``-S``: its path is the
    tree, ``deps``, this environment's torch and this tool, whatever else this environment holds.
    """
    import subprocess

    env = dict(os.environ)
    env["OVERLAY_VLLM_TREE"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # never leave __pycache__ in a tree under test
    with scratch("overlay-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        retries = Path(tmp) / "retries.jsonl"
        env[RETRIES_ENV] = str(retries)
        python = [sys.executable]
        if deps is not None:
            from overlay.maintain.rebase.deps import run_path

            libraries = run_path(deps, Path(tmp))
            first = [str(tree), *map(str, libraries), str(_TOOL_ROOT)]
            env["PYTHONPATH"] = os.pathsep.join(first)
            env[LIBRARIES_ENV] = os.pathsep.join(str(p.resolve()) for p in libraries)
            env.pop("PYTHONHOME", None)
            python.append("-S")  # none of this environment's site-packages: the release's set alone
        else:
            first = [str(tree), str(_TOOL_ROOT)]
            env["PYTHONPATH"] = os.pathsep.join([*first, *filter(None, [env.get("PYTHONPATH")])])
        cmd = [*python, "-m", "pytest", *map(str, files), "-m", marks, "-q", "-p", "no:cacheprovider",
               "-p", "overlay.maintain.rebase.failkind", "-o", "addopts=", f"--junitxml={junit}"]
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False,
                                  timeout=timeout, preexec_fn=bound_to_parent())  # none runs on after a kill
        except subprocess.TimeoutExpired:
            return TestRun("error", summary=f"timed out after {timeout:.0f} s", retried=_retries(retries),
                           environment=recorded_path(deps or ""))
        cases = _junit(junit, tree)
        retried = _retries(retries)
    tail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
    summary = tail[-1] if tail else f"pytest exited {proc.returncode}"
    run = _run_of(proc.returncode, summary, tail, cases)
    return dataclasses.replace(run, retried=retried, environment=recorded_path(deps or ""))


def _retries(path: Path) -> tuple[str, ...]:
    """The lines tests/patches/ranks.py wrote for ranks it started again, in words."""
    out: list[str] = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ()
    for line in text.splitlines():
        try:
            r = json.loads(line)
            out.append(f"{r['test']}: rank(s) {', '.join(map(str, r['ranks']))} killed at their {r['timeout']:.0f} s "
                       f"timeout, run again with {r['retry_timeout']:.0f} s: {r['then']}")
        except (ValueError, KeyError, TypeError):
            continue
    return tuple(out)


_TOOL_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the overlay package


@dataclass
class _Cases:
    passed: list[str]
    failed: list[str]
    reasons: list[str]
    kinds: list[str]
    where: list[str]
    skipped: list[str]
    skip_reasons: list[str]


def _run_of(rc: int, summary: str, tail: list[str], c: _Cases) -> TestRun:
    """The status of a run from pytest's exit code and the JUnit cases (see ``STATUSES``)."""
    if rc in (0, 1, 2, 5) and (c.passed or c.failed or c.skipped or rc == 5):
        if c.failed:
            status = "failed" if {"behaviour", "off-path"} & set(c.kinds) else "harness"
        elif c.passed:
            status = "passed"
        else:
            status = "skipped"
    else:
        status = "error"
        summary = f"rc={rc}: " + " | ".join(tail[-3:])
    return TestRun(status, tuple(c.passed), tuple(c.failed), summary, tuple(c.reasons), tuple(c.kinds),
                   tuple(c.where), tuple(c.skipped), c.skip_reasons[0] if c.skip_reasons else "")


_FILE_LINE = re.compile(r'File "([^"]+)", line \d+')


def _broken_in(text: str, reason: str, tree: Path | None) -> bool:
    """A collection failure whose innermost exception is a ``SyntaxError`` in a file of ``tree``:
    the code under test does not compile (failkind's rule 0), not a harness error."""
    if tree is None or not reason.startswith(("SyntaxError", "IndentationError", "TabError")):
        return False
    files = _FILE_LINE.findall(text)
    if not files:
        return False
    last = Path(files[-1]).resolve()
    root = tree.resolve()
    return last == root or root in last.parents


def _junit(path: Path, tree: Path | None = None) -> _Cases:
    cases = _Cases([], [], [], [], [], [], [])
    if not path.exists():
        return cases
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        props = {p.get("name"): p.get("value", "") for p in case.iter("property")}
        failure, error = case.find("failure"), case.find("error")
        bad = failure if failure is not None else error
        if bad is not None:
            message = bad.get("message") or ""
            reason = _reason(message, bad.text or "")
            cases.failed.append(name)
            cases.reasons.append(reason)
            # without the plugin's verdict (a collection failure has none): a failed call is the
            # behaviour's, an error (setup, teardown, collection) the harness's, unless the code
            # under test does not compile
            default = "behaviour" if failure is not None or _broken_in(bad.text or "", reason, tree) else "harness"
            cases.kinds.append(props.get("overlay-failure") or default)
            cases.where.append(props.get("overlay-failure-at", ""))
        elif (skip := case.find("skipped")) is not None:
            cases.skipped.append(name)
            cases.skip_reasons.append((skip.get("message") or "").removeprefix("Skipped: "))
        else:
            cases.passed.append(name)
    return cases
_EXC = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$")


def _reason(message: str, text: str) -> str:
    """One line saying why a test failed: the innermost exception, else the message's first line."""
    found = [m[1] for line in (message + "\n" + text).splitlines() if (m := _EXC.match(line))]
    found = [f for f in found if not f.startswith("AssertionError: Traceback")]
    first = message.strip().splitlines()
    return (found[-1] if found else first[0] if first else "")[:200]


