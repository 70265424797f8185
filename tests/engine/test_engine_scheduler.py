"""The engine check's job runner on CPU: engines side by side, slots, timeouts, budget, reuse, variants.

Each job runs ``tests/engine/fake_run_case.py`` (the run_case protocol without an engine).
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
import time
from pathlib import Path

import pytest

from overlay.engine import check, verdict
from overlay.engine.workload import Case
from tests import factskit


@pytest.fixture(autouse=True)
def _fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "RUN_CASE", "tests.engine.fake_run_case")


def _job(name: str, role: str = "check", **env: str) -> check.Job:
    return check.Job(Case(name, role=role, env=dict(env)), name)


def _env(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.env.json").read_text())


def test_parallel_jobs_run_at_once_in_their_own_slots(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    jobs = [_job("ref", "reference", FAKE_WAIT_FOR="a"), _job("a", FAKE_WAIT_FOR="ref"), _job("b")]
    seen: list[list[str]] = []
    recs = check.run_jobs(jobs, tmp_path / "model", out, timeout=60, parallel=2, poll_s=0.05,
                          on_change=lambda rs: seen.append([r["name"] for r in rs]))
    assert [(r["name"], r["status"]) for r in recs] == [("ref", "ok"), ("a", "ok"), ("b", "ok")]
    ports = {n: _env(out, n)["VLLM_PORT"] for n in ("ref", "a")}
    caches = {n: _env(out, n)["VLLM_CACHE_ROOT"] for n in ("ref", "a")}
    assert len(set(ports.values())) == 2 and len(set(caches.values())) == 2  # ran side by side, apart
    assert _env(out, "b")["VLLM_PORT"] in ports.values()  # a freed slot is taken again
    assert all(_env(out, n)["NCCL_NVLS_ENABLE"] == "0" for n in ("ref", "a", "b"))
    assert seen[-1] == ["ref", "a", "b"]


def test_one_at_a_time_cannot_run_them_together(tmp_path: Path) -> None:
    # the same pair with --parallel 1: the first job waits for a job that never starts
    jobs = [_job("ref", "reference", FAKE_WAIT_FOR="a", FAKE_WAIT_S="2"), _job("a")]
    recs = check.run_jobs(jobs, tmp_path / "model", tmp_path, timeout=60, parallel=1, poll_s=0.05)
    assert recs[0]["status"] == "crashed" and "never started beside me" in recs[0]["error"]


def test_a_hung_job_is_killed_at_its_timeout_and_the_rest_run(tmp_path: Path) -> None:
    jobs = [_job("ref", "reference"), _job("hang", FAKE_HANG="1"), _job("dead", FAKE_CRASH="ValueError: boom")]
    t0 = time.monotonic()
    recs = check.run_jobs(jobs, tmp_path / "model", tmp_path, timeout=3, parallel=3, poll_s=0.05)
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in recs] == ["ok", "timeout", "crashed"]
    assert recs[2]["error"] == "ValueError: boom" and "no result within 3 s" in recs[1]["error"]


def test_budget_skips_what_cannot_finish_and_cuts_what_runs_past_it(tmp_path: Path) -> None:
    jobs = [_job("ref", "reference", FAKE_HANG="1"), _job("a")]
    recs = check.run_jobs(jobs, tmp_path / "model", tmp_path, timeout=2, parallel=1, budget=3, poll_s=0.05)
    assert [r["status"] for r in recs] == ["timeout", "skipped"] and recs[1]["error"] == "out of budget"
    t0 = time.monotonic()
    recs = check.run_jobs([_job("ref", "reference"), _job("slow", FAKE_HANG="1")], tmp_path / "model", tmp_path,
                          timeout=600, parallel=2, budget=2, poll_s=0.05)
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in recs] == ["ok", "skipped"] and recs[1]["error"].startswith("cut at the budget")


def test_reuse_takes_references_of_the_same_checkpoint_only(tmp_path: Path) -> None:
    first = tmp_path / "first"
    first.mkdir()
    recs = check.run_jobs([_job("ref", "reference"), _job("a")], tmp_path / "model", first, timeout=60, poll_s=0.05)
    verdict.report(first, verdict.judge(recs, first, None), recs, {"model": str(tmp_path / "model")})
    again = tmp_path / "again"
    again.mkdir()
    recs = check.run_jobs([_job("ref", "reference"), _job("a")], tmp_path / "model", again, timeout=60,
                          reuse=first, poll_s=0.05)
    assert recs[0]["reused"] == str(first) and "reused" not in recs[1]
    assert not (again / "ref.env.json").exists() and (again / "ref.json").exists()
    other = tmp_path / "other"
    other.mkdir()
    recs = check.run_jobs([_job("ref", "reference")], tmp_path / "model-2", other, timeout=60, reuse=first,
                          poll_s=0.05)
    assert "reused" not in recs[0] and (other / "ref.env.json").exists()


def test_variant_jobs_run_on_their_tree_and_must_fail_their_way(tmp_path: Path) -> None:
    pytest.importorskip("vllm")  # lay_variant links the installed vllm
    variants = tmp_path / "variants"
    variants.mkdir()
    for name in ("stock", "minus-x", "minus-y"):
        with tarfile.open(variants / f"{name}.tar.gz", "w:gz") as tf:
            src = tmp_path / "envs.py"
            src.write_text(f"# {name}\n")
            tf.add(src, "vllm/envs.py")
    (variants / "variants.json").write_text(json.dumps({"variants": {
        "stock": {"expect": "crash:requires .* LSE", "symptom": "s", "case": "dcp-a2a-direct-proj1-graph-mtp"},
        "minus-x": {"expect": "mismatch", "symptom": "s", "case": "dcp-agrs-proj1-graph"},
        "minus-y": {"expect": "crash:x", "symptom": "needs multicast", "case": None},
    }}))
    out = tmp_path / "run"
    out.mkdir()
    jobs = check.variant_jobs(variants, 2, out)
    assert [j.name for j in jobs] == ["stock--dcp-a2a-direct-proj1-graph-mtp", "minus-x--dcp-agrs-proj1-graph"]
    assert (out / "trees" / "stock" / "vllm" / "envs.py").read_text() == "# stock\n"
    jobs[0] = check.Job(Case(jobs[0].case.name, env={"FAKE_CRASH": "AssertionError: requires the softmax LSE"}),
                        jobs[0].name, tree=jobs[0].tree, expect=jobs[0].expect, variant="stock")
    recs = check.run_jobs([_job("ref", "reference"), *jobs], tmp_path / "model", out, timeout=60, parallel=3,
                          poll_s=0.05)
    env = _env(out, jobs[0].name)
    assert env["PYTHONPATH"].split(":")[0] == str(out / "trees" / "stock") and env["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    summary = verdict.judge(recs, out, None)
    # stock crashed as its report says; minus-x matched the reference although a mismatch was expected
    assert [r["verdict"] for r in recs] == ["reference", "expected-fail", "fail"] and summary["verdict"] == "fail"
    verdict.report(out, summary, recs, {"model": "m"})
    assert "variant, expect mismatch" in (out / "REPORT.md").read_text()
    # one GPU (--tp 1): only variants of DCP 1 cases run; DCP 2 ones are named and left out
    manifest = json.loads((variants / "variants.json").read_text())
    manifest["variants"]["minus-x"]["case"] = "ref-dcp1-mtp"
    (variants / "variants.json").write_text(json.dumps(manifest))
    assert [j.name for j in check.variant_jobs(variants, 1, tmp_path / "run1")] == ["minus-x--ref-dcp1-mtp"]


def test_a_dead_engine_that_does_not_exit_is_stopped_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "FATAL_GRACE_S", 0.5)
    msg = "torch.AcceleratorError: CUDA error: operation failed due to a previous error during capture"
    t0 = time.monotonic()
    recs = check.run_jobs([_job("dead", FAKE_CRASH_HANG=msg)], tmp_path / "model", tmp_path, timeout=120,
                          poll_s=0.05)
    assert time.monotonic() - t0 < 60
    assert recs[0]["status"] == "crashed"
    assert recs[0]["error"].startswith("AcceleratorError: CUDA error: operation failed due to a previous error")


def _variants(tmp_path: Path, table: dict) -> Path:
    variants = tmp_path / "variants"
    variants.mkdir()
    for name in table:
        with tarfile.open(variants / f"{name}.tar.gz", "w:gz") as tf:
            src = tmp_path / "envs.py"
            src.write_text(f"# {name}\n")
            tf.add(src, "vllm/envs.py")
    (variants / "variants.json").write_text(json.dumps({"variants": table}))
    return variants


def test_a_variant_with_several_cases_and_one_that_must_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later release's variant names several cases (``jobs``): the prompt-logprobs fix without it
    must pass under 0.33.0's Model Runner V2 (the fix does nothing there) and mismatch under V1."""
    if importlib.util.find_spec("vllm") is None:  # lay_variant links into the importable vllm: a tiny one
        (tmp_path / "site" / "vllm").mkdir(parents=True)
        (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
    variants = _variants(tmp_path, {"minus-p": {
        "expect": "pass", "symptom": "dead under MRV2", "case": "ref-dcp1-mtp",
        "jobs": [{"expect": "pass", "symptom": "dead under MRV2", "case": "ref-dcp1-mtp"},
                 {"expect": "mismatch", "symptom": "moved under V1", "case": "ref-dcp1-mtp-v1"}]}})
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(check.EngineCheckError, match="no case 'ref-dcp1-mtp-v1' for --tp 1"):
        check.variant_jobs(variants, 1, out)  # 0.28.0's case list has no V1-runner case
    facts = factskit.facts("0.33.0")
    monkeypatch.setenv("FAKE_FACTS", json.dumps(facts.to_dict()))  # the stand-in engine resolves as that release
    jobs = check.variant_jobs(variants, 1, out, facts)
    assert [(j.name, j.expect) for j in jobs] == [("minus-p--ref-dcp1-mtp", "pass"),
                                                   ("minus-p--ref-dcp1-mtp-v1", "mismatch")]
    # the first passes as expected; the second (against its runner's plain run) passes too, where a mismatch
    # was expected: it fails
    refs = [_job("ref", "reference"), _job("ref-dcp1-v1", "reference")]
    recs = check.run_jobs([*refs, *jobs], tmp_path / "model", out, timeout=60, parallel=4, poll_s=0.05)
    summary = verdict.judge(recs, out, None)
    assert [r["verdict"] for r in recs] == ["reference", "reference", "expected-pass", "fail"]
    assert summary["verdict"] == "fail"
    # a variant that must pass and does not: it fails
    crashed = check.Job(Case("ref-dcp1-mtp", env={"FAKE_CRASH": "ValueError: x"}), jobs[0].name, tree=jobs[0].tree,
                        expect="pass", variant="minus-p")
    again = tmp_path / "again"
    again.mkdir()
    recs = check.run_jobs([_job("ref", "reference"), crashed], tmp_path / "model", again, timeout=60, parallel=2,
                          poll_s=0.05)
    verdict.judge(recs, again, None)
    assert [r["verdict"] for r in recs] == ["reference", "fail"]


def test_a_second_check_beside_the_first_takes_other_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checks on one machine at once (0.28.0's and 0.33.0's): OVERLAY_ENGINE_PORT_BASE moves one's ports."""
    case = Case("ref", role="reference")
    assert check.child_env(case, None, slot=1)["VLLM_PORT"] == str(check.PORT_BASE + check.PORT_STRIDE)
    monkeypatch.setenv("OVERLAY_ENGINE_PORT_BASE", "31000")
    assert check.child_env(case, None, slot=1)["VLLM_PORT"] == str(31000 + check.PORT_STRIDE)
