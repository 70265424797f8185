"""``make rebase``: classification on tiny synthetic releases, renames, the conflict flow, atomicity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.apply import apply_series
from overlay.build.fetch import fetch_release, sha256_file
from overlay.build.pins import Pin, carried_releases, load_pin
from overlay.build.series import Patch, Series
from overlay.errors import FetchError
from overlay.maintain.rebase import RebaseError, TestRun, pytest_runner, resume, start
from tests.rebasekit import (
    BASE,
    FROM,
    REPO_PATCHES,
    TARGET,
    TARGET_PIN,
    TEST_PINS,
    TO,
    cached_tree,
    copy_of,
    fill,
    lines,
    make_patch,
    series_dir,
)

GUARD_FIX = {"vllm/fix.py": "def guard(meta):\n    return meta.get('decode') if isinstance(meta, dict) "
                            "else getattr(meta, 'decode', None)\n"}
GUARD_TEST = """
import vllm.fix

class Meta:
    decode = 'd'

def test_guard_dict():
    assert vllm.fix.guard({'decode': 'd'}) == 'd'

def test_guard_object():
    assert vllm.fix.guard(Meta()) == 'd'
"""

CASES = {
    # applies exactly (git apply allows the offset the new header brings)
    "applied": ({"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'")}, "applied"),
    # the target has the same change verbatim
    "upstream": ({"vllm/c.py": lines("c", 40, l5="c_5 = 'five'")}, "upstream"),
    # the file was renamed (43%-style similarity): the 3-way merge follows it
    "renamed": ({"vllm/v1/attention/ops/dcp_utils.py": lines("dcp", 40, l20="dcp_20 = 'patched'")},
                "refreshed"),
    # the file was folded into another one: followed by containment
    "absorbed-file": ({"vllm/v1/attention/ops/dcp_alltoall.py": lines("a2a", 30, l15="a2a_15 = 'patched'")},
                      "refreshed"),
    # one of two hunks is already there
    "half": ({"vllm/c.py": lines("c", 40, l5="c_5 = 'five'", l35="c_35 = 'patched'")}, "partly-upstream"),
    # the same line changed differently
    "clash": ({"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'")}, "conflict"),
    # the 3-way merge leaves nothing: upstream has the change, with different context around it
    "same-change-moved-context": ({"vllm/c.py": lines("c", 40, l5="c_5 = 'five'", l28="c_28 = 'up'")},
                                  "upstream"),
}


@pytest.mark.parametrize("case", [pytest.param(k, id=k) for k in CASES])
def test_classification(tmp_path: Path, case: str) -> None:
    changes, want = CASES[case]
    root = tmp_path / "patches"
    name = f"{case}.patch"
    series_dir(root, {name: make_patch(tmp_path, case, changes)})
    work = tmp_path / "work"
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path / "no-tests")
    if want == "conflict":
        assert not out.done and not (root / TO).exists()
        assert [h.path for h in out.conflict] == ["vllm/c.py"]
        assert "vllm/c.py:" in out.message and "make rebase-continue" in out.message
        return
    assert out.done, out.message
    doc = json.loads((root / TO / "rebase.json").read_text())
    assert [(p["name"], p["outcome"]) for p in doc["patches"]] == [(name, want)]
    assert not work.exists()
    series = Series.load(root / TO)
    carried = want in ("applied", "refreshed", "partly-upstream")
    assert [p.name for p in series.patches] == ([name] if carried else [])
    assert Pin.load(root / TO / "pin.toml") == TARGET_PIN
    assert f"| `{name}` | {want} |" in (root / TO / "REBASE.md").read_text()
    if carried:
        # The carried patch applies exactly to the target, which is what `make build` needs.
        applied = apply_series(series.patches, lambda p: TARGET[p].encode() if p in TARGET else None)
        assert applied.changed
    if want == "applied":
        assert (root / TO / name).read_bytes() == (root / FROM / name).read_bytes()


def test_rename_is_followed_into_the_new_path(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"r.patch": make_patch(tmp_path, "r", CASES["renamed"][0])})
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    patch = Patch.load(root / TO / "r.patch")
    assert patch.touched == ("vllm/v1/attention/ops/dcp.py",)
    assert patch.trailers == {"Origin": "vendor", "Last-Update": "2026-11-30"}
    evidence = json.loads((root / TO / "rebase.json").read_text())["patches"][0]["evidence"]
    assert "followed vllm/v1/attention/ops/dcp_utils.py to vllm/v1/attention/ops/dcp.py" in evidence


def test_absorbed_file_is_followed_by_containment(tmp_path: Path) -> None:
    """A file folded into a much larger one (too dissimilar for git's rename detection)."""
    target = {**TARGET, "vllm/v1/attention/ops/dcp.py": lines("dcp", 40) + lines("newdcp", 12),
              "vllm/v1/attention/ops/big.py": lines("big", 150) + lines("a2a", 30)}
    root = tmp_path / "patches"
    series_dir(root, {"f.patch": make_patch(tmp_path, "f", CASES["absorbed-file"][0])})
    start(root, FROM, TARGET_PIN, fill(BASE), fill(target), work=tmp_path / "w", tests_dir=tmp_path)
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "refreshed"
    assert ("followed vllm/v1/attention/ops/dcp_alltoall.py into vllm/v1/attention/ops/big.py "
            "(100% of its lines are there)") in entry["evidence"]
    series = Series.load(root / TO)
    assert series.patches[0].touched == ("vllm/v1/attention/ops/big.py",)
    applied = apply_series(series.patches, lambda p: target[p].encode() if p in target else None)
    assert b"a2a_15 = 'patched'" in applied.changed["vllm/v1/attention/ops/big.py"]


def test_partly_upstream_says_which_part_is_needed(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"half.patch": make_patch(tmp_path, "half", CASES["half"][0])})
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["absorbed"] == ["vllm/c.py @@ -2,7 +2,7 @@"]
    assert entry["still_needed"] == ["vllm/c.py @@ -32,7 +32,7 @@"]
    assert "Still needed: `vllm/c.py @@ -32,7 +32,7 @@`" in (root / TO / "REBASE.md").read_text()


