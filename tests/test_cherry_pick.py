"""``make cherry-pick``: from a local upstream remote (``pull/<n>/head`` refs), a commit, a patch file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from overlay.build.apply import apply_series
from overlay.build.series import Series
from overlay.errors import ApplyError
from overlay.git import git, git_text, init_repo
from overlay.maintain.cherry_pick import CherryPickError, cherry_pick, cherry_pick_continue, web_url
from tests.rebasekit import BASE, FROM, fill, lines, make_patch, series_dir

# Upstream's history: the release's files plus what the wheel does not ship (tests/, setup.py).
UPSTREAM = {**BASE, "setup.py": "setup()\n", "tests/test_c.py": "def test_c():\n    pass\n"}


def upstream_remote(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A bare-bones vLLM remote: main moved on after the release; three pull requests."""
    repo = tmp / "upstream"
    init_repo(repo)
    fill(UPSTREAM)(repo)
    git(["add", "-A"], repo)
    git(["commit", "-q", "-m", "v0.1.0"], repo)
    # main after the release: line 18 changed (the wheel does not have it)
    fill({"vllm/c.py": lines("c", 40, l18="c_18 = 'main'")})(repo)
    git(["commit", "-q", "-am", "main: tweak c_18"], repo)
    main = git_text(["rev-parse", "HEAD"], repo).strip()
    refs: dict[str, str] = {}

    def pr(number: int, files: dict[str, str], subject: str, commits: int = 1) -> None:
        git(["checkout", "-q", "-b", f"pr{number}", main], repo)
        for i in range(commits):  # the first commit is the change, later ones review fix-ups
            fill(files if i == 0 else {"setup.py": f"setup()  # {i}\n"})(repo)
            git(["add", "-A"], repo)
            git(["commit", "-q", "-m", f"{subject if i == 0 else f'Address review {i}'}\n\nWhy.\n"],
                repo, env={"GIT_AUTHOR_NAME": "Up Stream", "GIT_AUTHOR_EMAIL": "up@vllm.example"})
            if i == 0:
                refs[f"pr{number}-first"] = git_text(["rev-parse", "HEAD"], repo).strip()
        refs[f"pr{number}"] = git_text(["rev-parse", "HEAD"], repo).strip()
        git(["update-ref", f"refs/pull/{number}/head", "HEAD"], repo)
        git(["checkout", "-q", "main"], repo)

    # 7: changes line 20 (its diff's context carries main's line 18: needs the 3-way merge) and a test
    pr(7, {"vllm/c.py": lines("c", 40, l18="c_18 = 'main'", l20="c_20 = 'fixed'"),
           "tests/test_c.py": "def test_c():\n    assert True\n"}, "Fix c_20 for DCP", commits=2)
    # 8: changes line 35 of a.py, which our series' a.patch also changes: conflict
    pr(8, {"vllm/a.py": lines("a", 40, l35="a_35 = 'upstream'")}, "Fix a_35")
    # 9: only tests
    pr(9, {"tests/test_c.py": "def test_c():\n    assert 1\n"}, "Only a test")
    refs["main"] = main
    return repo, refs


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", {"vllm/a.py": lines("a", 40, l35="a_35 = 'ours'")})})
    remote, refs = upstream_remote(tmp_path)
    return root, remote, refs


def pick(root: Path, tmp: Path, ref: str, remote: Path, **kw: object):
    return cherry_pick(root, FROM, ref, fill_base=fill(BASE), work=tmp / "work" / f"cherry-pick-{FROM}",
                       remote=str(remote), today="2026-12-01", **kw)  # type: ignore[arg-type]


def base_reader(path: str) -> bytes | None:
    return BASE[path].encode() if path in BASE else None


