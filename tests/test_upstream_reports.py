"""The upstream reports judged on GLM-5's path (``patches/<release>/upstream-reports.toml``): every carried
release's record points at what is real (each evidence line quoted at its place in the unpatched release tree,
each test id's file and function, each fix patch in the series, each engine case among the engine check's
TP2 x DCP2 cases), ``make status`` lists it, and a malformed record is refused in one line naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.pins import REPO_PATCHES, carried_releases
from overlay.build.series import Series
from overlay.engine import workload
from overlay.maintain import upstream_reports as ur
from overlay.maintain.trees import base_tree
from overlay.releases.facts import release_facts

REPO = Path(__file__).resolve().parent.parent
DEFAULT = (REPO_PATCHES / "DEFAULT").read_text().strip()


def _series(release: str) -> set[str]:
    return {p.name for p in Series.load(REPO_PATCHES / release).patches}


@pytest.mark.parametrize("release", carried_releases(REPO_PATCHES))
def test_each_record_points_at_what_is_real(release: str) -> None:
    reports = ur.load(REPO_PATCHES, release)
    if not reports:
        pytest.skip(f"{release} judges no upstream report")
    tree = base_tree(REPO_PATCHES, release)
    cases = {c.name for c in workload.cases(2, release_facts(tree))}
    assert ur.problems(reports, tree=tree, repo=REPO, series=_series(release), cases=cases) == []


def test_the_default_release_judges_the_open_reports_on_glm5s_path() -> None:
    """The open reports on GLM-5's DCP path, each with a verdict; the W_UV_dcp memory and the warm-up findings
    fixed by patches of the series."""
    by_name = {r.report: r for r in ur.load(REPO_PATCHES, DEFAULT)}
    assert {"vllm#54305", "vllm#50781", "vllm#53465", "vllm#54300"} <= set(by_name)
    for finding in ("w-uv-dcp-memory", "jit-warmup-head-dim"):
        assert by_name[finding].verdict == "fixed-by" and by_name[finding].fix, by_name[finding]
    for r in by_name.values():
        assert r.engine_cases, f"{r.report}: no engine case would show it at DCP 2"


def _record(tmp_path: Path, body: str) -> Path:
    (tmp_path / "9.9.9").mkdir()
    (tmp_path / "9.9.9" / ur.FILE).write_text(body)
    return tmp_path


GOOD = """
[[report]]
report = "vllm#1"
title = "t"
verdict = "cannot-happen"
summary = "s"
evidence = [{ path = "vllm/a.py", line = 2, quote = "return x" }]
tests = ["tests/test_x.py::test_y[a-b]"]
engine_cases = ["case-a"]
"""


def test_problems_name_what_moved(tmp_path: Path) -> None:
    (reports,) = [ur.load(_record(tmp_path, GOOD), "9.9.9")]
    tree, repo = tmp_path / "tree", tmp_path / "repo"
    (tree / "vllm").mkdir(parents=True)
    (repo / "tests").mkdir(parents=True)
    (tree / "vllm" / "a.py").write_text("x = 1\nreturn x\n")
    (repo / "tests" / "test_x.py").write_text("def test_y(a):\n    pass\n")
    assert ur.problems(reports, tree=tree, repo=repo, series=set(), cases={"case-a"}) == []
    (tree / "vllm" / "a.py").write_text("x = 1\ny = 2\nreturn x\n")
    (repo / "tests" / "test_x.py").write_text("def test_z(a):\n    pass\n")
    assert ur.problems(reports, tree=tree, repo=repo, series=set(), cases=set()) == [
        "vllm#1: vllm/a.py:2 no longer reads 'return x' (now at line 3)",
        "vllm#1: tests/test_x.py::test_y[a-b]: tests/test_x.py defines no test_y",
        "vllm#1: engine case case-a: not a case of the engine check",
    ]


def test_a_fix_patch_must_be_in_the_series(tmp_path: Path) -> None:
    body = GOOD.replace('"cannot-happen"', '"fixed-by"') + 'fix = ["gone.patch"]\n'
    reports = ur.load(_record(tmp_path, body), "9.9.9")
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "a.py").write_text("x = 1\nreturn x\n")
    assert "vllm#1: fix gone.patch: not in the series" in ur.problems(
        reports, tree=tree, repo=REPO, series={"other.patch"}, cases={"case-a"})


@pytest.mark.parametrize(("change", "message"), [
    (('"cannot-happen"', '"maybe"'), "report[0] (vllm#1).verdict: 'maybe' is none of shows, cannot-happen"),
    (("evidence = [", "evidence = [] #"), "report[0] (vllm#1).evidence: cannot-happen needs the release's lines"),
    (('"cannot-happen"', '"fixed-by"'), "report[0] (vllm#1).fix: fixed-by needs the fix patch and the tests"),
    (('"cannot-happen"', '"shows"'), "report[0] (vllm#1).fix: shows needs a fix patch, carried_by, or unfixed"),
    (('"cannot-happen"', '"pending"'), "report[0] (vllm#1).awaits: pending needs what will judge it"),
    (("line = 2", "line = 0"), "report[0] (vllm#1).evidence[0].line: a line number (1 or more) is needed"),
    (('"vllm/a.py"', '"../a.py"'), "report[0] (vllm#1).evidence[0].path: a path inside the release tree"),
    (("tests/test_x.py::test_y[a-b]", "test_y"), "report[0] (vllm#1).tests: 'test_y' is not a test id"),
    (('title = "t"', 'titel = "t"'), "report[0] (vllm#1).titel: unknown field"),
    (('summary = "s"', "summary = 3"), "report[0] (vllm#1).summary: a non-empty string is needed"),
])
def test_a_malformed_record_is_refused_in_one_line(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    root = _record(tmp_path, GOOD.replace(*change))
    with pytest.raises(ur.ReportsError) as e:
        ur.load(root, "9.9.9")
    assert str(e.value).startswith(f"9.9.9/{ur.FILE}: {message}")
    assert "\n" not in str(e.value)


def test_a_report_judged_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ur.ReportsError, match=r"report\[1\]\.report: vllm#1 is judged twice"):
        ur.load(_record(tmp_path, GOOD + GOOD), "9.9.9")


def test_make_status_lists_the_reports_with_their_verdicts() -> None:
    out = subprocess.run([sys.executable, "-m", "overlay", "status"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    reports = ur.load(REPO_PATCHES, DEFAULT)
    assert f"Upstream reports judged on {DEFAULT}'s GLM-5 path ({DEFAULT}/{ur.FILE}:" in out
    for r in reports:
        assert f"  {r.report}: {r.verdict}: {r.title}\n" in out
        for e in r.evidence:
            assert f"    evidence: {e.path}:{e.line}\n" in out


@pytest.mark.parametrize("release", carried_releases(REPO_PATCHES))
def test_rebase_md_and_the_engine_guide_name_each_report(release: str) -> None:
    """``REBASE.md`` gives each judged report with its verdict; the engine guide names its cases."""
    reports = ur.load(REPO_PATCHES, release)
    if not reports:
        pytest.skip(f"{release} judges no upstream report")
    rebase = (REPO_PATCHES / release / "REBASE.md").read_text()
    guide = (REPO / "docs" / "engine" / "README.md").read_text()
    for r in reports:
        assert f"`{r.report}`: {r.verdict}" in rebase, f"{release}/REBASE.md does not give {r.report}: {r.verdict}"
        for case in r.engine_cases:
            assert f"`{case}`" in guide, f"docs/engine/README.md does not name {case} ({r.report})"


def test_a_record_that_is_not_toml_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ur.ReportsError, match=r"^9\.9\.9/upstream-reports\.toml: not TOML: "):
        ur.load(_record(tmp_path, "[[report]\n"), "9.9.9")
    (tmp_path / "9.9.9" / ur.FILE).write_bytes(GOOD.replace("\n", "\r\n").encode())
    with pytest.raises(ur.ReportsError, match=r"^9\.9\.9/upstream-reports\.toml:1: CRLF line endings"):
        ur.load(tmp_path, "9.9.9")


def test_each_test_id_is_collected() -> None:
    """Each test id a record names is one pytest collects, parameters and all (``problems`` checks the file and
    the function; a parameter id that no longer exists is caught here)."""
    ids = sorted({t for release in carried_releases(REPO_PATCHES) for r in ur.load(REPO_PATCHES, release)
                  for t in r.tests})
    if not ids:
        pytest.skip("no record names a test")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                         cwd=REPO, capture_output=True, text=True)
    collected = set(run.stdout.split())
    assert [t for t in ids if t not in collected] == [], run.stdout[-2000:] + run.stderr[-2000:]