def test_upstream_by_behaviour_runs_the_patch_tests(tmp_path: Path) -> None:
    """The patch's own tests fail on the old base and pass on the target without it: dropped."""
    root = tmp_path / "patches"
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_guard_fix.py").write_text(GUARD_TEST)
    series_dir(root, {"guard-fix.patch": make_patch(tmp_path, "guard", GUARD_FIX)})
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tests,
                runner=pytest_runner(tests))
    assert out.done
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "upstream-by-behaviour"
    assert entry["behaviour"]["old-base"]["status"] == "failed"
    assert entry["behaviour"]["old-base"]["failed"] == ["test_guard_object"]
    assert "object is not subscriptable" in entry["behaviour"]["old-base"]["reasons"][0]
    assert entry["behaviour"]["target"]["status"] == "passed"
    assert Series.load(root / TO).patches == ()


def test_behaviour_partly_upstream(tmp_path: Path) -> None:
    """Of two failing tests, one passes on the target: the patch is carried as partly-upstream."""
    root = tmp_path / "patches"
    series_dir(root, {"two.patch": make_patch(tmp_path, "two", CASES["applied"][0])})

    def runner(patch: Patch, tree: Path) -> TestRun:
        if (tree / "vllm/v1/attention/ops/dcp.py").exists():  # the target
            return TestRun("failed", passed=("test_ag_rs",), failed=("test_a2a",), summary="1 failed, 1 passed")
        return TestRun("failed", failed=("test_ag_rs", "test_a2a"), summary="2 failed")

    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path,
          runner=runner)
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "partly-upstream"
    assert entry["absorbed"] == ["test_ag_rs"] and entry["still_needed"] == ["test_a2a"]
    assert [p.name for p in Series.load(root / TO).patches] == ["two.patch"]


def test_tests_that_fail_differently_on_the_target_are_flagged(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})

    def runner(patch: Patch, tree: Path) -> TestRun:
        if (tree / "vllm/v1/attention/ops/dcp.py").exists():
            return TestRun("failed", failed=("t",), summary="1 failed", reasons=("AttributeError: no 'x'",))
        return TestRun("failed", failed=("t",), summary="1 failed", reasons=("AssertionError: the bug",))

    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path,
          runner=runner)
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "applied"
    assert ("but 1 of them fail differently there (e.g. t: AttributeError: no 'x'), so the tests may not fit "
            "this release") in entry["evidence"]


