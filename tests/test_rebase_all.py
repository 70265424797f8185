"""``make rebase`` classifies every patch in one run, resolves conflicts its tests can judge, and
``make status`` says when a later pin carries an older version of a patch (issue 15)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from overlay.build.apply import apply_series
from overlay.build.series import Series
from overlay.maintain.rebase import pytest_runner, resume, start
from overlay.maintain.rebase.resolve import take_side
from overlay.maintain.rebase.stale import later_pin_notes, sha256_of
from overlay.maintain.status import PatchStatus, format_table
from tests.rebasekit import BASE, FROM, TARGET, TARGET_PIN, TO, fill, lines, make_patch, series_dir

A30 = {"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'")}
A2 = {"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'", l20="a_20 = 'patched'")}
CLASH = {"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'")}
# Rests on CLASH's line 10 (context) and changes line 11: conflicts on the target only because CLASH
# is not there.
ON_CLASH = {"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'", l11="c_11 = c_10 + '!'")}
# A conflicting hunk (line 10) beside the change its tests check (line 35).
TWO_PART = {"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'", l35="c_35 = 'patched'")}


def porcelain(work: Path) -> str:
    return subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True, text=True,
                          check=True).stdout


def four(tmp_path: Path) -> Path:
    root = tmp_path / "patches"
    series_dir(root, {
        "one.patch": make_patch(tmp_path, "one", A30),
        "clash.patch": make_patch(tmp_path, "clash", CLASH),
        "on-clash.patch": make_patch(tmp_path, "on-clash", ON_CLASH, base={**BASE, **CLASH}),
        "four.patch": make_patch(tmp_path, "four", A2, base={**BASE, **A30}),
    })
    return root


def test_patch_two_of_four_conflicts_and_every_patch_is_classified(tmp_path: Path) -> None:
    root = four(tmp_path)
    work = tmp_path / "work" / f"rebase-{TO}"
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path / "no-tests")
    assert not out.done and not (root / TO).exists()  # exit 2: a person's turn
    doc = json.loads((work / "rebase.json").read_text())
    assert [(p["name"], p["outcome"]) for p in doc["patches"]] == [
        ("one.patch", "applied"), ("clash.patch", "conflict"), ("on-clash.patch", "conflict"),
        ("four.patch", "applied")]
    assert doc["pending"] == ["clash.patch", "on-clash.patch"]
    later = doc["patches"][2]["evidence"]
    assert "depends on set-aside clash.patch (vllm/c.py @@ -8,7)" in later
    assert "may conflict only because that patch is missing" in later
    assert "depends on" not in doc["patches"][3]["evidence"]
    assert all(p["source_sha256"] == sha256_of((root / FROM / p["name"]).read_bytes()) for p in doc["patches"])
    report = (work / "REBASE.md").read_text()
    assert "## To resolve: 2 patch(es) need a person" in report
    assert "| `four.patch` | applied | yes |" in report
    assert "| `on-clash.patch` | conflict | no |" in report and "(depends on set-aside `clash.patch`)" in report
    assert "2 need(s) a person: clash.patch, on-clash.patch" in out.message
    # The worktree waits on the first set-aside patch, as `make rebase-continue` expects; the report
    # stays out of git's way there.
    assert porcelain(work) == "UU vllm/c.py\n"
    assert [(h.path, h.start) for h in out.conflict] == [("vllm/c.py", 10)]

    (work / "vllm/c.py").write_text(lines("c", 40, l5="c_5 = 'five'", l10="c_10 = 'ours'", l28="c_28 = 'up'"))
    subprocess.run(["git", "-C", str(work), "add", "vllm/c.py"], check=True)
    done = resume(work)
    assert done.done, done.message
    doc = json.loads((root / TO / "rebase.json").read_text())
    assert [(p["name"], p["outcome"]) for p in doc["patches"]] == [
        ("one.patch", "applied"), ("clash.patch", "conflict-resolved"), ("on-clash.patch", "applied"),
        ("four.patch", "applied")]
    assert doc["pending"] == [] and not work.exists()
    series = Series.load(root / TO)
    applied = apply_series(series.patches, lambda p: TARGET[p].encode() if p in TARGET else None)
    assert b"c_11 = c_10 + '!'" in applied.changed["vllm/c.py"]


C35_TEST = """
import vllm.c

