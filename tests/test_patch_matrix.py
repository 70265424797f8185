"""``make patch-tests-matrix``: every patch's tests on every release, without and with the patch
(``overlay/maintain/rebase/matrix.py``), on tiny synthetic releases with real pytest runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from overlay.errors import PinError
from overlay.maintain.rebase import TestRun, pytest_runner
from overlay.maintain.rebase.matrix import judge, main, markdown, run_matrix, write_report
from tests.rebasekit import BASE, FROM, TARGET, TO, fill, lines, make_patch, series_dir
from tests.test_rebase import GUARD_FIX, GUARD_TEST

CARRIED = "0.3.0"  # a release whose own series carries one of the patches
TESTS = {
    "guard": GUARD_TEST,
    "a30": "import vllm.a\n\n\ndef test_a30():\n    assert vllm.a.a_30 == 'patched'\n",
    "clash": "import vllm.c\n\n\ndef test_c10():\n    assert vllm.c.c_10 == 'ours'\n",
    "broken": "import vllm.a\n\n\ndef test_harness():\n    vllm.a.helper_gone()\n",
}
CHANGES = {
    "guard": GUARD_FIX,
    "a30": {"vllm/a.py": lines("a", 40, l30="a_30 = 'patched'")},
    "clash": {"vllm/c.py": lines("c", 40, l10="c_10 = 'ours'")},
    "broken": {"vllm/a.py": lines("a", 40, l2="a_2 = 'two'")},
}


@pytest.fixture
def releases(tmp_path: Path) -> tuple[Path, Path, dict[str, Path]]:
    """(patches root, tests folder, release -> tree) for the four-patch series on 0.2.0 and 0.3.0."""
    root = tmp_path / "patches"
    series_dir(root, {f"{n}.patch": make_patch(tmp_path, n, c) for n, c in CHANGES.items()})
    carried_a30 = {"vllm/a.py": TARGET["vllm/a.py"].replace("a_30 = 30", "a_30 = 'patched'")}
    series_dir(root, {"a30.patch": make_patch(tmp_path, "a30-carried", carried_a30, base=TARGET)}, version=CARRIED)
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in TESTS.items():
        (tests / f"test_{name}.py").write_text(text)
    trees = {}
    for version, files in ((FROM, BASE), (TO, TARGET), (CARRIED, TARGET)):
        trees[version] = tmp_path / "trees" / version
        trees[version].mkdir(parents=True)
        fill(files)(trees[version])
    return root, tests, trees


def test_every_patch_on_every_release(releases: tuple[Path, Path, dict[str, Path]], tmp_path: Path) -> None:
    root, tests, trees = releases
    lines_said: list[str] = []
    cells = run_matrix(root, FROM, [TO, CARRIED], trees.__getitem__, pytest_runner(tests), tests_dir=tests,
                       progress=lines_said.append)
    got = {(c.patch.removesuffix(".patch"), c.release): (c.verdict, c.red, c.applied) for c in cells}
    assert got == {
        ("guard", TO): ("passes without it", False, ""),  # the release behaves as its tests expect
        ("a30", TO): ("passes with the patch", False, "3-way merge"),
        ("clash", TO): ("fails", False, ""),  # the patch does not merge: the rebase's job
        ("broken", TO): ("cannot run", True, "3-way merge"),  # a harness error: the tests must follow the release
        ("guard", CARRIED): ("passes without it", False, ""),
        ("a30", CARRIED): ("passes with the patch", False, "carried"),
        ("clash", CARRIED): ("fails", False, ""),
        ("broken", CARRIED): ("cannot run", True, ""),
    }
    why = {(c.patch, c.release): c.why for c in cells}
    assert "it does not merge onto 0.2.0 (conflicts in vllm/c.py)" in why[("clash.patch", TO)]
    assert why[("clash.patch", CARRIED)].endswith("the patch is not applied: patches/0.3.0/ does not carry it")
    assert why[("broken.patch", TO)].startswith("without it: AttributeError: module 'vllm.a' has no attribute "
                                                "'helper_gone' (test_harness, at ")
    assert lines_said[0] == "matrix 0.2.0: 4 patch(es), replayed by 3-way merge"
    assert any(line.startswith("matrix 0.3.0: a30.patch: passes with the patch: ") for line in lines_said)
    report = write_report(tmp_path / "out", cells, [TO, CARRIED], FROM)
    table = report.read_text()
    assert "| `a30` | passes with the patch | passes with the patch |" in table
    assert "| `broken` | **cannot run** | **cannot run** |" in table
    assert (tmp_path / "out" / "matrix.json").is_file()


def test_judge_tells_each_cell() -> None:
    bug = TestRun("failed", passed=("ok",), failed=("t",), reasons=("assert 1 == 2",), kinds=("behaviour",))
    harness = TestRun("harness", failed=("t",), reasons=("TypeError: x",), kinds=("harness",))
    skipped = TestRun("skipped", skipped=("t",), skip_reason="Triton only")
    passed = TestRun("passed", passed=("t",), summary="1 passed")
    assert judge(passed, None)[:2] == ("passes without it", False)
    assert judge(bug, passed) == ("passes with the patch", False, "1 of 2 fail without it (t: assert 1 == 2); 1 pass "
                                                                  "with it")
    assert judge(bug, bug)[:2] == ("fails", True)  # fails with the patch too: red
    assert judge(bug, None, "it does not merge")[:2] == ("fails", False)
    assert judge(harness, None) == ("cannot run", True, "without it: TypeError: x (t)")
    assert judge(skipped, None) == ("cannot run", False, "without it: every test skipped: Triton only")
    assert judge(bug, harness)[:2] == ("cannot run", True)
    off = TestRun("failed", passed=("ok",), failed=("t",), reasons=("compat.OffModelPath: not on the path",),
                  kinds=("off-path",))
    assert judge(bug, off) == ("off the model's path", True, "1 of 2 fail without it (t: assert 1 == 2); with the "
                               "patch 1 find it off the path the model runs (t: compat.OffModelPath: not on the path)")


def test_markdown_marks_red_cells() -> None:
    from overlay.maintain.rebase.matrix import Cell

    cells = [Cell("a.patch", "0.30.0", "passes without it", "3 passed"),
             Cell("a.patch", "0.31.0", "cannot run", "without it: TypeError: x", red=True),
             Cell("a.patch", "0.32.0", "fails", "it does not merge"),
             Cell("a.patch", "0.33.0", "fails", "still fail", red=True, with_patch={"status": "failed"})]
    text = markdown(cells, ["0.30.0", "0.31.0", "0.32.0", "0.33.0"], "0.28.0")
    assert ("| `a` | passes without it | **cannot run** | fails without it; not applied | **fails with the patch** |"
            in text)
    assert "- `a` on 0.31.0: cannot run (red): without it: TypeError: x (0 s)" in text


def test_a_release_that_is_not_a_version_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PinError, match=r"^--releases: '0\.30' is not a release version like 0\.30\.0$"):
        main(tmp_path, "0.28.0", ["0.30"], tmp_path / "out", tmp_path, [])
    proc = subprocess.run([sys.executable, "-m", "overlay", "patch-tests-matrix", "--releases", "latest"],
                          capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: --releases: 'latest' is not a release version like 0.30.0"


def test_the_default_columns_are_the_pinned_releases_newer_than_the_series(tmp_path: Path) -> None:
    """No RELEASES: every release newer than --vllm pinned in patches/ or the test pins, none named in code."""
    from overlay.maintain.rebase.matrix import newer_pinned

    for root, version in ((tmp_path / "patches", "0.28.0"), (tmp_path / "patches", "0.40.0"),
                          (tmp_path / "pins", "0.31.0"), (tmp_path / "patches", "0.27.0")):
        (root / version).mkdir(parents=True)
        (root / version / "pin.toml").write_text("")
    (tmp_path / "patches" / "notes").mkdir()
    assert newer_pinned("0.28.0", [tmp_path / "patches", tmp_path / "pins"]) == ["0.31.0", "0.40.0"]
    assert newer_pinned("0.40.0", [tmp_path / "patches", tmp_path / "pins"]) == []