def test_pr_number_from_the_remote(setup, tmp_path: Path) -> None:
    root, remote, refs = setup
    out = pick(root, tmp_path, "7", remote)
    assert out.done and out.name == "fix-c-20-for-dcp.patch"
    assert out.left_out == ("setup.py", "tests/test_c.py")
    series = Series.load(root / FROM)
    assert [p.name for p in series.patches] == ["a.patch", "fix-c-20-for-dcp.patch"]
    new = series.patches[1]
    assert new.trailers == {"Origin": f"upstream, {remote} commit {refs['pr7']}",
                            "Bug": f"{remote} pull/7/head", "Last-Update": "2026-12-01"}
    assert new.touched == ("vllm/c.py",) and new.author == "Up Stream <up@vllm.example>"
    assert "Squashed from 2 commits" in new.body and "tests/test_c.py" in new.body
    changed = apply_series(series.patches, base_reader).changed["vllm/c.py"].decode()
    # the 3-way merge took the PR's line and left main's unrelated line 18 out
    assert "c_20 = 'fixed'" in changed and "c_18 = 18" in changed
    assert not (tmp_path / "work" / f"cherry-pick-{FROM}").exists()


def test_commit_placed_before_a_patch(setup, tmp_path: Path) -> None:
    root, remote, refs = setup
    out = pick(root, tmp_path, refs["pr7-first"], remote, before="a.patch", name="c20.patch")
    assert out.done
    series = Series.load(root / FROM)
    assert [p.name for p in series.patches] == ["c20.patch", "a.patch"]
    assert series.patches[0].origin == f"upstream, {remote} commit {refs['pr7-first']}"
    assert series.patches[0].subject == "Fix c_20 for DCP" and "Bug" not in series.patches[0].trailers
    assert "# test series" in (root / FROM / "series").read_text()


def test_patch_file(setup, tmp_path: Path) -> None:
    root, remote, _ = setup
    # A patch written against the release (no 3-way merge possible: its blobs are not at hand).
    git(["checkout", "-q", "-b", "file", "main~1"], remote)
    fill({"vllm/c.py": lines("c", 40, l20="c_20 = 'fixed'"),
          "tests/test_c.py": "def test_c():\n    pass  # x\n"})(remote)
    git(["commit", "-q", "-am", "Fix c_20\n\nBecause.\n"], remote)
    file = tmp_path / "up.patch"
    file.write_bytes(git(["format-patch", "-1", "--stdout", "HEAD"], remote).stdout)
    out = pick(root, tmp_path, str(file), remote, origin="upstream, https://github.com/vllm-project/vllm/pull/7")
    assert out.done and out.left_out == ("tests/test_c.py",)
    new = Series.load(root / FROM).patches[-1]
    assert new.name == "fix-c-20.patch" and new.subject == "Fix c_20" and new.body.startswith("Because.")
    assert new.origin == "upstream, https://github.com/vllm-project/vllm/pull/7"
    assert new.touched == ("vllm/c.py",)


def test_conflict_stops_then_continue(setup, tmp_path: Path) -> None:
    root, remote, _ = setup
    before = (root / FROM / "series").read_bytes()
    out = pick(root, tmp_path, "8", remote)
    assert not out.done
    assert [(h.path, h.ours, h.theirs) for h in out.conflict] == [("vllm/a.py", 1, 1)]
    assert "make cherry-pick-continue" in out.message
    assert (root / FROM / "series").read_bytes() == before and not (root / FROM / "fix-a-35.patch").exists()
    work = tmp_path / "work" / f"cherry-pick-{FROM}"
    with pytest.raises(CherryPickError, match=r"^still unmerged: vllm/a.py"):
        cherry_pick_continue(work)
    (work / "vllm/a.py").write_text(lines("a", 40, l35="a_35 = 'ours and upstream'"))
    subprocess.run(["git", "-C", str(work), "add", "vllm/a.py"], check=True)
    done = cherry_pick_continue(work)
    assert done.done
    series = Series.load(root / FROM)
    assert [p.name for p in series.patches] == ["a.patch", "fix-a-35.patch"]
    assert b"a_35 = 'ours and upstream'" in apply_series(series.patches, base_reader).changed["vllm/a.py"]