def test_c35():
    assert vllm.c.c_35 == 'patched'
"""
# Only a person's merge of both sides passes this: upstream's value of line 10, and the patch's mark.
MERGED_TEST = """
import vllm.c

def test_c10_is_both():
    assert str(vllm.c.c_10).startswith('upstream') and str(vllm.c.c_10).endswith('ours')
"""


def with_tests(tmp_path: Path, name: str, text: str) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / f"test_{name.replace('-', '_')}.py").write_text(text)
    return tests


def test_candidate_that_passes_the_tests_is_auto_resolved(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"two-part.patch": make_patch(tmp_path, "two-part", TWO_PART),
                      "later.patch": make_patch(tmp_path, "later", A30)})
    tests = with_tests(tmp_path, "two-part", C35_TEST)
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tests,
                runner=pytest_runner(tests))
    assert out.done, out.message
    doc = json.loads((root / TO / "rebase.json").read_text())
    entry = doc["patches"][0]
    assert (entry["outcome"], entry["carried"]) == ("auto-resolved", True)
    assert "candidate target-side" in entry["evidence"] and "its tests pass on the target with it" in entry["evidence"]
    assert "the later patches still merge" in entry["evidence"]
    accepted = [c for c in entry["candidates"] if c["accepted"]]
    assert [c["name"] for c in accepted] == ["target-side"]
    assert accepted[0]["tests"]["status"] == "passed" and accepted[0]["tests"]["passed"] == ["test_c35"]
    assert doc["patches"][1]["outcome"] == "applied"
    series = Series.load(root / TO)
    assert [p.name for p in series.patches] == ["two-part.patch", "later.patch"]
    applied = apply_series(series.patches, lambda p: TARGET[p].encode() if p in TARGET else None)
    c = applied.changed["vllm/c.py"]
    assert b"c_35 = 'patched'" in c and b"c_10 = 'upstream ten'" in c  # the target's side of the conflict
    assert "candidate target-side" in (root / TO / "REBASE.md").read_text()


def test_a_run_killed_mid_way_leaves_what_it_classified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report is in the worktree after every patch, not only at the end of the run."""
    import overlay.maintain.rebase.classify as rebase

    root = four(tmp_path)
    work = tmp_path / "work" / f"rebase-{TO}"
    real = rebase._classify

    def killed_at_four(work_: Path, state: object, patch: Series, *args: object, **kwargs: object) -> object:
        if patch.name == "four.patch":
            raise KeyboardInterrupt
        return real(work_, state, patch, *args, **kwargs)

    monkeypatch.setattr(rebase, "_classify", killed_at_four)
    with pytest.raises(KeyboardInterrupt):
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path / "no-tests")
    # The scratch worktree is gone (a new `make rebase` may start), the report is kept beside it.
    assert not work.exists()
    kept = work.with_name(work.name + "-stopped")
    doc = json.loads((kept / "rebase.json").read_text())
    assert [(p["name"], p["outcome"]) for p in doc["patches"]] == [
        ("one.patch", "applied"), ("clash.patch", "conflict"), ("on-clash.patch", "conflict")]
    assert doc["in_progress"] == {"classified": 3, "unclassified": ["four.patch"]}
    assert "**In progress** (or stopped): 3 of 4 patches classified; not yet: four.patch." in (
        kept / "REBASE.md").read_text()


