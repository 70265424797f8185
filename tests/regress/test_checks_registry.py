"""A regress check is one registration (``overlay.regress.checks.CHECKS``): its order, thresholds, code.

Before the registry, a check had to be named in three places that had to agree (the profile's list,
the runner's step table and a fixed order tuple in ``runner.run``); one left out ran nothing and
said nothing. Here a check added only to ``CHECKS`` runs, in the place its line gives it, with its
own summary, and every shipped check's code resolves. The places that still name the checks (the
report's sections and plots, the recorded baseline, the profile's option sections, each shipped
profile's ``checks`` and ``checks_off``, the help, the README, the guide, the Makefile's help line, the
architecture's module map) are derived from it or held to it here.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from regress_helpers import make_profile

from overlay import cli
from overlay.regress import baseline_record, checks, runner
from overlay.regress.checks import CHECKS, TITLES, Check
from overlay.regress.profiles import Profile, load_profile, shipped_profiles
from overlay.regress.step import StepContext

REPO = Path(__file__).resolve().parents[2]

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
        for ref in filter(None, (c.step, c.summary, c.prepare, c.section, c.plot, c.record)):
            assert callable(checks.function(ref)), ref
    assert checks.NAMES == tuple(c.name for c in CHECKS) and len(set(checks.NAMES)) == len(CHECKS)
    owned = [t.name for c in CHECKS for t in c.thresholds]
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


def test_every_shipped_check_has_its_report_section() -> None:
    assert [c.name for c in CHECKS if not c.section] == []


def test_the_recorded_baseline_comes_from_the_checks_that_record() -> None:
    assert baseline_record.RECORDED == tuple(c.name for c in CHECKS if c.record)
    assert set(baseline_record.RECORDED) <= set(checks.NAMES)


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_runs_each_check_or_says_why_not(name: str) -> None:
    """Every shipped profile lists its ``checks``, so a check added to ``CHECKS`` (``default`` or not) ran in
    none of them and nothing said so. Now each names every registered check: in ``checks``, or in
    ``checks_off`` with why it is off there (the report shows that line)."""
    p = load_profile(name)
    named = set(p.checks) | set(p.checks_off)
    assert [c for c in checks.NAMES if c not in named] == [], f"{p.path}: add it to checks, or to checks_off with why"


def test_the_profile_option_sections_are_the_checks() -> None:
    """Each ``*Spec`` section of a profile but ``server`` belongs to one check (its ``options``)."""
    sections = {f.name for f in dataclasses.fields(Profile) if str(f.type).endswith("Spec") and f.name != "server"}
    assert sections == {c.options for c in CHECKS if c.options}


def in_order(text: str, words: tuple[str, ...]) -> bool:
    at = -1
    for w in words:
        at = text.lower().find(w.lower(), at + 1)
        if at < 0:
            return False
    return True


def test_the_help_the_readme_the_guide_and_the_makefile_name_every_check_in_its_order() -> None:
    regress = next(a for a in cli.parser()._actions if a.dest == "command").choices["regress"]
    assert regress.description.startswith(", ".join(TITLES) + " "), regress.description
    assert ",".join(checks.NAMES) in regress.format_help().replace("\n", "").replace(" ", "")
    readme = (REPO / "README.md").read_text()
    assert f"| regress a server ({', '.join(TITLES)}) |" in readme
    guide = (REPO / "docs" / "regress" / "README.md").read_text()
    listed = re.findall(r"(?m)^(\d+)\. \*\*([^*]+)\*\*", guide)
    assert listed == [(str(i), t) for i, t in enumerate(TITLES)], listed
    make_help = re.search(r"(?m)^regress:.*## (.*)$", (REPO / "Makefile").read_text()).group(1)
    assert in_order(make_help, TITLES), make_help
    module_map = (REPO / "docs" / "ARCHITECTURE.md").read_text().split("\n## Module map", 1)[1].split("\n## ", 1)[0]
    arch = next(line for line in module_map.splitlines() if line.startswith("| `overlay/regress/` |"))
    assert in_order(arch, TITLES), arch


def test_the_package_docstring_points_at_the_registry_and_the_layout() -> None:
    """``overlay/regress/__init__.py`` listed the checks in order and the package's modules, a copy of
    ``CHECKS`` and of the Layout row (docs/ARCHITECTURE.md) that nothing held; it points at both instead."""
    import overlay.regress as package

    doc = package.__doc__ or ""
    assert ":data:`overlay.regress.checks.CHECKS`" in doc and "Layout row ``overlay/regress/``" in doc
    named = [w for w in (*checks.NAMES, *TITLES) if re.search(rf"\b{re.escape(w)}\b", doc, re.IGNORECASE)]
    assert named == [], f"overlay/regress/__init__.py names checks {named}: point at CHECKS"
    modules = sorted(p.stem for p in (REPO / "overlay" / "regress").glob("*.py")
                     if p.stem not in ("__init__", "checks"))
    listed = [m for m in modules if f"``{m}``" in doc]
    assert listed == [], f"overlay/regress/__init__.py lists modules {listed}: ARCHITECTURE's Layout row holds them"


def _calls_naming_a_check(path: Path) -> list[tuple[int, str]]:
    """Each ``Finding("<check>", ...)`` and ``<server>.ensure_alive("<check>", ...)`` of a module: line, name."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if called in ("Finding", "ensure_alive"):
            found.append((node.lineno, node.args[0].value))
    return found


