"""pytest plugin for a patch's own test runs (``make rebase``, ``make patch-tests-matrix``): says of
each failed test whether its harness failed or the code under test did something wrong.

Loaded with ``-p overlay.maintain.rebase.failkind``; the verdict goes into the JUnit report as the testcase
property ``overlay-failure`` (``harness`` or ``behaviour``), which :mod:`overlay.maintain.rebase.testrun`
reads. A harness error says nothing about the patched behaviour: the test could not get that far
on this tree (its setup, its helpers or fixtures failed, a test-only name did not import).

The rules for a failed test, first match wins, are :data:`RULES`: each with the failures it
covers in the words of ``docs/rebase/README.md``'s table (:func:`rules_table`; the test
``tests/test_one_source.py`` holds the guide to it) and the function that decides.

Collection errors (a test file that does not import) never reach a test: ``testrun`` counts them
as harness errors from JUnit's ``collection failure`` entries, unless the code under test does not
compile (the first rule).
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pytest

PROPERTY = "overlay-failure"
AT = "overlay-failure-at"  # file:line of the innermost frame of test code, where there is one
KINDS = ("harness", "behaviour", "off-path")  # off-path: a behaviour failure on the model's path
_NEEDS_GPU = re.compile(r"requires a CUDA|not compiled with CUDA|No CUDA GPUs are available|Found no NVIDIA driver|"
                        r"no pinned memory allocator|CUDA driver initialization failed|"
                        r"platform may not support current_stream|Cannot access accelerator device")


def _marked(exc: BaseException | None) -> str | None:
    """The ``overlay_failure`` of the outermost exception in the chain that has one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kind = getattr(type(exc), "overlay_failure", None)
        if kind in KINDS:
            return kind
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def does_not_compile(exc: BaseException | None, under_test: list[Path]) -> bool:
    """A ``SyntaxError`` (or ``IndentationError``) in ``exc``'s chain raised for a file of the code
    under test: that code is broken, whatever imported it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, SyntaxError) and exc.filename and _under(Path(exc.filename).resolve(), under_test):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _missing_dependency(exc: BaseException) -> bool:
    """A module outside vLLM that does not import: the environment lacks what the release needs
    (``overlay/maintain/rebase/deps.py``), whatever code imported it."""
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    return bool(name) and name.split(".")[0] != "vllm"


def _triton_launch_without_triton(exc: BaseException) -> bool:
    """A Triton kernel launched where vLLM found no Triton: its placeholder ``@triton.jit`` leaves a
    plain function, and ``kernel[grid](...)`` fails with this TypeError."""
    triton_utils = sys.modules.get("vllm.triton_utils")
    return (isinstance(exc, TypeError) and "'function' object is not subscriptable" in str(exc)
            and triton_utils is not None and getattr(triton_utils, "HAS_TRITON", True) is False)


def _innermost(exc: BaseException) -> BaseException:
    """The first cause of ``exc`` (what a region caught before re-raising it as its own)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _library_roots() -> list[Path]:
    """The standard library, and the run's dependency folders (``OVERLAY_TEST_LIBRARIES``: a release's
    whole dependency set, :mod:`overlay.maintain.rebase.deps`, holds no ``site-packages`` in its path)."""
    paths = sysconfig.get_paths()
    given = [Path(p).resolve() for p in os.environ.get("OVERLAY_TEST_LIBRARIES", "").split(os.pathsep) if p]
    return [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if k in paths] + given


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def code_under_test() -> list[Path]:
    """Where the code under test lives: ``$OVERLAY_VLLM_TREE`` and the imported ``vllm`` package."""
    roots: list[Path] = []
    tree = os.environ.get("OVERLAY_VLLM_TREE")
    if tree:
        roots.append(Path(tree).resolve())
    vllm = sys.modules.get("vllm")
    if vllm is not None and getattr(vllm, "__file__", None):
        roots.append(Path(vllm.__file__).resolve().parent)
    return roots


def _frames(tb: TracebackType | None) -> list[tuple[Path, int]]:
    """(file, line) of every frame of ``tb`` with a real file, innermost first."""
    frames: list[tuple[Path, int]] = []
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith("<") and Path(name).is_absolute():  # not exec'd or frozen code
            frames.append((Path(name).resolve(), tb.tb_lineno))
        tb = tb.tb_next
    return frames[::-1]


def _library(path: Path, libraries: list[Path]) -> bool:
    return "site-packages" in path.parts or "dist-packages" in path.parts or _under(path, libraries)


def raised_in(tb: TracebackType | None, under_test: list[Path]) -> str:
    """``behaviour`` when the innermost non-library frame of ``tb`` is in the code under test, else
    ``harness``."""
    libraries = _library_roots()
    for path, _ in _frames(tb):
        if _under(path, under_test):
            return "behaviour"
        if not _library(path, libraries):
            return "harness"
    return "harness"


def test_code_frame(tb: TracebackType | None, under_test: list[Path], root: Path) -> str:
    """``file:line`` (relative to ``root`` when under it) of the innermost frame of test code."""
    libraries = _library_roots()
    for path, line in _frames(tb):
        if not _under(path, under_test) and not _library(path, libraries):
            return f"{path.relative_to(root) if _under(path, [root]) else path}:{line}"
    return ""


