"""engine-check --coverage on CPU: every process of a job measured (a fake ``vllm`` package in a temp tree, real
coverage.py), its data combined into per-patch liveness, the judging of declared patches, the report's table,
and the cases' declarations against each release's series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.pins import carried_releases, default_version
from overlay.cli import main
from overlay.engine import check, liveness_run, verdict
from overlay.engine.inputs import EngineCheckError
from overlay.engine.liveness_lines import FORMAT, Lines, load_lines
from overlay.engine.workload import Case, cases, declared_acts
from overlay.maintain import liveness
from overlay.releases import engine_cases
from tests import factskit

REPO = Path(__file__).resolve().parents[2]

# The fake engine: each function's marked line is what a patch could add. ``run`` is what
# tests/engine/fake_run_case.py calls (FAKE_VLLM_RUN): the DCP path runs in a forked worker only, as
# vLLM's attention runs in its workers.
ENGINE = '''\
import multiprocessing
import os
import time


def main_path():
    return "main"  # mark:main


def forked():
    return "fork"  # mark:fork


def spawned():
    return "spawn"  # mark:spawn


def sleeper(flag):
    open(flag, "w").close()  # mark:term
    time.sleep(120)


def in_subprocess():
    return "sub"  # mark:sub


def dcp_path():
    return "dcp"  # mark:dcp


def never():
    return "never"  # mark:never


def worker(dcp):
    if dcp > 1:
        dcp_path()


def run(case):
    p = multiprocessing.get_context("fork").Process(target=worker, args=(case["dcp"],))
    p.start()
    p.join()
    main_path()
    if case["env"].get("FAKE_ENGINE_HANG"):
        time.sleep(3600)
'''

# A driver that starts every kind of process vLLM starts: fork, spawn, one ended by SIGTERM, a subprocess.
DRIVER = '''\
import multiprocessing as mp
import os
import subprocess
import sys
import time

import vllm.engine as e

if __name__ == "__main__":
    e.main_path()
    for method, target in (("fork", e.forked), ("spawn", e.spawned)):
        p = mp.get_context(method).Process(target=target)
        p.start()
        p.join()
        assert p.exitcode == 0, (method, p.exitcode)
    flag = sys.argv[1]
    p = mp.get_context("spawn").Process(target=e.sleeper, args=(flag,))
    p.start()
    while not os.path.exists(flag):
        time.sleep(0.05)
    p.terminate()
    p.join()
    subprocess.run([sys.executable, "-c", "import vllm.engine as e; e.in_subprocess()"], check=True)
'''


def mark(tag: str) -> int:
    return next(i for i, line in enumerate(ENGINE.splitlines(), 1) if line.endswith(f"# mark:{tag}"))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp/tree/vllm/engine.py``, first on the PYTHONPATH the check's children inherit (never the real vllm)."""
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "engine.py").write_text(ENGINE)
    monkeypatch.setenv("PYTHONPATH", str(root))
    return root


def _lines(tmp_path: Path, version: str = "0.0.1+fake") -> Lines:
    engine = "vllm/engine.py"
    return Lines(tmp_path / "liveness.json", "0.0.1", version, ("main.patch", "dcp.patch", "never.patch"),
                 {"never.patch": {engine: [mark("never")]},  # series order, not the file's
                  "main.patch": {engine: [mark("main")]},
                  # a blank line is no statement; a def runs at import: neither counted
                  "dcp.patch": {engine: [mark("dcp") - 1, mark("dcp"), mark("dcp") + 1]}})