@pytest.mark.parametrize(
    ("ref", "kw", "error", "message"),
    [
        pytest.param("99", {}, CherryPickError, r"^cannot fetch pull request 99 from ", id="unknown-pr"),
        pytest.param("9", {}, CherryPickError, r"^9: changes no file the wheel ships \(left out: tests/test_c.py\)$",
                     id="only-tests"),
        pytest.param("7", {"name": "a.patch"}, CherryPickError, r"the series already has a patch of that name",
                     id="name-taken"),
        pytest.param("7", {"after": "nope.patch"}, CherryPickError, r"^'nope.patch' is not in the series",
                     id="bad-place"),
        pytest.param("8", {"before": "a.patch"}, ApplyError,
                     r"^with fix-a-35.patch at position 1, the later patch a.patch no longer applies",
                     id="breaks-later"),
    ],
)
def test_nothing_written_on_failure(setup, tmp_path: Path, ref: str, kw: dict, error: type, message: str) -> None:
    root, remote, _ = setup
    before = sorted((p.name, p.read_bytes()) for p in (root / FROM).iterdir())
    with pytest.raises(error, match=message):
        pick(root, tmp_path, ref, remote, **kw)
    assert sorted((p.name, p.read_bytes()) for p in (root / FROM).iterdir()) == before
    assert not (tmp_path / "work" / f"cherry-pick-{FROM}").exists()


@pytest.mark.parametrize(
    ("remote", "web"),
    [
        pytest.param("https://github.com/vllm-project/vllm.git", "https://github.com/vllm-project/vllm", id="https"),
        pytest.param("git@github.com:vllm-project/vllm.git", "https://github.com/vllm-project/vllm", id="ssh"),
        pytest.param("/srv/mirrors/vllm", None, id="local"),
    ],
)
def test_web_url(remote: str, web: str | None) -> None:
    assert web_url(remote) == web


@pytest.mark.slow
def test_real_release_change_as_upstream_pr(tmp_path: Path) -> None:
    """The 0.28.0 -> 0.29.0 change of one real file, as pull request 1 of a local remote."""
    from tests.rebasekit import cached_tree, copy_of

    old, new = cached_tree("0.28.0"), cached_tree("0.29.0")
    if old is None or new is None:
        pytest.skip("needs the 0.28.0 and 0.29.0 wheels in the cache")
    path = "vllm/v1/attention/backends/mla/prefill/flashinfer.py"
    trees = {"old": (old / path).read_text(), "new": (new / path).read_text()}
    assert trees["old"] != trees["new"]
    remote = tmp_path / "upstream"
    init_repo(remote)
    fill({path: trees["old"], "tests/test_x.py": "def test_x():\n    pass\n"})(remote)
    git(["add", "-A"], remote)
    git(["commit", "-q", "-m", "v0.28.0"], remote)
    fill({path: trees["new"], "tests/test_x.py": "def test_x():\n    assert 1\n"})(remote)
    git(["commit", "-q", "-am", "[Attention] FlashInfer MLA prefill update\n\nFrom 0.29.0.\n"], remote)
    git(["update-ref", "refs/pull/1/head", "HEAD"], remote)
    git(["reset", "-q", "--hard", "HEAD~1"], remote)  # main stays at the release
    root = tmp_path / "patches"
    series_dir(root, {}, version="0.28.0")
    out = cherry_pick(root, "0.28.0", "1", fill_base=copy_of(old),
                      work=tmp_path / "work", remote=str(remote), today="2026-12-01")
    assert out.done and out.left_out == ("tests/test_x.py",)
    series = Series.load(root / "0.28.0")
    assert [p.touched for p in series.patches] == [(path,)]
    changed = apply_series(series.patches, lambda p: (old / p).read_bytes())
    assert changed.changed[path].decode() == trees["new"]