def test_tests_that_do_not_run_on_the_target_decide_nothing(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})

    def runner(patch: Patch, tree: Path) -> TestRun:
        if (tree / "vllm/v1/attention/ops/dcp.py").exists():
            return TestRun("error", summary="rc=2: ImportError: cannot import name 'X'")
        return TestRun("failed", failed=("t",), summary="1 failed")

    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path,
          runner=runner)
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "applied"
    assert "its tests cannot run on the target (rc=2: ImportError: cannot import name 'X'): fix " in entry["evidence"]


def _stopped_at_clash(tmp_path: Path):
    """A series of a conflicting patch and a later one, its rebase started: (patches root, worktree, outcome)."""
    root = tmp_path / "patches"
    series_dir(root, {
        "clash.patch": make_patch(tmp_path, "clash", CASES["clash"][0]),
        "later.patch": make_patch(tmp_path, "later", {"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'")}),
    })
    work = tmp_path / "work" / f"rebase-{TO}"
    return root, work, start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path)


def test_conflict_flow_end_to_end(tmp_path: Path) -> None:
    """Stop at the conflict, resolve with plain git in the worktree, continue: conflict-resolved."""
    root, work, out = _stopped_at_clash(tmp_path)
    assert not out.done
    assert [(h.path, h.start, h.ours, h.theirs) for h in out.conflict] == [("vllm/c.py", 10, 1, 1)]
    assert not (root / TO).exists() and not list(root.glob(".rebase-*"))
    status = subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True, text=True,
                            check=True).stdout
    assert status.startswith("UU vllm/c.py")
    with pytest.raises(RebaseError, match=r"^clash.patch: still unmerged: vllm/c.py \(resolve"):
        resume(work)
    (work / "vllm/c.py").write_text(lines("c", 40, l5="c_5 = 'five'", l10="c_10 = 'ours and upstream'",
                                          l28="c_28 = 'up'"))
    subprocess.run(["git", "-C", str(work), "add", "vllm/c.py"], check=True)
    done = resume(work)
    assert done.done, done.message
    doc = json.loads((root / TO / "rebase.json").read_text())
    assert [(p["name"], p["outcome"]) for p in doc["patches"]] == [
        ("clash.patch", "conflict-resolved"), ("later.patch", "applied")]
    assert doc["patches"][0]["conflicts"][0]["path"] == "vllm/c.py"
    # the person's line differs from the patch's: ported differently, never "already upstream"
    assert doc["patches"][0]["absorbed"] == [] and "not carried as written (ported differently or dropped by the " \
        "person, not judged upstream): vllm/c.py @@" in doc["patches"][0]["evidence"]
    assert "Already upstream" not in (root / TO / "REBASE.md").read_text()
    series = Series.load(root / TO)
    assert [p.name for p in series.patches] == ["clash.patch", "later.patch"]
    applied = apply_series(series.patches, lambda p: TARGET[p].encode() if p in TARGET else None)
    assert b"c_10 = 'ours and upstream'" in applied.changed["vllm/c.py"]
    assert not work.exists()


def test_conflict_resolved_by_committing_and_markers_refused(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"clash.patch": make_patch(tmp_path, "clash", CASES["clash"][0])})
    work = tmp_path / "w"
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path)
    subprocess.run(["git", "-C", str(work), "add", "vllm/c.py"], check=True)  # markers and all
    with pytest.raises(RebaseError, match=r"^clash.patch: conflict markers left in vllm/c.py$"):
        resume(work)
    (work / "vllm/c.py").write_text(TARGET["vllm/c.py"])  # the person decides upstream's line wins
    subprocess.run(["git", "-C", str(work), "add", "vllm/c.py"], check=True)
    done = resume(work, why="upstream's line  does the same\n")  # WHY=: the person's reason, recorded
    entry = json.loads((root / TO / "rebase.json").read_text())["patches"][0]
    assert done.done and entry["outcome"] == "conflict-resolved" and entry["carried"] is False
    assert "resolved it to no change" in entry["evidence"]
    assert entry["evidence"].endswith("; the person's reason: upstream's line does the same")
    assert entry["reason"] == "upstream's line does the same"