def test_every_process_of_a_job_writes_coverage_data(tree: Path, tmp_path: Path) -> None:
    """The job's environment (check.child_env with --coverage's part): the process itself, a forked child
    (ends in os._exit), a spawned one, one ended by SIGTERM and a subprocess are all measured, and only
    the vllm package."""
    (tmp_path / "driver.py").write_text(DRIVER)
    job = tmp_path / "out" / "job"
    env = check.child_env(Case("job"), None, 0, None, liveness_run.job_env(job))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(liveness_run.SITE)
    subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "flag")], env=env, cwd=tmp_path,
                   check=True, timeout=120)
    data_file = liveness_run.combine(job / "coverage")
    assert [p.name for p in (job / "coverage").iterdir()] == [".coverage"]  # the per-process files combined

    from coverage import CoverageData

    from overlay.maintain.liveness import executed

    data = CoverageData(basename=str(data_file))
    data.read()
    assert data.measured_files() and all("/vllm/" in f for f in data.measured_files())  # not driver.py
    ran = executed(data_file)["vllm/engine.py"]
    assert {mark(t) for t in ("main", "fork", "spawn", "term", "sub")} <= ran
    assert mark("never") not in ran and mark("dcp") not in ran

    patches = liveness_run.job_liveness(_lines(tmp_path), data_file, tree)["patches"]
    assert [p["patch"] for p in patches] == ["main.patch", "dcp.patch", "never.patch"]
    assert mark("dcp") - 1 in ran  # the def line ran, at import
    live = {p["patch"]: p for p in patches}
    assert (live["main.patch"]["added"], live["main.patch"]["ran"]) == (1, 1)
    assert (live["dcp.patch"]["added"], live["dcp.patch"]["ran"]) == (1, 0)
    assert (live["never.patch"]["added"], live["never.patch"]["ran"]) == (1, 0)


def test_the_sitecustomize_starts_coverage_and_runs_the_one_it_shadows(tmp_path: Path) -> None:
    """Without site (-S: no .pth, so not coverage's own), importing ours starts coverage.py from
    COVERAGE_PROCESS_START, and a sitecustomize further on the path still runs."""
    import coverage

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(f"open({str(tmp_path / 'shadowed')!r}, 'w').close()\n")
    packages = str(Path(coverage.__file__).parents[1])
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(liveness_run.SITE), str(other), packages])}
    probe = "import sitecustomize, coverage; print(hasattr(coverage.process_startup, 'coverage'))"
    rc = liveness_run.job_env(tmp_path / "job")
    started = subprocess.run([sys.executable, "-S", "-c", probe], env={**env, **rc}, capture_output=True, text=True,
                             check=True, timeout=60)
    assert started.stdout.split() == ["True"] and (tmp_path / "shadowed").is_file()
    idle = subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True, check=True,
                          timeout=60)
    assert idle.stdout.split() == ["False"]


def test_the_rc_file_of_a_job(tmp_path: Path) -> None:
    data = tmp_path / "job" / "coverage"
    data.mkdir(parents=True)
    (data / ".coverage.stale").write_text("x")  # an earlier run's: gone
    env = liveness_run.job_env(tmp_path / "job")
    assert not (data / ".coverage.stale").exists() and data.is_dir()
    from coverage.config import read_coverage_config

    config = read_coverage_config(env["COVERAGE_PROCESS_START"], warn=print)
    assert config.parallel and config.sigterm and config.data_file == str(data / ".coverage")
    assert config.run_include == ["*/vllm/*"] and sorted(config.patch) == ["_exit", "fork"]