def test_a_checks_findings_and_liveness_name_the_check() -> None:
    """A check's findings carry its name (``regress-verdicts`` matches ``regression:<check>`` on it), typed
    as a string in its module: one that parted from ``Check.name`` would judge under another name."""
    for c in CHECKS:
        module = c.step.partition(":")[0]
        path = REPO / (module.replace(".", "/") + ".py")
        named = _calls_naming_a_check(path)
        assert named, f"{path.name}: no Finding or ensure_alive naming {c.name!r}"
        assert [(line, n) for line, n in named if n != c.name] == [], f"{path.name} names another check than {c.name}"


# What a passing run's data looks like for each check that records a baseline (its ``record`` reads it),
# on a given profile (acceptance: one rate per token its server drafts, however many that is).
# A check that records gets its sample here: the test below fails naming it until it has one.
RECORD_SAMPLES: dict[str, Callable[[Profile], dict[str, Any]]] = {
    "gsm8k": lambda p: {"strict-match": {"value": 0.91, "stderr": 0.008},
                        "flexible-extract": {"value": 0.92, "stderr": 0.0075}},
    "latency": lambda p: {"mean_ttft_ms": 812.5, "mean_tpot_ms": 31.25, "tool": p.latency.tool},
    "acceptance": lambda p: {"rates": [round(0.9 - 0.1 * i, 2) for i in range(p.server.speculative_tokens or 5)]},
}


@pytest.mark.parametrize("check", [c for c in CHECKS if c.record], ids=lambda c: c.name)
def test_every_record_function_writes_fields_the_profile_reads(check: Check, tmp_path: Path) -> None:
    """``record`` returns fields of a profile's ``baseline:`` section, and the profile parser refuses a field
    it does not know: a record function whose keys parted from ``profiles._baseline`` failed only at the
    end of a real ``--record-baseline`` run. Each recording check's sample is recorded into each shipped
    profile here, and the written profile must load with those numbers."""
    assert check.name in RECORD_SAMPLES, f"add a sample of {check.name}'s data to RECORD_SAMPLES"
    for name in shipped_profiles():
        values = checks.function(check.record)(RECORD_SAMPLES[check.name](load_profile(name)))
        assert values, f"{check.record} recorded nothing from its sample for {name}"
        out = baseline_record.write_recorded_profile(name, values, tmp_path / f"{name}.yaml", "a test")
        base = load_profile(str(out)).baseline
        assert check.name in base.source
        assert base != load_profile(name).baseline, f"{name}: recording {check.name} changed nothing"