def test_a_set_aside_patch_is_left_out_with_the_reason(tmp_path: Path) -> None:
    """``make rebase-continue LEFT_OUT=1 WHY=...``: the patch the run stopped at goes out of the series, the
    worktree is back on the head it was tried on, the reason is in REBASE.md and rebase.json (never "judged
    already upstream"), and the later patches are classified; ``make status`` says "left out", not upstream."""
    from overlay.maintain.rebase.stale import later_pin_notes
    from overlay.maintain.status import absorbed_in

    root, work, out = _stopped_at_clash(tmp_path)
    assert not out.done and 'LEFT_OUT=1 WHY="..."' in out.message
    assert f'make rebase-continue TO={TO} LEFT_OUT=1 WHY="..."' in (work / "REBASE.md").read_text()
    for blank in ("", " \n "):
        with pytest.raises(RebaseError, match=r"^clash.patch: leaving a patch out needs the reason \(WHY=...\)"):
            resume(work, left_out=blank)
    (work / "vllm/c.py").write_text("half-edited by the person\n")  # undone, as the cherry-pick is
    done = resume(work, left_out="  an opt-in kept on 0.1.0 only:\n its protocol changed upstream ")
    assert done.done, done.message
    doc = json.loads((root / TO / "rebase.json").read_text())
    clash, later = doc["patches"]
    assert (clash["outcome"], clash["carried"], later["outcome"]) == ("left-out", False, "applied")
    assert clash["reason"] == "an opt-in kept on 0.1.0 only: its protocol changed upstream"
    assert clash["evidence"] == ("the 3-way merge conflicted in vllm/c.py; a person left it out of the series: "
                                 "an opt-in kept on 0.1.0 only: its protocol changed upstream")
    assert "reason" not in later and clash["conflicts"][0]["path"] == "vllm/c.py"
    assert [p.name for p in Series.load(root / TO).patches] == ["later.patch"]
    report = (root / TO / "REBASE.md").read_text()
    assert "| `clash.patch` | left-out | no | the 3-way merge conflicted in vllm/c.py |" in report
    assert "a person left it out of the series: an opt-in kept on 0.1.0 only" in report
    assert "already upstream" not in report.split("### `clash.patch`")[1].split("###")[0]
    assert absorbed_in(root, FROM) == {}
    assert [n.describe() for n in later_pin_notes(root, FROM)["clash.patch"]] == [
        f"{TO}: left out: by a person: an opt-in kept on 0.1.0 only: its protocol changed upstream"]


@pytest.mark.parametrize(("args", "message"), [
    (["--left-out"], "LEFT_OUT=1 (--left-out) needs WHY="),
    (["--left-out", "--why", "  "], "LEFT_OUT=1 (--left-out) needs WHY="),
])
def test_left_out_needs_its_reason(tmp_path: Path, args: list[str], message: str) -> None:
    """Refused before any rebase is looked for (exit 1, one line)."""
    proc = subprocess.run([sys.executable, "-m", "overlay", "rebase-continue", "--to", TO, *args],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and "no rebase in progress" not in proc.stderr


def test_nothing_written_on_failure(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})
    work = tmp_path / "w"

    def broken(patch: Patch, tree: Path) -> TestRun:
        raise RuntimeError("runner crashed")

    with pytest.raises(RuntimeError, match="runner crashed"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path, runner=broken)
    assert not work.exists() and sorted(p.name for p in root.iterdir()) == [FROM]