@dataclass(frozen=True)
class Failure:
    """A failed test as the rules see it: the phase, the exception, its traceback, the code under test."""

    when: str
    exc: BaseException
    tb: TracebackType | None
    under_test: list[Path]


@dataclass(frozen=True)
class Rule:
    """One rule: the failures it covers, each with what it counts as (the guide's table rows), and
    ``decide``: ``harness`` / ``behaviour``, or None when the rule does not cover the failure."""

    rows: tuple[tuple[str, str], ...]
    decide: Callable[[Failure], str | None]


def _if(kind: str, test: Callable[[Failure], bool]) -> Callable[[Failure], str | None]:
    return lambda f: kind if test(f) else None


RULES: tuple[Rule, ...] = (
    # the code under test does not compile: the same rule holds for a rank's report
    # (tests/patches/ranks.py) and for a test file that does not import (testrun)
    Rule((("a `SyntaxError` in a file of the code under test, wherever it surfaced (collection, a fixture, a setup "
           "region, a rank's report): a conflict candidate whose merge left broken lines", "behaviour"),),
         _if("behaviour", lambda f: does_not_compile(f.exc, f.under_test))),
    # the tests run on CPU and did not stand in for the GPU; a module outside vLLM that does not import
    # is a dependency the release needs (overlay/maintain/rebase/deps.py). Before the marks: the code under
    # test asking for a GPU inside `compat.exercising` (0.34.0's FlashMLA-sparse __init__ reads
    # torch.accelerator.current_device_index()) says the harness did not stand in for it on this release,
    # not that the patch misbehaves; nor does a rank's report of it (tests/patches/glm5_path.py).
    Rule((("the machine has no GPU (`pin_memory=True requires a CUDA ...`, `Cannot access accelerator device "
           "when none is available`, a Triton kernel launched without Triton: `'function' object is not "
           "subscriptable`), or lacks a dependency (a module outside vLLM does not import), wherever it surfaced "
           "(inside `compat.exercising`, a rank's report)", "harness"),),
         _if("harness", lambda f: bool(_NEEDS_GPU.search(str(f.exc))) or _triton_launch_without_triton(f.exc)
             or _missing_dependency(f.exc))),
    # the exception says what it is (a class attribute overlay_failure: tests/compat.py's HarnessError and
    # BehaviourFailure); the outermost such exception of the chain
    Rule((("raised inside `with compat.setup(\"...\"):` (harness code that calls vLLM: configs, metadata, "
           "stand-ins)", "harness"),
          ("raised inside `with compat.exercising(\"...\"):`, or `compat.added(owner, name)` of a name the patch "
           "adds", "behaviour"),
          ("`compat.OffModelPath`: the patch is in the tree but the path the model runs does not take it (the GLM-5 "
           "path harness)", "off-path")),
         lambda f: _marked(f.exc)),
    Rule((("a fixture (setup/teardown), a test file that does not import (a test-only name)", "harness"),),
         _if("harness", lambda f: f.when != "call")),
    Rule((("an `AssertionError` (or `pytest.fail`) in the test", "behaviour"),),
         _if("behaviour", lambda f: isinstance(f.exc, AssertionError | pytest.fail.Exception))),
    # by where it was raised: walking out from the innermost frame, library frames (the standard library,
    # site-packages) skipped, a frame in the code under test (the imported vllm package, or
    # $OVERLAY_VLLM_TREE) makes it behaviour, a frame of the tests the harness's; only library frames: harness
    Rule((("any other exception: raised inside the code under test", "behaviour"),
          ("... raised by the test's own code", "harness")),
         lambda f: raised_in(f.tb, f.under_test)),
)


def rules_table() -> str:
    """:data:`RULES` as the guide's markdown table (``docs/rebase/README.md``)."""
    lines = ["| failure | counts as |", "| --- | --- |"]
    lines += [f"| {failure} | {kind} |" for rule in RULES for failure, kind in rule.rows]
    return "\n".join(lines) + "\n"


def failure_kind(when: str, exc: BaseException, tb: TracebackType | None,
                 under_test: list[Path] | None = None) -> str:
    """``harness`` or ``behaviour`` for an exception that failed a test in phase ``when``: the first of
    :data:`RULES` that decides."""
    failure = Failure(when, exc, tb, code_under_test() if under_test is None else under_test)
    for rule in RULES:
        kind = rule.decide(failure)
        if kind is not None:
            return kind
    return "harness"  # not reached: the last rule always decides


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed and call.excinfo is not None and not any(k == PROPERTY for k, _ in item.user_properties):
        under_test = code_under_test()
        kind = failure_kind(call.when, call.excinfo.value, call.excinfo.tb, under_test)
        found = [(PROPERTY, kind)]
        root = item.config.rootpath.resolve()
        at = test_code_frame(_innermost(call.excinfo.value).__traceback__, under_test, root) or \
            test_code_frame(call.excinfo.tb, under_test, root)
        if at:
            found.append((AT, at))
        item.user_properties.extend(found)  # JUnit writes the teardown report's copy
        report.user_properties.extend(found)
    return report
