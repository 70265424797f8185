"""Test-guided resolution of a patch that conflicts during ``make rebase``.

When the 3-way merge of a patch stops with conflicts, mechanical candidates are built from
the conflicted merge itself:

``target-side``
    every conflicting region takes the target's lines; the rest of the merge (the patch's
    hunks that merged cleanly) is kept, so the patch is rebuilt from its non-conflicting part;
``patch-side``
    every conflicting region takes the patch's lines: the target's change there is dropped. It is
    built and tested, never accepted: the patch's tests say the patch still works, not that what
    upstream changed in those lines (a fix, a new argument) may go. When it passes, the evidence
    says so and names the commit, for the person who decides.

A candidate is accepted only when the patch's own tests pass on the target with it (and do
not already pass there without it: tests that cannot tell the difference judge nothing) and
every later patch that merged onto the target without the candidate still merges with it.
The first such candidate is committed; otherwise the cherry-pick is aborted and the patch is
set aside as ``conflict``. Nothing is ever accepted without a passing test run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.series import Patch
from overlay.git import git, git_text
from overlay.maintain.rebase.testrun import TestRun, describe
from overlay.maintain.replay import FIND_RENAMES, Followed, follow_deleted, in_progress, unmerged

# What git does while it replays: 3-way merge, renames followed down to FIND_RENAMES.
PICK = ["cherry-pick", "--keep-redundant-commits", "-X", f"find-renames={FIND_RENAMES}"]
_START = re.compile(rb"^<{7}(?: |$)")
_BASE = re.compile(rb"^\|{7}(?: |$)")
_MID = re.compile(rb"^={7}$")
_END = re.compile(rb"^>{7}(?: |$)")
SIDES = {"target-side": "the target's lines in every conflicting region, the rest of the patch kept",
         "patch-side": "the patch's lines in every conflicting region, the target's lines there dropped"}


def pick(work: Path, old_commit: str) -> tuple[int, bytes, list[Followed]]:
    """Cherry-pick ``old_commit`` onto ``HEAD``, following files upstream folded into others."""
    proc = git([*PICK, old_commit], work, check=False)
    followed: list[Followed] = []
    if proc.returncode != 0 and unmerged(work):
        followed = follow_deleted(work, old_commit)
        if followed and not unmerged(work):
            git(["cherry-pick", "--continue"], work, env={"GIT_EDITOR": "true"})
    return proc.returncode, proc.stderr, followed


def abort(work: Path) -> None:
    """Abort the cherry-pick in progress, and drop what it left untracked (a file the target
    deleted and the patch changed stays in the worktree otherwise, and blocks the next pick).
    Files excluded in ``.git/info/exclude`` (the report) are kept."""
    git(["cherry-pick", "--abort"], work)
    git(["clean", "-fdq"], work)


def take_side(text: bytes, side: str) -> bytes:
    """``text`` with every conflict-marker region replaced by one side's lines."""
    out: list[bytes] = []
    where = ""  # "", "ours", "base", "theirs"
    for line in text.splitlines(keepends=True):
        bare = line.rstrip(b"\r\n")
        if not where and _START.match(bare):
            where = "ours"
        elif where == "ours" and _BASE.match(bare):
            where = "base"
        elif where in ("ours", "base") and _MID.match(bare):
            where = "theirs"
        elif where == "theirs" and _END.match(bare):
            where = ""
        elif not where or ((where == "ours") == (side == "target-side") and where != "base"):
            out.append(line)
    return b"".join(out)


@dataclass
class Conflicted:
    """What the conflicted merge left, enough to build every candidate from."""

    marked: dict[str, bytes] = field(default_factory=dict)  # path -> worktree text with markers
    stage2: dict[str, bytes | None] = field(default_factory=dict)  # whole-file conflicts: the target's
    stage3: dict[str, bytes | None] = field(default_factory=dict)  # ... and the patch's side (None: deleted)

    @classmethod
    def capture(cls, work: Path) -> Conflicted:
        found = cls()
        for path in unmerged(work):
            text = (work / path).read_bytes() if (work / path).is_file() else b""
            if any(_START.match(ln) for ln in text.splitlines()):
                found.marked[path] = text
                continue
            for stage, into in ((2, found.stage2), (3, found.stage3)):
                proc = git(["show", f":{stage}:{path}"], work, check=False)
                into[path] = proc.stdout if proc.returncode == 0 else None
        return found

    def regions(self) -> int:
        """How many conflicting regions: marker regions, plus one per whole-file conflict."""
        marked = sum(1 for text in self.marked.values() for ln in text.splitlines() if _START.match(ln))
        return marked + len(self.stage2)

    def write(self, work: Path, side: str) -> None:
        """Resolve every unmerged path of the (redone) merge to ``side`` and stage it."""
        for path, text in self.marked.items():
            (work / path).write_bytes(take_side(text, side))
            git(["add", "--", path], work)
        whole = self.stage2 if side == "target-side" else self.stage3
        for path, data in whole.items():
            if data is None:
                git(["rm", "-q", "--cached", "--ignore-unmatch", "--", path], work)
                (work / path).unlink(missing_ok=True)
            else:
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_bytes(data)
                git(["add", "--", path], work)