def test_series_that_does_not_apply_to_its_own_base_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    bad = make_patch(tmp_path, "bad", {"vllm/a.py": lines("a", 40, l3="a_3 = 3.0")},
                     base={**BASE, "vllm/a.py": lines("a", 40, l3="a_3 = 'other'")})
    series_dir(root, {"bad.patch": bad})
    with pytest.raises(Exception, match=r"^patch bad.patch: does not apply to vllm 0.1.0 itself"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    assert not (tmp_path / "w").exists() and not (root / TO).exists()


def test_existing_target_folder_or_worktree_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})
    (root / TO).mkdir()
    (root / TO / "series").write_text("a.patch\n")
    with pytest.raises(RebaseError, match=r"0.2.0: already exists \(holds series\); remove it to rebase onto 0.2.0 "
                                          r"again$"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    assert (root / TO / "series").read_text() == "a.patch\n"
    (root / TO / "series").unlink()
    (root / TO / "pin.toml").write_text(Pin(TO, TARGET_PIN.wheel, "cd" * 32).to_toml())
    with pytest.raises(RebaseError, match=r"pin.toml: pins vllm-0.2.0-.*\.whl \(cdcdcdcdcdcd...\), the rebase was "
                                          r"given .* \(abababababab...\)$"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    (root / TO / "pin.toml").unlink()
    (root / TO).rmdir()
    (tmp_path / "w").mkdir()  # no state file: a rebase that stopped before it began (issue 25 item 20)
    with pytest.raises(RebaseError, match=r"a rebase onto 0.2.0 that stopped before it began"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    (tmp_path / "w" / ".git").mkdir()
    (tmp_path / "w" / ".git" / "overlay-rebase.json").write_text("{}")
    with pytest.raises(RebaseError, match=r"a rebase onto 0.2.0 is in progress"):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)


@pytest.mark.parametrize("prepared", ["empty folder", "pin.toml only"])
def test_a_prepared_target_folder_is_filled(tmp_path: Path, prepared: str) -> None:
    """``patches/<to>/`` made by hand (empty, or with the target's pin.toml) is where the release lands."""
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})
    (root / TO).mkdir()
    own_pin = "# pinned by hand\n" + TARGET_PIN.to_toml()
    if prepared == "pin.toml only":
        (root / TO / "pin.toml").write_text(own_pin)
    done = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    assert done.done
    assert sorted(p.name for p in (root / TO).iterdir()) == ["REBASE.md", "a.patch", "pin.toml", "rebase.json",
                                                            "series"]
    assert sorted(p.name for p in root.iterdir()) == [FROM, TO]  # nothing left beside it
    if prepared == "pin.toml only":
        assert (root / TO / "pin.toml").read_text() == own_pin
    assert load_pin(root, TO) == TARGET_PIN


