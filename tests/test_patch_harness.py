"""The shared harness of the patch tests (``tests/patches/ranks.py``): a rank's own failure is what a
multi-rank test reports, as the harness's or the behaviour's, even when the other ranks are stopped."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "patches")]
import compat  # noqa: E402
from ranks import fatal_report, spawn_ranks  # noqa: E402


def _rank(rank: int, out: str, kind: str) -> None:
    if rank == 0:
        time.sleep(600)  # waits on rank 1 in a collective that never comes
    error = compat.BehaviourFailure("the code under test raised") if kind == "behaviour" else KeyError("helper")
    try:
        raise error
    except Exception as exc:
        Path(out, f"rank{rank}.json").write_text(json.dumps(fatal_report(exc)))


@pytest.mark.parametrize(("kind", "raised"), [("behaviour", compat.BehaviourFailure), ("harness", compat.HarnessError)])
def test_a_rank_that_fails_stops_the_others_and_is_reported(tmp_path: Path, kind: str, raised: type) -> None:
    t0 = time.monotonic()
    with pytest.raises(raised, match=r"^rank 1: ") as info:
        spawn_ranks(_rank, lambda r, port: (r, str(tmp_path), kind), tmp_path, world=2, timeout=300, grace=2)
    assert time.monotonic() - t0 < 120  # rank 0 stopped after the grace, not at the timeout
    assert "wrote no result" not in str(info.value)


def test_a_rank_stopped_by_vllm_source_that_does_not_compile_reports_the_behaviour(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    broken = tree / "vllm" / "merged.py"
    broken.write_text("def f(:\n    pass\n")
    monkeypatch.setenv("OVERLAY_VLLM_TREE", str(tree))
    try:
        compile(broken.read_text(), str(broken), "exec")
    except SyntaxError as exc:
        in_code = fatal_report(exc)
    helper = tmp_path / "helper.py"
    try:
        compile("def g(:\n", str(helper), "exec")
    except SyntaxError as exc:
        in_harness = fatal_report(exc)
    assert (in_code["fatal_kind"], in_harness["fatal_kind"]) == ("behaviour", "harness")


def _slow(rank: int, out: str) -> None:
    time.sleep(600)


def test_a_rank_that_runs_out_of_time_says_so(tmp_path: Path) -> None:
    """Under load (a rebase beside other test runs on two cores) a rank can outlive the timeout:
    the report says that, not a bare 'exit code -9'."""
    with pytest.raises(compat.HarnessError, match=r"^rank 0 did not finish within 3 s and was killed"), \
            pytest.warns(UserWarning):
        spawn_ranks(_slow, lambda r, port: (r, str(tmp_path)), tmp_path, world=2, timeout=3)


def _slow_the_first_time(rank: int, out: str) -> None:
    """Slow as a loaded machine makes it on the first start (its ranks killed at the timeout), quick after."""
    first = Path(out, f"started{rank}")
    if not first.exists():
        first.write_text("")
        time.sleep(600)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank}))


def test_a_rank_killed_at_its_timeout_is_run_again_once_with_more_time(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35 item 2: a verdict must not hang on machine load. The first start runs out of time; all
    ranks start again with twice the timeout and finish: the run counts, and says it was retried."""
    retries = tmp_path / "retries.jsonl"
    monkeypatch.setenv("OVERLAY_RANK_RETRIES", str(retries))
    with pytest.warns(UserWarning, match=r"rank\(s\) 0, 1 killed at their 3 s timeout .* run again with 6 s: finished"):
        reports = spawn_ranks(_slow_the_first_time, lambda r, port: (r, str(tmp_path)), tmp_path, world=2, timeout=3)
    assert reports == [{"rank": 0}, {"rank": 1}]
    (line,) = [json.loads(x) for x in retries.read_text().splitlines()]
    assert (line["ranks"], line["timeout"], line["retry_timeout"], line["then"]) == ([0, 1], 3, 6, "finished")


def test_a_rank_killed_again_counts_as_a_harness_error(tmp_path: Path) -> None:
    again = r"^rank 0 did not finish within 3 s and was killed, nor within 6 s"
    with pytest.raises(compat.HarnessError, match=again), pytest.warns(UserWarning, match="killed again"):
        spawn_ranks(_slow, lambda r, port: (r, str(tmp_path)), tmp_path, world=2, timeout=3)


def test_a_rebase_test_run_says_which_ranks_were_run_again(tmp_path: Path) -> None:
    """The retry reaches the rebase's report: the run's description (REBASE.md, rebase.json) names it."""
    from overlay.maintain.rebase.testrun import describe, run_files

    here = Path(__file__).resolve().parent
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_r.py").write_text(
        "import json\nimport sys\nimport time\nfrom pathlib import Path\n\n"
        f"sys.path[:0] = [{str(here)!r}, {str(here / 'patches')!r}]\n"
        "from ranks import spawn_ranks  # noqa: E402\n\n\n"
        "def work(rank, out):\n    first = Path(out, f'started{rank}')\n    if not first.exists():\n"
        "        first.write_text('')\n        time.sleep(600)\n"
        "    Path(out, f'rank{rank}.json').write_text(json.dumps({'rank': rank}))\n\n\n"
        "def test_ranks(tmp_path):\n"
        "    assert len(spawn_ranks(work, lambda r, port: (r, str(tmp_path)), tmp_path, timeout=3)) == 2\n")
    tree = tmp_path / "tree"
    tree.mkdir()
    run = run_files([tests / "test_r.py"], tree, cwd=tests)
    said = "test_ranks: rank(s) 0, 1 killed at their 3 s timeout, run again with 6 s: finished"
    assert (run.status, run.retried) == ("passed", (said,)), run
    assert describe(run).endswith(f"[{said}]")


def _describe(rank: int, out: str) -> None:
    print(f"rank {rank} says hello")
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "preloaded": sorted(m for m in ("torch", "vllm.config", "vllm.distributed.parallel_state") if m in sys.modules),
        "env": os.environ.get("OVERLAY_TEST_RANK_ENV"), "cwd": os.getcwd()}))


def test_a_rank_starts_with_vllm_imported_and_the_tests_environment_at_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Ranks come from a fork server that imported torch and vLLM once, started before this test's setenv
    (the first spawn of the process starts it): each still sees the test's environment, cwd and prints."""
    (tmp_path / "first").mkdir()
    spawn_ranks(_describe, lambda r, port: (r, str(tmp_path / "first")), tmp_path / "first", world=1, timeout=120)
    monkeypatch.setenv("OVERLAY_TEST_RANK_ENV", "set after the server started")
    reports = spawn_ranks(_describe, lambda r, port: (r, str(tmp_path)), tmp_path, world=2, timeout=120)
    assert [r["preloaded"] for r in reports] == [["torch", "vllm.config", "vllm.distributed.parallel_state"]] * 2
    assert [r["env"] for r in reports] == ["set after the server started"] * 2
    assert [r["cwd"] for r in reports] == [os.getcwd()] * 2
    err = capfd.readouterr().err
    assert "rank 0 says hello" in err and "rank 1 says hello" in err