@pytest.fixture
def fake_engine(tree: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(check, "RUN_CASE", "tests.engine.fake_run_case")
    monkeypatch.setenv("FAKE_VLLM_RUN", "vllm.engine")
    return tree


def _jobs() -> list[check.Job]:
    return [check.Job(Case("ref", role="reference", acts=("main.patch",)), "ref"),
            check.Job(Case("dcp", dcp=2, acts=("main.patch", "dcp.patch")), "dcp"),
            check.Job(Case("flat", acts=("dcp.patch",)), "flat")]


def test_a_declared_patch_that_ran_nothing_fails_its_case(fake_engine: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    measure = liveness_run.Measure(_lines(tmp_path), out, fake_engine)
    recs = check.run_jobs(_jobs(), tmp_path / "model", out, timeout=60, parallel=3, poll_s=0.05, measure=measure)
    ran = {r["name"]: {p["patch"]: (p["ran"], p["added"]) for p in r["liveness"]["patches"]} for r in recs}
    assert ran["dcp"] == {"main.patch": (1, 1), "dcp.patch": (1, 1), "never.patch": (0, 1)}  # the worker's too
    assert ran["flat"]["dcp.patch"] == (0, 1) and recs[2]["liveness"]["acts"] == ["dcp.patch"]
    summary = verdict.judge(recs, out, None)
    assert [r["verdict"] for r in recs] == ["reference", "pass", "fail"] and summary["verdict"] == "fail"
    # undeclared never.patch ran nothing anywhere: reported, not judged
    assert recs[2]["problems"] == ["liveness: dcp.patch ran none of its 1 added statements in flat "
                                   "(the case declares it must act)"]
    verdict.report(out, summary, recs, {"model": "m"})
    report = (out / "REPORT.md").read_text()
    assert "| case | files measured | main | dcp | never |" in report
    assert "| dcp | 2 | **1/1** | **1/1** | 0/1 |" in report and "| flat | 2 | **0/1** | 0/1 |" not in report
    assert "| flat | 2 | 1/1 | **0/1** | 0/1 |" in report
    # the reference is held to its own declarations too
    recs[0]["liveness"]["acts"] = ["never.patch"]
    assert verdict.judge(recs, out, None)["verdict"] == "fail" and recs[0]["verdict"] == "fail"
    assert recs[0]["problems"] == ["liveness: never.patch ran none of its 1 added statements in ref "
                                   "(the case declares it must act)"]


def test_without_coverage_nothing_changes(fake_engine: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    recs = check.run_jobs(_jobs(), tmp_path / "model", out, timeout=60, parallel=3, poll_s=0.05)
    env = json.loads((out / "flat.env.json").read_text())
    assert str(liveness_run.SITE) not in env["PYTHONPATH"] and not list(out.glob("*/coverage"))
    summary = verdict.judge(recs, out, None)
    assert summary["verdict"] == "pass" and "problems" not in recs[0] and "liveness" not in recs[2]
    verdict.report(out, summary, recs, {"model": "m"})
    assert "liveness" not in (out / "REPORT.md").read_text().lower()


def test_a_job_stopped_at_its_timeout_saves_its_data_first(fake_engine: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's kill under --coverage: SIGTERM (coverage.py saves), then SIGKILL; a plain SIGKILL
    would lose what the hung engine ran."""
    out = tmp_path / "run"
    out.mkdir()
    job = check.Job(Case("hang", env={"FAKE_ENGINE_HANG": "1"}, acts=("main.patch",)), "hang")
    measure = liveness_run.Measure(_lines(tmp_path), out, fake_engine)
    [rec] = check.run_jobs([job], tmp_path / "model", out, timeout=5, poll_s=0.05, measure=measure)
    assert rec["status"] == "timeout"
    assert {p["patch"]: p["ran"] for p in rec["liveness"]["patches"]}["main.patch"] == 1
    assert liveness_run.problems(rec) == []  # a case that did not finish is judged by its status alone
    monkeypatch.setattr(check, "KILL_GRACE_S", 0)
    [rec] = check.run_jobs([job], tmp_path / "model", out, timeout=5, poll_s=0.05, measure=measure)
    assert {p["patch"]: p["ran"] for p in rec["liveness"]["patches"]}["main.patch"] == 0  # only the worker's


def test_the_lines_file_is_checked_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    lines = tmp_path / "liveness.json"
    lines.write_text(json.dumps({"format": FORMAT, "release": "0.28.0", "vllm": "0.28.0+ovlother",
                                 "series": ["a.patch"], "lines": {"a.patch": {}}}))
    with pytest.raises(EngineCheckError, match=r"made for vllm 0.28.0\+ovlother, the engines import 0.28.0\+ovlx"):
        load_lines(lines, "0.28.0+ovlx")
    with pytest.raises(EngineCheckError, match=r"^case c declares b.patch, which is not in the series of vllm"):
        load_lines(lines, "0.28.0+ovlother", [("c", "a.patch"), ("c", "b.patch")])
    assert load_lines(lines, "0.28.0+ovlother", [("c", "a.patch")]).series == ("a.patch",)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(EngineCheckError, match=r"bad.json: not a liveness lines file .*\(not JSON at line 1"):
        load_lines(tmp_path / "bad.json", "x")
    monkeypatch.delenv("OVERLAY_LIVENESS", raising=False)
    with pytest.raises(EngineCheckError, match=r"needs --liveness FILE .* sets OVERLAY_LIVENESS"):
        liveness_run.start(None, tmp_path, [])
    monkeypatch.setenv("OVERLAY_LIVENESS", str(lines))  # the default: refused the same way
    with pytest.raises(EngineCheckError, match=r"made for vllm 0\.28\.0\+ovlother"):
        liveness_run.start(None, tmp_path, [])
    # the command line: one line, exit 2, before a checkpoint is made or an engine started
    rc = main(["engine-check", "--out", str(tmp_path / "out"), "--tp", "1", "--coverage", "--liveness", str(lines),
               "--model", str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: --liveness {lines}: made for vllm 0.28.0+ovlother")
    assert len(err.splitlines()) == 1 and not (tmp_path / "model").exists()


def test_each_case_declares_what_the_patches_change() -> None:
    for release in carried_releases(REPO / "patches"):
        declared = engine_cases.load(release).acts
        series = (REPO / "patches" / release / "series").read_text().split()
        assert set(declared) <= set(series), f"{release}: {set(declared) - set(series)} not in its series"
    acts = {c.name: set(c.acts) for c in cases(2, factskit.facts("0.28.0"))}
    # 0.28.0: the DCP patches at DCP > 1, the spec-cudagraphs patch where it changes something (interleave > 1)
    assert acts["ref-dcp1"] == set() and acts["ref-dcp1-mtp"] == {"spec-decode-prompt-logprobs-graph-pool.patch"}
    assert {"flashmla-sparse-dcp.patch", "dcp-project-before-merge.patch"} <= acts["dcp-agrs-proj0-graph"]
    assert [n for n, a in acts.items() if "flashmla-sparse-dcp-spec-cudagraphs.patch" in a] == [
        "dcp-a2a-direct-proj1-graph-mtp-il16"]
    # 0.34.0: the one merge-and-project helper in every DCP > 1 case, nothing at DCP 1
    late = {c.name: set(c.acts) for c in cases(1, factskit.facts("0.34.0"))}
    assert not any(late.values())
    two = cases(2, factskit.facts("0.34.0"))
    assert [c.name for c in two if "dcp-mla-combine-v-up-proj-helper.patch" in c.acts] == [
        c.name for c in two if c.dcp > 1]
    assert all(not c.acts for c in cases(2, factskit.facts("0.31.0", like="0.33.0")))  # no engine.toml: none
    # the default release's table when no facts are given
    default = default_version(REPO / "patches")
    assert [c.acts for c in cases(2)] == [declared_acts(c, default) for c in cases(2)]
    # not an engine setting: run_case and --reuse see the cases as before
    c = next(c for c in cases(2) if c.acts)
    assert "acts" not in c.to_dict() and Case(**{k: tuple(v) if k == "prompt_lens" else v
                                                 for k, v in c.to_dict().items()}).acts == ()


def test_only_statements_in_function_bodies_count() -> None:
    source = ('"""Doc."""\nimport os\n\nX = 1\n\n\nclass A:\n    """Doc."""\n\n    y = 2\n\n    def m(self):\n'
              '        """Doc."""\n        z = 3\n        if z:\n            return os.sep\n\n        def inner():\n'
              '            return 4\n\n        return inner\n')
    # the module's and the class's own statements (import, X, class, y, def m) run at import
    assert liveness.body_statements(source) == {14, 15, 16, 18, 19, 21}