def _clash_stays_conflict(tmp_path: Path, test_text: str) -> tuple[Path, dict]:
    """Rebase the one-patch series whose line 10 conflicts, judged by ``test_text``; it must stay a conflict."""
    root = tmp_path / "patches"
    series_dir(root, {"clash.patch": make_patch(tmp_path, "clash", TWO_PART)})
    tests = with_tests(tmp_path, "clash", test_text)
    work = tmp_path / "w"
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tests,
                runner=pytest_runner(tests))
    assert not out.done and not (root / TO).exists()
    entry = json.loads((work / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "conflict" and entry["carried"] is False
    return work, entry


def test_no_candidate_passes_so_the_conflict_stays(tmp_path: Path) -> None:
    work, entry = _clash_stays_conflict(tmp_path, MERGED_TEST)
    tried = {c["name"]: c for c in entry["candidates"]}
    assert set(tried) == {"target-side", "patch-side"}
    assert not any(c["accepted"] for c in tried.values())
    assert all(c["tests"]["status"] == "failed" for c in tried.values())
    assert "target-side: with it, its tests fail: 1 by behaviour" in entry["evidence"]
    assert porcelain(work) == "UU vllm/c.py\n"


# Passes with the patch's side of the line-10 conflict only (upstream's change there dropped).
PATCH_SIDE_TEST = """
import vllm.c

def test_c10_is_ours():
    assert vllm.c.c_10 == 'ours'
"""


def test_patch_side_candidate_is_never_accepted_even_when_its_tests_pass(tmp_path: Path) -> None:
    """Taking the patch's lines drops what upstream changed there: a person decides, with the evidence."""
    work, entry = _clash_stays_conflict(tmp_path, PATCH_SIDE_TEST)
    tried = {c["name"]: c for c in entry["candidates"]}
    assert tried["target-side"]["tests"]["status"] == "failed"
    patch_side = tried["patch-side"]
    assert patch_side["tests"]["status"] == "passed" and not patch_side["accepted"]
    assert "drops the target's lines in 1 conflicting region(s): not accepted, a person decides" in patch_side["why"]
    assert patch_side["commit"][:12] in patch_side["why"]
    assert porcelain(work) == "UU vllm/c.py\n"


def test_no_tests_no_acceptance(tmp_path: Path) -> None:
    """Without a test run (NO_TESTS=1) a candidate is never accepted."""
    root = tmp_path / "patches"
    series_dir(root, {"two-part.patch": make_patch(tmp_path, "two-part", TWO_PART)})
    work = tmp_path / "w"
    out = start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path)
    assert not out.done
    entry = json.loads((work / "rebase.json").read_text())["patches"][0]
    assert entry["outcome"] == "conflict" and "no candidate could be judged" in entry["evidence"]


@pytest.mark.parametrize(("side", "want"), [
    pytest.param("target-side", b"a\nT\nz\n", id="target"),
    pytest.param("patch-side", b"a\nP\nz\n", id="patch"),
])
def test_take_side(side: str, want: bytes) -> None:
    text = b"a\n<<<<<<< HEAD\nT\n||||||| base\nB\n=======\nP\n>>>>>>> patch\nz\n"
    assert take_side(text, side) == want


def test_staleness_detected_and_cleared(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"one.patch": make_patch(tmp_path, "one", A30),
                      "mod.patch": make_patch(tmp_path, "mod", {"vllm/c.py": lines("c", 40, l35="c_35 = 'v1'")})})
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w", tests_dir=tmp_path)
    assert later_pin_notes(root, FROM) == {}
    # The base pin's patch gets a second version, and a new patch joins the series.
    (root / FROM / "mod.patch").write_bytes(
        make_patch(tmp_path, "mod2", {"vllm/c.py": lines("c", 40, l35="c_35 = 'v2'")}))
    (root / FROM / "new.patch").write_bytes(make_patch(tmp_path, "new", A2, base={**BASE, **A30}))
    (root / FROM / "series").write_text("one.patch\nmod.patch\nnew.patch\n")
    notes = later_pin_notes(root, FROM)
    assert sorted(notes) == ["mod.patch", "new.patch"]
    (stale,) = notes["mod.patch"]
    assert (stale.pin, stale.state) == (TO, "stale")
    assert stale.detail.startswith("carries an older version (rebased from sha256 ")
    assert notes["new.patch"][0].state == "missing"
    row = PatchStatus("mod.patch", "Fix mod2", "vendor", "python", ("vllm/c.py",), True, "", "",
                      tuple(n.describe() for n in notes["mod.patch"]))
    assert f"    later pin {TO}: stale: carries an older version" in format_table([row], FROM)
    # A hand port that records the source it was ported from clears it ...
    copy = root / TO / "mod.patch"
    current = sha256_of((root / FROM / "mod.patch").read_bytes())
    raw = copy.read_bytes().replace(b"Last-Update: 2026-11-30\n",
                                    b"Last-Update: 2026-11-30\nRebased-From: " + current.encode() + b"\n", 1)
    copy.write_bytes(raw)
    assert sorted(later_pin_notes(root, FROM)) == ["new.patch"]
    # ... and so does rebasing again.
    import shutil

    shutil.rmtree(root / TO)
    start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=tmp_path / "w2", tests_dir=tmp_path)
    assert later_pin_notes(root, FROM) == {}
