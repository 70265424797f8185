"""Running a patch's own tests on a tree: pytest with a JUnit report, and what each test did
(passed, failed, errored, with the first error line)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overlay.series import Patch


@dataclass(frozen=True)
class TestRun:
    """One run of a patch's own tests against one tree."""

    __test__ = False  # not a pytest test class, whatever its name

    status: str  # "passed" (rc 0), "failed" (rc 1: tests ran, some failed), "error" (did not run)
    passed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    summary: str = ""
    reasons: tuple[str, ...] = ()  # per failed test, the first line of its failure message

    def to_dict(self) -> dict[str, object]:
        return {"status": self.status, "passed": list(self.passed), "failed": list(self.failed),
                "summary": self.summary, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, d: dict) -> TestRun:
        return cls(d["status"], tuple(d["passed"]), tuple(d["failed"]), d["summary"], tuple(d.get("reasons", ())))


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


def pytest_runner(tests_dir: Path, *, cwd: Path | None = None, timeout: float = 900) -> TestRunner:
    """Run a patch's :func:`test_files` in a subprocess with ``OVERLAY_VLLM_TREE=<tree>``.

    Like ``tests/test_patches_against_base.py``: the repository's ``conftest.py`` puts the
    tree first on ``sys.path``; ``PYTHONPATH`` does the same for test folders without it.
    """
    import subprocess

    def run(patch: Patch, tree: Path) -> TestRun | None:
        files = test_files(tests_dir, patch.name)
        if not files[0].is_file():
            return None
        env = dict(os.environ)
        env["OVERLAY_VLLM_TREE"] = str(tree)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # never leave __pycache__ in a tree under test
        with tempfile.TemporaryDirectory(prefix="overlay-tests-") as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [sys.executable, "-m", "pytest", *map(str, files), "-m", "not gpu", "-q", "-p", "no:cacheprovider",
                   "-o", "addopts=", f"--junitxml={junit}"]
            try:
                proc = subprocess.run(cmd, cwd=cwd or tests_dir, env=env, capture_output=True, text=True,
                                      check=False, timeout=timeout)
            except subprocess.TimeoutExpired:
                return TestRun("error", summary=f"timed out after {timeout:.0f} s")
            passed, failed, reasons = _junit(junit)
        tail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
        summary = tail[-1] if tail else f"pytest exited {proc.returncode}"
        status = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
        if status == "error":
            summary = f"rc={proc.returncode}: " + " | ".join(tail[-3:])
        return TestRun(status, passed, failed, summary, reasons)

    return run


def _junit(path: Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if not path.exists():
        return (), (), ()
    passed: list[str] = []
    failed: list[str] = []
    reasons: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            failed.append(name)
            reasons.append(_reason(bad.get("message") or "", bad.text or ""))
        elif case.find("skipped") is None:
            passed.append(name)
    return tuple(passed), tuple(failed), tuple(reasons)


_EXC = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$")


def _reason(message: str, text: str) -> str:
    """One line saying why a test failed: the innermost exception, else the message's first line."""
    found = [m[1] for line in (message + "\n" + text).splitlines() if (m := _EXC.match(line))]
    found = [f for f in found if not f.startswith("AssertionError: Traceback")]
    first = message.strip().splitlines()
    return (found[-1] if found else first[0] if first else "")[:200]


