"""``make rebase`` judges a patch only by behaviour failures: tests that cannot run on the target (a
harness error) say so and name the file to fix; tests the target contradicts set the patch aside for
a person; a conflicting patch whose tests pass on the target is upstream by behaviour."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from overlay.build.series import Patch, Series
from overlay.maintain.rebase import RebaseError, TestRun, resume, start
from tests.rebasekit import BASE, FROM, TARGET, TARGET_PIN, TO, fill, lines, make_patch, series_dir

APPLIES = {"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'")}  # applies to the target as it is
CLASH = {"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'")}  # the target changed line 10 otherwise

BUG = TestRun("failed", failed=("test_bug",), summary="1 failed", reasons=("assert 'wrong' == 'right'",),
              kinds=("behaviour",))
HARNESS = TestRun("harness", failed=("test_bug",), summary="1 failed",
                  reasons=("TypeError: 'function' object is not subscriptable",), kinds=("harness",),
                  where=("tests/patches/sparse_dcp_harness.py:142",))


def _on_target(tree: Path) -> bool:
    return (tree / "vllm/v1/attention/ops/dcp.py").exists()


def _runner(old: TestRun, target: TestRun):
    def run(patch: Patch, tree: Path) -> TestRun:
        return target if _on_target(tree) else old
    return run


def _rebase(tmp_path: Path, changes: dict[str, str], old: TestRun, target: TestRun):
    root = tmp_path / "patches"
    series_dir(root, {"p.patch": make_patch(tmp_path, "p", changes)})
    work = tmp_path / "work"
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=Path("tests/patches"),
                runner=_runner(old, target))
    report = (root / TO) if out.done else work
    return out, json.loads((report / "rebase.json").read_text())["patches"][0], (report / "REBASE.md").read_text()


def test_tests_that_cannot_run_on_the_target_are_not_a_failure(tmp_path: Path) -> None:
    out, entry, report = _rebase(tmp_path, APPLIES, BUG, HARNESS)
    assert out.done and entry["outcome"] == "applied"
    assert ("its tests cannot run on the target (TypeError: 'function' object is not subscriptable (test_bug, at "
            "tests/patches/sparse_dcp_harness.py:142)): fix tests/patches/test_p.py first") in entry["evidence"]
    assert "still fail" not in entry["evidence"]
    assert "- its tests on the target: cannot run: TypeError: 'function' object is not subscriptable" in report
    assert "  - cannot run there (harness error): `test_bug`" in report
    assert "- its tests on the old base: fail: 1 by behaviour (1 failed)" in report


def test_behaviour_failures_on_the_target_still_say_the_patch_is_needed(tmp_path: Path) -> None:
    out, entry, report = _rebase(tmp_path, APPLIES, BUG, BUG)
    assert out.done and entry["outcome"] == "applied"
    assert "its tests still fail on the target without it (fail: 1 by behaviour (1 failed))" in entry["evidence"]
    assert "  - still failing there: `test_bug`: assert 'wrong' == 'right'" in report


MISSING = TestRun("harness", failed=("test_bug",), summary="1 error",
                  reasons=("ModuleNotFoundError: No module named 'uvloop'",), kinds=("harness",),
                  where=("tests/patches/sparse_dcp_harness.py:20",), environment="/cache/deps/0.1.0-abc")
PASSED = TestRun("passed", passed=("test_bug",), summary="1 passed")


@pytest.mark.parametrize("changes", [APPLIES, CLASH], ids=["applies", "conflicts"])
def test_a_harness_error_on_the_old_base_is_the_tools_failure(tmp_path: Path, changes: dict[str, str]) -> None:
    """Issue 35 item 1: on a fresh clone the old base's tests stopped at a module the test environment
    lacked, and the rebase set the patch aside as a conflict telling the user to fix the test. The
    old base is where the series is built and tested: the rebase stops, in one line naming the module."""
    with pytest.raises(RebaseError) as info:
        _rebase(tmp_path, changes, MISSING, PASSED)
    message = str(info.value)
    assert "\n" not in message and "fix tests" not in message and "conflict" not in message
    assert message.startswith("p.patch: its tests cannot run on the old base")
    assert ("module 'uvloop' is missing from the release's test environment (/cache/deps/0.1.0-abc): "
            "ModuleNotFoundError: No module named 'uvloop' (test_bug, at tests/patches/sparse_dcp_harness.py:20)"
            ) in message
    assert "this tool's failure" in message
    assert not (tmp_path / "work").exists() and not (tmp_path / "patches" / TO).exists()  # nothing set aside
    kept = json.loads((tmp_path / "work-stopped" / "rebase.json").read_text()) if (
        tmp_path / "work-stopped" / "rebase.json").exists() else {"patches": []}
    assert all(p["outcome"] != "conflict" for p in kept["patches"])


def test_another_harness_error_on_the_old_base_names_the_setup_step(tmp_path: Path) -> None:
    with pytest.raises(RebaseError, match=r"a harness error in the tests' setup: TypeError: 'function' object is not "
                                          r"subscriptable \(test_bug, at tests/patches/sparse_dcp_harness.py:142\)"):
        _rebase(tmp_path, APPLIES, HARNESS, PASSED)


def test_tests_all_skipped_on_the_old_base_cannot_tell(tmp_path: Path) -> None:
    skipped = TestRun("skipped", skipped=("test_bug",), skip_reason="needs CUDA GPUs", summary="1 skipped")
    out, entry, _ = _rebase(tmp_path, APPLIES, skipped, PASSED)
    assert out.done and entry["outcome"] == "applied"  # never upstream-by-behaviour on such evidence
    assert "its tests cannot run on the old base (every test skipped: needs CUDA GPUs): they cannot tell" in \
        entry["evidence"]
    assert "fix tests" not in entry["evidence"]


def test_a_conflicting_patch_whose_tests_pass_on_the_target_is_upstream_by_behaviour(tmp_path: Path) -> None:
    passed = TestRun("passed", passed=("test_bug",), summary="1 passed")
    out, entry, _ = _rebase(tmp_path, CLASH, BUG, passed)
    assert out.done and (entry["outcome"], entry["carried"]) == ("upstream-by-behaviour", False)
    assert Series.load(tmp_path / "patches" / TO).patches == ()


def test_a_conflict_that_leaves_nothing_with_tests_that_cannot_run_names_the_file(tmp_path: Path) -> None:
    out, entry, report = _rebase(tmp_path, CLASH, BUG, HARNESS)
    assert not out.done and entry["outcome"] == "conflict"
    tried = {c["name"]: c["why"] for c in entry["candidates"]}
    assert tried["target-side"] == "leaves nothing of the patch"
    assert tried["patch-side"].startswith("with it, its tests cannot run: TypeError")
    assert ("the target's side leaves nothing of the patch, but its tests cannot run on the target (TypeError: "
            "'function' object is not subscriptable (test_bug, at tests/patches/sparse_dcp_harness.py:142)): fix "
            "tests/patches/test_p.py first") in entry["evidence"]
    assert "fix tests/patches/test_p.py first" in report


# Two tests: one shows the bug (fails on the old base), one pins a mode the old base has; the target
# deliberately chose another mode, so the second fails there without the patch.
MODE_OLD = TestRun("failed", passed=("test_mode",), failed=("test_bug",), summary="1 failed, 1 passed",
                   reasons=("assert 'wrong' == 'right'",), kinds=("behaviour",))
MODE_TARGET = TestRun("failed", failed=("test_mode", "test_bug"), summary="2 failed",
                      reasons=("AssertionError: assert 'FULL_AND_PIECEWISE' == 'PIECEWISE'",
                               "assert 'wrong' == 'right'"),
                      kinds=("behaviour", "behaviour"))


def test_a_patch_whose_tests_the_target_contradicts_waits_for_a_person(tmp_path: Path) -> None:
    out, entry, report = _rebase(tmp_path, APPLIES, MODE_OLD, MODE_TARGET)
    assert not out.done and not (tmp_path / "patches" / TO).exists()
    assert (entry["outcome"], entry["carried"]) == ("contradicted", False)
    assert ("1 of its tests pass on the old base and fail on the target without it (e.g. test_mode: AssertionError: "
            "assert 'FULL_AND_PIECEWISE' == 'PIECEWISE'): the target's own behaviour contradicts them"
            ) in entry["evidence"]
    assert entry["candidates"] == []
    assert "| `p.patch` | contradicted | no |" in report and "## To resolve: 1 patch(es) need a person" in report
    assert "contradicted: p.patch's tests contradict the target's own behaviour" in out.message
    assert "git reset --hard HEAD~1" in out.message
    work = tmp_path / "work"
    log = subprocess.run(["git", "-C", str(work), "log", "-1", "--format=%s"], capture_output=True, text=True,
                         check=True).stdout
    assert log.strip() == "Fix p"  # applied as the commit on top, for the person to keep or drop
    done = resume(work)  # kept as it is
    assert done.done, done.message
    kept = json.loads((tmp_path / "patches" / TO / "rebase.json").read_text())["patches"][0]
    assert (kept["outcome"], kept["carried"]) == ("conflict-resolved", True)
    assert kept["evidence"].startswith("its tests contradicted the target's own behaviour; a person resolved it")


def test_a_contradicted_patch_a_person_drops(tmp_path: Path) -> None:
    _rebase(tmp_path, APPLIES, MODE_OLD, MODE_TARGET)
    work = tmp_path / "work"
    subprocess.run(["git", "-C", str(work), "reset", "-q", "--hard", "HEAD~1"], check=True)
    done = resume(work)
    dropped = json.loads((tmp_path / "patches" / TO / "rebase.json").read_text())["patches"][0]
    assert done.done and (dropped["outcome"], dropped["carried"]) == ("conflict-resolved", False)
    assert dropped["evidence"].startswith("its tests contradicted the target's own behaviour; a person resolved it "
                                          "to no change")


def test_a_test_the_target_skips_with_a_reason_does_not_block_upstream_by_behaviour(tmp_path: Path) -> None:
    """flashmla-sparse-dcp on 0.30.0: its localization test skips there (Triton only), the rest pass."""
    old = TestRun("failed", failed=("test_bug", "test_localize"), summary="2 failed",
                  reasons=("assert 1 == 2", "compat.BehaviourFailure: no localize"), kinds=("behaviour", "behaviour"))
    target = TestRun("passed", passed=("test_bug",), skipped=("test_localize",), skip_reason="Triton only",
                     summary="1 passed, 1 skipped")
    out, entry, _ = _rebase(tmp_path, CLASH, old, target)
    assert out.done and entry["outcome"] == "upstream-by-behaviour"
    assert "; 1 skipped there (Triton only)" in entry["evidence"]


def test_tests_all_skipped_on_the_target_cannot_tell(tmp_path: Path) -> None:
    target = TestRun("skipped", skipped=("test_bug",), skip_reason="Triton only", summary="1 skipped")
    out, entry, _ = _rebase(tmp_path, APPLIES, BUG, target)
    assert out.done and entry["outcome"] == "applied"
    assert "its tests cannot run on the target (every test skipped: Triton only)" in entry["evidence"]


def _runs(old: TestRun, new: TestRun) -> dict[str, dict]:
    return {"old-base": old.to_dict(), "target": new.to_dict()}


def _behaviour(failed: tuple[str, ...], passed: tuple[str, ...] = ()) -> TestRun:
    return TestRun("failed" if failed else "passed", passed=passed, failed=failed, summary="",
                   reasons=("assert 1 == 2",) * len(failed), kinds=("behaviour",) * len(failed))


@pytest.mark.parametrize(("old", "new", "expected"), [
    # fails on the old base, passes on the target: upstream by behaviour
    (_behaviour(("t1", "t2")), _behaviour((), ("t1", "t2")), "UPSTREAM_BY_BEHAVIOUR"),
    # a test that passed on the old base fails by behaviour on the target: contradicted
    (_behaviour(("t1",), ("t2",)), _behaviour(("t2",), ("t1",)), "CONTRADICTED"),
    # one of the failing tests passes on the target, one still fails: partial
    (_behaviour(("t1", "t2")), _behaviour(("t2",), ("t1",)), "PARTIAL"),
    # none passes on the target: needed
    (_behaviour(("t1", "t2")), _behaviour(("t1", "t2")), "NEEDED"),
    # nothing fails on the old base: the tests cannot tell
    (_behaviour((), ("t1",)), _behaviour((), ("t1",)), "UNKNOWN"),
    # a harness error on the target only, nothing judged there: unknown, never upstream
    (_behaviour(("t1",)), HARNESS, "UNKNOWN"),
])
def test_each_verdict_of_the_rule_is_a_member_classify_compares(old: TestRun, new: TestRun, expected: str) -> None:
    """classify compares behaviour_verdict's answer with Verdict members (``is``), never with their text:
    every branch of the rule returns a member, so renaming a member's text cannot silently change an
    outcome."""
    from overlay.maintain.rebase.verdict import Verdict, behaviour_verdict

    verdict, *_ = behaviour_verdict(_runs(old, new), "tests/patches/test_x.py")
    assert verdict is Verdict[expected]


OFF_PATH = TestRun("failed", passed=("test_bug",), failed=("test_on_glm5s_path",), summary="1 failed, 1 passed",
                   reasons=("compat.OffModelPath: the switch is on and the merge GLM-5 runs is not projected",),
                   kinds=("off-path",))


def _carried(tmp_path: Path, with_it: TestRun, tests_dir: Path = Path("tests/patches")) -> tuple[dict, str]:
    """Rebase an applying patch whose tests fail on the old base and on the target without it, and give
    ``with_it`` on the target with it; its rebase.json entry and REBASE.md."""
    def run(patch: Patch, tree: Path) -> TestRun:
        if not _on_target(tree):
            return BUG
        return with_it if "a_30 = 'patched'" in (tree / "vllm/a.py").read_text() else BUG

    root = tmp_path / "patches"
    series_dir(root, {"p.patch": make_patch(tmp_path, "p", APPLIES)})
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "work",
                tests_dir=tests_dir, runner=run)
    assert out.done
    return json.loads((root / TO / "rebase.json").read_text())["patches"][0], (root / TO / "REBASE.md").read_text()


def test_a_carried_patch_its_tests_find_off_the_models_path_is_not_kept_silently(tmp_path: Path) -> None:
    """Issue 39 item 5: carried onto the target, the patch's tests with it there find it off the path GLM-5
    runs (compat.OffModelPath): its own outcome, and REBASE.md names where its lines are and says no."""
    entry, report = _carried(tmp_path, OFF_PATH)
    assert entry["outcome"] == "off-model-path" and entry["carried"]
    assert "1 of its tests find it off the path GLM-5 runs (`test_on_glm5s_path`)" in entry["evidence"]
    assert entry["changes"] == ["vllm/a.py: <module>"]
    assert "Changes (on the target): `vllm/a.py: <module>`." in report
    assert "On GLM-5's path: no: 1 of its tests find it off the path GLM-5 runs (`test_on_glm5s_path`)." in report
    assert "  - off the model's path there: `test_on_glm5s_path`" in report


def test_a_carried_patch_its_tests_pass_with_is_kept(tmp_path: Path) -> None:
    entry, report = _carried(tmp_path, PASSED)
    assert entry["outcome"] == "applied" and entry["behaviour"]["target-with-it"]["status"] == "passed"
    assert "On GLM-5's path: not found off it" in report


def test_a_carried_patch_its_path_tests_pass_with_and_fail_without_is_on_the_path(tmp_path: Path) -> None:
    """The tool says "on GLM-5's path" itself (no hand-written ``on_model_path``): the patch's GLM-5 path tests
    (``test_<patch>__glm5_path.py``) all pass with it on the target and fail by behaviour without it. A path test
    that fails with it, or a patch without path tests, is not put on the path."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_p__glm5_path.py").write_text("def test_bug():\n    pass\n\n\ndef helper():\n    pass\n")
    entry, report = _carried(tmp_path / "a", PASSED, tests)
    assert entry["outcome"] == "applied"
    assert entry["on_model_path"] == ("test_p__glm5_path.py on the 0.2.0 tree: 1 passed with it, 1 failed by "
                                      "behaviour without it")
    assert f"On GLM-5's path: yes, by its GLM-5 path tests: {entry['on_model_path']}." in report
    failing = TestRun("failed", passed=("test_other",), failed=("test_bug",), summary="1 failed, 1 passed",
                      reasons=("AssertionError: x",), kinds=("behaviour",))
    assert "on_model_path" not in _carried(tmp_path / "b", failing, tests)[0]
    assert "on_model_path" not in _carried(tmp_path / "c", PASSED)[0]
