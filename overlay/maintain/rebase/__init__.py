"""``make rebase TO=x.y.z``: carry the series onto another vLLM release, and say what upstream took.

A scratch repository ``.work/rebase-<to>/`` gets the history the replay needs: the base
release's text files (tag ``base``), the series on top as commits (branch ``old``), and the
target release as a commit on top of the base (tag ``target``, branch ``new``). Each patch is
then classified, in series order, on ``new``, into one of the outcomes of
:data:`overlay.maintain.rebase.state.OUTCOMES` (the one list: what each means there, when each is
given in ``docs/rebase/README.md``): dropped as upstream (by the same change, or by behaviour, as
:func:`overlay.maintain.rebase.verdict.behaviour_verdict` decides from its own tests), carried
(applied, refreshed, partly upstream, auto-resolved by a candidate its tests vouch for), or set
aside for a person (conflict, contradicted; conflict-resolved once ``make rebase-continue`` took the
person's resolution).

Only behaviour failures judge (``failkind``): tests that cannot run on a tree (a harness error,
everything skipped) decide nothing there, and the evidence names the test file to fix first.

Nothing is written under ``patches/<to>/`` until every patch is classified: the folder is
written under a temporary name and renamed. Tests drive :func:`start` and :func:`resume`
with tree-filling callables and a fake test runner; the CLI uses :func:`rebase_release`.

The package's rooms: ``classify`` (the run and each patch's classification), ``testrun`` (a patch's
own tests with their JUnit report), ``failkind`` (the pytest plugin that tells a harness error from a
behaviour failure), ``verdict`` (what the runs on the old base and the target say), ``matrix``
(``make patch-tests-matrix``), ``deps`` (each release's whole resolved dependency set, for its test
runs), ``resolve`` (candidate resolutions of a conflict, judged by the
tests), ``report`` (the release folder, ``REBASE.md``, ``rebase.json``), ``stale`` (what later pins
say of the current series, for ``make status``), ``runcache`` (test runs kept by what they ran on),
``state`` (the state file, results and :data:`OUTCOMES`) and ``release`` (the CLI's entry points).
"""

from __future__ import annotations

from overlay.maintain.rebase.classify import resume, start
from overlay.maintain.rebase.release import continue_release, rebase_release
from overlay.maintain.rebase.report import report_markdown
from overlay.maintain.rebase.state import STATE, Outcome, RebaseError, Result, State, prepared_pin, work_dir
from overlay.maintain.rebase.testrun import TestRun, pytest_runner, test_file, test_files

__all__ = [
    "STATE",
    "Outcome",
    "RebaseError",
    "Result",
    "State",
    "TestRun",
    "continue_release",
    "prepared_pin",
    "pytest_runner",
    "rebase_release",
    "report_markdown",
    "resume",
    "start",
    "test_file",
    "test_files",
    "work_dir",
]
