"""What a patch's own test runs say about the target: run on the old base (the base plus the
earlier patches) and on the target without the patch, only behaviour failures judge (a harness
error judges nothing, :mod:`overlay.maintain.rebase.failkind`)."""

from __future__ import annotations

import re
from enum import StrEnum

from overlay.maintain.rebase.testrun import TestRun, describe

_MISSING = re.compile(r"No module named '([^']+)'")


class Verdict(StrEnum):
    """What :func:`behaviour_verdict` says of a patch's tests on the target (the rule: its docstring).

    These are not rebase outcomes (``state.OUTCOMES``): ``classify`` turns each into one, and compares
    against these members, never against their text.
    """

    UPSTREAM_BY_BEHAVIOUR = "upstream-by-behaviour"  # the outcome of the same name: dropped
    CONTRADICTED = "contradicted"  # the outcome of the same name: set aside for a person
    PARTIAL = "partial"  # the outcome partly-upstream (carried)
    NEEDED = "needed"  # carried as it merges (applied / refreshed / conflict)
    UNKNOWN = "unknown"  # the tests cannot tell: carried as it merges


def old_base_failure(old: TestRun) -> str | None:
    """Why a run on the old base is this tool's own failure, in one line naming the missing module or
    the setup step; None when the run judged (passed, failed by behaviour, or every test skipped).

    The old base is the release the series is built and tested on: a patch's tests that cannot run
    there (a harness error, pytest did not finish) show a test environment that is not whole, or a
    harness that does not fit that release, never something about the patch or the target.
    """
    if old.status == "error":
        return f"pytest did not finish ({old.summary})"
    if not old.harness_failed:
        return None
    first = old.first_error()
    missing = _MISSING.search(first)
    if missing:
        where = old.environment or "this environment"
        return f"module {missing[1]!r} is missing from the release's test environment ({where}): {first}"
    return f"a harness error in the tests' setup: {first}"


def behaviour_verdict(runs: dict[str, dict], tests: str) -> tuple[Verdict, list[str], list[str], str]:
    """What a patch's own tests say of the target: (verdict, tests now passing, still failing, note).

    Here the rebase decides "upstream by behaviour", and this is the rule's one statement (the rebase
    guide, ``state.OUTCOMES`` and the package docstring point here; ``tests/test_one_source.py``
    holds them to pointing). ``runs`` are the patch's tests on the old base (the base plus the
    earlier patches) and on the target without the patch. The verdict is

    - "upstream-by-behaviour" (the outcome it leads to: the patch is dropped, before any merge is
      tried) when the tests judge on the old base (they ran there, some of them fail by behaviour),
      and on the target without the patch every one of those passes or is skipped, at least one
      passes, none cannot run, and no test that passes on the old base fails by behaviour;
    - "contradicted" when a test that passes on the old base fails on the target without the patch
      by behaviour: the target behaves otherwise than the tests expect, for a person to decide;
    - "partial" when some of those failing on the old base pass on the target and some still fail,
      "needed" when none passes there and some still fail;
    - "unknown" when the tests cannot tell: no tests, a harness error or no finished run on the old
      base, none failing there, every one skipped on the target, or some that cannot run on the
      target and none still failing (the note names the test file to fix first).

    Only behaviour failures judge: a harness error on the old base is this tool's failure
    (:func:`old_base_failure`; the rebase stops on it before it asks here); a test that cannot run on
    the target (:attr:`TestRun.cannot_run`, or a harness error of its own) says nothing of the target.
    ``Result.absorbed`` is another thing: the hunks or tests of a patch that are already upstream.
    """
    if not runs:
        return Verdict.UNKNOWN, [], [], "no tests of its own"
    old, new = TestRun.from_dict(runs["old-base"]), TestRun.from_dict(runs["target"])
    tool = old_base_failure(old)
    if tool is not None:  # the rebase stops on it first (classify); never the patch's or its tests' fault
        return Verdict.UNKNOWN, [], [], f"its tests cannot run on the old base: {tool}"
    if old.cannot_run:
        return Verdict.UNKNOWN, [], [], f"its tests cannot run on the old base ({old.first_error()}): they cannot tell"
    judged = set(old.behaviour_failed)
    if not judged:
        return Verdict.UNKNOWN, [], [], (f"its tests do not fail on the old base ({describe(old)}); "
                                         "they cannot tell whether upstream fixed it")
    if new.cannot_run:
        return Verdict.UNKNOWN, [], [], f"its tests cannot run on the target ({new.first_error()}): fix {tests} first"
    fixed = sorted(judged & set(new.passed))
    still = sorted(judged & set(new.behaviour_failed))
    skipped = sorted(judged & set(new.skipped))  # the test itself says it does not apply there
    blocked = sorted(judged - set(fixed) - set(still) - set(skipped))  # harness errors (or gone) there
    contradicted = sorted(set(old.passed) & set(new.behaviour_failed))
    if contradicted:
        why = dict(zip(new.failed, new.reasons, strict=False))
        return Verdict.CONTRADICTED, fixed, still, (
            f"{len(contradicted)} of its tests pass on the old base and fail on the target without it "
            f"(e.g. {contradicted[0]}: {why.get(contradicted[0], '')}): the target's own behaviour contradicts "
            "them, so they cannot vouch for carrying the patch; a person decides")
    if blocked and not still:
        return Verdict.UNKNOWN, fixed, [], (f"{len(fixed)} of its tests that fail on the old base pass on the target "
                                            f"without it, {len(blocked)} cannot run there ({new.first_error()}): "
                                            f"fix {tests} first")
    cannot = f"; {len(blocked)} cannot run there ({new.first_error()})" if blocked else ""
    if not still and not fixed:
        return Verdict.UNKNOWN, [], [], (f"its tests that fail on the old base are all skipped on the target "
                                         f"({new.skip_reason}): they cannot tell")
    if not still:
        skips = f"; {len(skipped)} skipped there ({new.skip_reason})" if skipped else ""
        return Verdict.UPSTREAM_BY_BEHAVIOUR, fixed, [], (f"its tests fail on the old base ({describe(old)}) and pass "
                                                          f"on the target without it ({describe(new)}){skips}")
    if fixed:
        return Verdict.PARTIAL, fixed, still, (f"of its tests that fail on the old base, {len(fixed)} pass on the "
                                               f"target without it ({', '.join(fixed)}) and {len(still)} still fail "
                                               f"({', '.join(still)})" + cannot + differently(old, new))
    return Verdict.NEEDED, [], still, (f"its tests still fail on the target without it ({describe(new)})" + cannot
                                       + differently(old, new))


def differently(old: TestRun, new: TestRun) -> str:
    """A warning when the tests fail on the target for other reasons than on the old base.

    A test that fails there with, say, an AttributeError from its own harness may not fit the
    release (``tests/compat.py``) rather than show that the bug is still there.
    """
    before = dict(zip(old.failed, old.reasons, strict=False))
    changed = [(t, why) for t, why in zip(new.failed, new.reasons, strict=False) if t in before and before[t] != why]
    if not changed:
        return ""
    test, why = changed[0]
    return (f"; but {len(changed)} of them fail differently there (e.g. {test}: {why}), so the tests may not "
            "fit this release: check tests/compat.py before trusting this")
