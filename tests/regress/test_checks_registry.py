"""A regress check is one registration (``overlay.regress.checks.CHECKS``): its order, thresholds, code.

Before the registry, a check had to be named in three places that had to agree (the profile's list,
the runner's step table and a fixed order tuple in ``runner.run``); one left out ran nothing and
said nothing. Here a check added only to ``CHECKS`` runs, in the place its line gives it, with its
own summary, and every shipped check's code resolves.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from regress_helpers import make_profile

from overlay.regress import checks, runner
from overlay.regress.checks import CHECKS, Check, StepContext
from overlay.regress.profiles import load_profile

SEEN: list[str] = []


def first_step(ctx: StepContext) -> tuple[dict[str, Any], list]:
    SEEN.append("first")
    return {"n": 1}, []


def last_step(ctx: StepContext) -> tuple[dict[str, Any], list]:
    SEEN.append("last")
    return {"n": 2}, []


def summary(data: dict[str, Any]) -> str:
    return f"fake check {data['n']} ran"


def test_every_registered_check_resolves_and_names_only_its_thresholds() -> None:
    for c in CHECKS:
        for ref in filter(None, (c.step, c.summary, c.prepare)):
            assert callable(checks.function(ref)), ref
    assert checks.NAMES == tuple(c.name for c in CHECKS) and len(set(checks.NAMES)) == len(CHECKS)
    owned = [t for c in CHECKS for t in c.thresholds]
    assert len(owned) == len(set(owned))  # a threshold belongs to one check
    # the run's order: the differential check first, acceptance (over everything the run sent) last
    assert checks.NAMES[0] == "differential" and checks.NAMES[-1] == "acceptance"


def test_a_check_registered_once_runs_in_its_place(tmp_path: Path, standin, monkeypatch) -> None:
    server = standin("healthy")
    mod = sys.modules[__name__].__name__
    extra_first = Check("fake_first", f"{mod}:first_step", f"{mod}:summary", ())
    extra_last = Check("fake_last", f"{mod}:last_step", f"{mod}:summary", ())
    monkeypatch.setattr(runner, "CHECKS", (extra_first, *CHECKS, extra_last))
    SEEN.clear()
    profile = load_profile(str(make_profile(tmp_path)))
    profile = dataclasses.replace(profile, checks=("fake_last", "fake_first"))  # the profile's order is not the run's
    report = runner.run(profile, tmp_path / "out", base_url=server.url, progress=lambda line: None)
    assert SEEN == ["first", "last"]
    steps = [(s.name, s.status, s.summary) for s in report.steps if s.name != "server"]
    assert steps == [("fake_first", "pass", "fake check 1 ran"), ("fake_last", "pass", "fake check 2 ran")]
    assert report.exit_code == 0