@dataclass
class Attempt:
    """One candidate tried: how it was built, its test run, the later patches with it."""

    name: str
    description: str
    commit: str = ""
    files: list[str] = field(default_factory=list)
    tests: dict = field(default_factory=dict)  # TestRun.to_dict() on the target with the candidate
    later_lost: list[str] = field(default_factory=list)  # later patches that merge without it, not with it
    accepted: bool = False
    why: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description, "commit": self.commit, "files": self.files,
                "tests": self.tests, "later_lost": self.later_lost, "accepted": self.accepted, "why": self.why}


def later_merging(work: Path, onto: str, later: list[tuple[str, str]]) -> list[str]:
    """Names of the ``later`` (name, old commit) that cherry-pick cleanly, in order, onto ``onto``.

    A later patch that conflicts is skipped, as the real run sets it aside. Runs on a detached
    ``HEAD``; the caller's branch is checked out again afterwards.
    """
    branch = git_text(["symbolic-ref", "-q", "--short", "HEAD"], work).strip()
    clean: list[str] = []
    git(["checkout", "-q", "--detach", onto], work)
    try:
        for name, commit in later:
            if git([*PICK, commit], work, check=False).returncode == 0:
                clean.append(name)
            elif in_progress(work):
                abort(work)
    finally:
        if in_progress(work):
            abort(work)
        git(["checkout", "-q", "-f", branch], work)
    return clean


Runner = Callable[[Patch, Path], TestRun | None]
NOTHING_LEFT = "leaves nothing of the patch"  # a candidate whose tree is the target's as it is


def try_candidates(work: Path, patch: Patch, head: str, old_commit: str, later: list[tuple[str, str]],
                   runner: Runner | None, without: dict | None,
                   tree_at: Callable[[Path, str, Path], Path]) -> tuple[Attempt | None, list[Attempt], str]:
    """Try the candidates for ``patch``, whose cherry-pick onto ``head`` is stopped at a conflict.

    Returns (the accepted attempt or None, every attempt, a note when none could be judged). On
    return the worktree is clean: on the accepted candidate's commit, or back on ``head``.
    ``without`` is the patch's test run on the target without it (``TestRun.to_dict()``).
    """
    conflicted = Conflicted.capture(work)
    abort(work)
    if runner is None:
        return None, [], "no test runs (NO_TESTS), so no candidate could be judged"
    if without and without.get("status") == "passed":
        return None, [], "its tests pass on the target without it too, so they cannot judge a candidate"
    baseline = set(later_merging(work, head, later)) if later else set()
    attempts: list[Attempt] = []
    accepted: Attempt | None = None
    seen: set[str] = set()
    for side, description in SIDES.items():
        attempt = Attempt(side, description)
        attempts.append(attempt)
        pick(work, old_commit)
        if not in_progress(work):  # deterministic merges conflict again; anything else is a surprise
            git(["reset", "-q", "--hard", head], work)
            git(["clean", "-fdq"], work)
            attempt.why = "the merge did not conflict again"
            continue
        conflicted.write(work, side)
        tree = git_text(["write-tree"], work).strip()
        abort(work)
        if tree == git_text(["rev-parse", f"{head}^{{tree}}"], work).strip():
            attempt.why = NOTHING_LEFT
            continue
        if tree in seen:
            attempt.why = "the same tree as an earlier candidate"
            continue
        seen.add(tree)
        message = git_text(["log", "-1", "--format=%B", old_commit], work)
        attempt.commit = git_text(["commit-tree", tree, "-p", head, "-m", message], work,
                                  env=_author_env(work, old_commit)).strip()
        attempt.files = git_text(["diff", "--name-only", head, attempt.commit], work).split()
        with scratch("overlay-rebase-candidate-") as tmp:
            run = runner(patch, tree_at(work, attempt.commit, Path(tmp) / "tree"))
        if run is None:
            attempt.why = "the patch has no tests of its own"
            return None, attempts, "the patch has no tests of its own, so no candidate can be accepted"
        attempt.tests = run.to_dict()
        if attempt.tests["status"] != "passed":
            attempt.why = f"with it, its tests {describe(run)}"
            continue
        if later:
            attempt.later_lost = sorted(baseline - set(later_merging(work, attempt.commit, later)))
        if attempt.later_lost:
            attempt.why = f"later patches no longer merge with it: {', '.join(attempt.later_lost)}"
            continue
        passing = (f"its tests pass on the target with it ({attempt.tests['summary']})"
                   + ("; the later patches still merge" if later else ""))
        if side == "patch-side":
            regions = conflicted.regions()
            attempt.why = (f"{passing}, but it drops the target's lines in {regions} conflicting "
                           f"region(s): not accepted, a person decides (candidate commit {attempt.commit[:12]})")
            continue
        attempt.accepted = True
        attempt.why = passing
        accepted = attempt
        break
    if accepted is not None:
        git(["reset", "-q", "--hard", accepted.commit], work)
    return accepted, attempts, ""


def _author_env(work: Path, commit: str) -> dict[str, str]:
    name, email, date = git_text(["log", "-1", "--format=%an%x00%ae%x00%ad", commit], work).strip().split("\0")
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}