def test_make_rebase_takes_a_prepared_pin_instead_of_the_index(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import overlay.build.fetch
    import overlay.maintain.rebase.release

    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", CASES["applied"][0])})
    (root / TO).mkdir()
    (root / TO / "pin.toml").write_text(TARGET_PIN.to_toml())
    fetched: list[str] = []
    monkeypatch.setattr(overlay.build.fetch, "fetch_wheel",
                        lambda pin: fetched.append(pin.version) or tmp_path / pin.wheel)
    monkeypatch.setattr(overlay.build.fetch, "fetch_release", lambda v: pytest.fail("asked the index"))
    given: list[Pin] = []
    facts: list[dict] = []
    monkeypatch.setattr(overlay.maintain.rebase.release, "start",
                        lambda root, frm, pin, *a, **k: given.append(pin) or facts.append(k["facts"]))
    from tests import factskit  # the two wheels' release facts: 0.28.0's shape, then 0.33.0's

    shapes = iter(["0.28.0", "0.33.0"])
    monkeypatch.setattr(overlay.maintain.rebase.release, "release_facts_of", lambda wheel: factskit.facts(next(shapes)))
    overlay.maintain.rebase.release.rebase_release(root, FROM, TO, work_root=tmp_path / "w", run_tests=False)
    assert fetched == [FROM, TO] and given == [TARGET_PIN]
    assert [facts[0]["from"]["release"], facts[0]["to"]["release"]] == ["0.28.0", "0.33.0"]


def test_fetch_release_trusts_the_index_digest(tmp_path: Path) -> None:
    payload = b"a wheel"
    import hashlib

    good = hashlib.sha256(payload).hexdigest()
    name = "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"

    def download(req: str, dest: Path) -> None:
        assert req == "vllm==9.9.0"
        (dest / name).write_bytes(payload)

    pin, path = fetch_release("9.9.0", cache=tmp_path, downloader=download, index_digest=lambda r: (name, good))
    assert pin == Pin("9.9.0", name, good) and sha256_file(path) == good
    with pytest.raises(FetchError, match=f"sha256 mismatch: expected {'0' * 64}, got {good}"):
        fetch_release("9.9.0", cache=tmp_path / "other", downloader=download,
                      index_digest=lambda r: (name, "0" * 64))
    assert not list((tmp_path / "other" / "wheels").iterdir())


def test_cli_rebase_verbs_are_wired() -> None:
    out = subprocess.run([sys.executable, "-m", "overlay", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for verb in ("rebase", "rebase-continue", "cherry-pick"):
        assert verb in out


def test_status_names_the_release_that_absorbed_a_patch(tmp_path: Path) -> None:
    from overlay.maintain.status import absorbed_in

    root = tmp_path / "patches"
    series_dir(root, {"up.patch": make_patch(tmp_path, "up", CASES["upstream"][0]),
                      "half.patch": make_patch(tmp_path, "half", {"vllm/c.py": lines("c", 40, l35="c_35 = 'p'")}),
                      "kept.patch": make_patch(tmp_path, "kept", CASES["applied"][0])})
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    (root / "junk").mkdir()
    (root / "junk" / "rebase.json").write_text("{not json")
    assert absorbed_in(root, FROM) == {"up.patch": TO}




@pytest.mark.slow
def test_real_releases_rename_dcp_utils_to_dcp(tmp_path: Path) -> None:
    """On the real 0.28.0 -> 0.29.0 trees a patch to ops/dcp_utils.py is carried into ops/dcp.py."""
    from overlay.build.pins import load_pin

    old, new = cached_tree("0.28.0"), cached_tree("0.29.0")
    if old is None or new is None:
        pytest.skip("needs the 0.28.0 and 0.29.0 wheels in the cache (make rebase TO=0.29.0 fetches them)")
    path = "vllm/v1/attention/ops/dcp_utils.py"
    text = (old / path).read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(text) if "def gather(self, local_query" in ln)
    text.insert(at, "    # overlay: a comment the rebase must carry across the rename\n")
    raw = make_patch(tmp_path, "dcp-comment", {path: "".join(text)}, base={path: (old / path).read_text()})
    root = tmp_path / "patches"
    series_dir(root, {"dcp-comment.patch": raw}, version="0.28.0")
    out = start(root, "0.28.0", load_pin(TEST_PINS, "0.29.0"), copy_of(old), copy_of(new),
                work=tmp_path / "w", tests_dir=tmp_path)
    assert out.done, out.message
    entry = json.loads((root / "0.29.0" / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "refreshed"
    assert f"followed {path} to vllm/v1/attention/ops/dcp.py" in entry["evidence"]
    assert Patch.load(root / "0.29.0" / "dcp-comment.patch").touched == ("vllm/v1/attention/ops/dcp.py",)


@pytest.mark.slow
@pytest.mark.parametrize("release", carried_releases(REPO_PATCHES))
def test_committed_series_applies_to_its_wheel(release: str) -> None:
    """Every carried ``patches/<release>`` applies to its pinned wheel, as in ``overlay status --vllm
    <release>``; the wheel is fetched once into the cache and verified."""
    from overlay.build.fetch import fetch_wheel
    from overlay.build.pins import load_pin
    from overlay.maintain.status import series_status

    pin = load_pin(REPO_PATCHES, release)
    wheel = fetch_wheel(pin)
    assert sha256_file(wheel) == pin.sha256
    rows = series_status(REPO_PATCHES, release, base_wheel=wheel)
    assert [r.name for r in rows] == [p.name for p in Series.load(REPO_PATCHES / release).patches]
    assert rows and all(r.applies for r in rows), [(r.name, r.detail) for r in rows if not r.applies]


def test_absorbed_file_conflict_with_a_relative_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folded file's merge conflicts and the work dir is relative (as `.work/rebase-<to>` is):
    the conflict is left staged in the absorbing file, not a failing ``git hash-object``."""
    target = {**TARGET, "vllm/v1/attention/ops/dcp.py": lines("dcp", 40) + lines("newdcp", 12),
              "vllm/v1/attention/ops/big.py": lines("big", 150) + lines("a2a", 30, l15="a2a_15 = 'upstream'")}
    root = tmp_path / "patches"
    series_dir(root, {"f.patch": make_patch(tmp_path, "f", CASES["absorbed-file"][0])})
    monkeypatch.chdir(tmp_path)
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(target), work=Path("w"), tests_dir=tmp_path)
    assert not out.done and not (root / TO).exists()
    assert "vllm/v1/attention/ops/big.py" in {h.path for h in out.conflict}, out.message
