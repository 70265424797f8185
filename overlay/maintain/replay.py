"""Replay one patch onto another tree in a scratch git repository, with a 3-way merge.

Shared by ``make rebase`` and ``make cherry-pick``. The repository's history holds the tree
the patch was written for and the tree it must now apply to, so ``git cherry-pick`` can merge
with rename detection. What git cannot follow on its own, a file whose content upstream
moved into another file (0.29.0 folded ``ops/dcp_alltoall.py`` into ``ops/dcp.py``), is
followed here by *containment*: the target file that holds most of the deleted file's lines
takes the patch's change through ``git merge-file``. Conflicts are described hunk by hunk.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overlay.build.diffs import parse_diffs
from overlay.build.series import Patch
from overlay.errors import SeriesError
from overlay.git import git, git_text

TreeSource = Callable[[Path], None]
"""``fill(dest)`` writes a release's text files into the empty folder ``dest``."""

# Rename threshold for the 3-way merge. Git's default (50%) misses 0.29.0's
# dcp_utils.py -> ops/dcp.py (43% similar: the new file absorbed two others).
FIND_RENAMES = "30%"
# A deleted file is followed into the target file that holds at least this share of its lines.
CONTAINMENT = 0.6
_MARK_START = re.compile(rb"^<{7}(?: |$)")
_MARK_MID = re.compile(rb"^={7}$")
_MARK_END = re.compile(rb"^>{7}(?: |$)")


@dataclass(frozen=True)
class ConflictHunk:
    """One region a person must resolve (line numbers in the worktree file, 1-based)."""

    path: str
    start: int
    end: int
    ours: int  # lines on the target's side
    theirs: int  # lines on the patch's side
    note: str = ""

    def describe(self) -> str:
        if self.start:
            return (f"{self.path}:{self.start}-{self.end}: {self.ours} line(s) of the target against "
                    f"{self.theirs} line(s) of the patch{f' ({self.note})' if self.note else ''}")
        return f"{self.path}: {self.note}"

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "start": self.start, "end": self.end, "ours": self.ours,
                "theirs": self.theirs, "note": self.note}


@dataclass(frozen=True)
class Followed:
    """A deleted file whose change was carried into the file that absorbed its content."""

    old: str
    new: str
    containment: float


def init_base(work: Path, fill: TreeSource, version: str) -> None:
    """Make ``work`` a repository whose first commit (tag ``base``) is the tree ``fill`` writes."""
    work.mkdir()
    git(["init", "-q"], work)
    fill(work)
    git(["add", "-A"], work)
    git(["commit", "-q", "--allow-empty", "-m", f"vllm {version}"], work)
    git(["tag", "base"], work)


def am(repo: Path, patch: Patch, where: str) -> None:
    """Commit ``patch`` on ``HEAD`` with ``git am``; on failure abort it and raise ``SeriesError``."""
    proc = git(["am", "-q", "--keep-cr", "--keep", "-"], repo, input=patch.raw, check=False)
    if proc.returncode != 0:
        git(["am", "--abort"], repo, check=False)
        raise SeriesError(f"patch {patch.name}: does not apply to {where}")


def applies(repo: Path, raw: bytes, *, reverse: bool = False) -> bool:
    """True when ``raw`` applies (or, with ``reverse``, reverse-applies) exactly to the worktree."""
    args = ["apply", "--check", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + ["-"]
    return git(args, repo, input=raw, check=False).returncode == 0


def unmerged(repo: Path) -> list[str]:
    """Paths with unresolved merge entries in the index."""
    out = git_text(["diff", "--name-only", "--diff-filter=U", "-z"], repo)
    return sorted({p for p in out.split("\0") if p})


def in_progress(repo: Path) -> bool:
    """True while a cherry-pick waits to be continued."""
    return git(["rev-parse", "-q", "--verify", "CHERRY_PICK_HEAD"], repo, check=False).returncode == 0


def marker_hunks(repo: Path, path: str) -> list[ConflictHunk]:
    """Conflict-marker regions of ``path`` in the worktree."""
    file = repo / path
    if not file.is_file():
        return []
    hunks: list[ConflictHunk] = []
    start = mid = 0
    for lineno, line in enumerate(file.read_bytes().splitlines(), start=1):
        if _MARK_START.match(line):
            start, mid = lineno, 0
        elif start and _MARK_MID.match(line):
            mid = lineno
        elif start and mid and _MARK_END.match(line):
            hunks.append(ConflictHunk(path, start, lineno, mid - start - 1, lineno - mid - 1))
            start = mid = 0
    return hunks


def _stages(repo: Path, path: str) -> set[int]:
    out = git_text(["ls-files", "-u", "-z", "--", path], repo)
    return {int(entry.split()[2]) for entry in out.split("\0") if entry.strip()}


def conflict_report(repo: Path) -> list[ConflictHunk]:
    """Every unresolved region of the cherry-pick in progress, marker hunks and whole files."""
    report: list[ConflictHunk] = []
    for path in unmerged(repo):
        hunks = marker_hunks(repo, path)
        if hunks:
            report += hunks
            continue
        stages = _stages(repo, path)
        if 2 not in stages:
            note = "changed by the patch, deleted (or moved beyond recognition) in the target"
        elif 3 not in stages:
            note = "deleted by the patch, changed in the target"
        else:
            note = "both sides changed the file and git left no markers (binary or mode conflict)"
        report.append(ConflictHunk(path, 0, 0, 0, 0, note))
    return report


def _lines(data: bytes) -> Counter[bytes]:
    return Counter(ln.strip() for ln in data.splitlines() if ln.strip())


def containment(needle: bytes, haystack: bytes) -> float:
    """Share of ``needle``'s non-blank lines (as a multiset) that ``haystack`` also has."""
    want = _lines(needle)
    total = sum(want.values())
    if not total:
        return 0.0
    have = _lines(haystack)
    return sum(min(n, have[line]) for line, n in want.items()) / total


def absorbing_file(repo: Path, old_content: bytes, candidates: list[str]) -> tuple[str, float] | None:
    """The worktree file among ``candidates`` that holds most of ``old_content``."""
    best: tuple[str, float] | None = None
    for path in candidates:
        file = repo / path
        if not file.is_file():
            continue
        score = containment(old_content, file.read_bytes())
        if best is None or score > best[1]:
            best = (path, score)
    return best


def follow_deleted(repo: Path, old_rev: str, threshold: float = CONTAINMENT) -> list[Followed]:
    """Resolve modify/delete conflicts by merging the patch's change into the absorbing file.

    For each unmerged path that the target deleted and the patch changed, the target file
    (among those the target added or changed since the merge base) that contains at least
    ``threshold`` of the old file's lines gets ``git merge-file <it> <old> <patched>``. A clean
    merge is staged; one with conflicts leaves markers there (and stays for a person).
    """
    repo = repo.resolve()  # the scratch and target paths below are handed to git, which runs in repo
    followed: list[Followed] = []
    pending = [p for p in unmerged(repo) if _stages(repo, p) == {1, 3}]
    if not pending:
        return followed
    # Files the target side brought in: added or modified since the patch's parent.
    changed = git_text(["diff", "--no-renames", "--name-only", "--diff-filter=AM", "-z", f"{old_rev}^", "HEAD"], repo)
    candidates = [p for p in changed.split("\0") if p]
    for path in pending:
        base = git(["show", f":1:{path}"], repo).stdout
        patched = git(["show", f":3:{path}"], repo).stdout
        found = absorbing_file(repo, base, candidates)
        if found is None or found[1] < threshold:
            continue
        target, score = found
        scratch = repo / ".git" / "overlay-follow"
        scratch.mkdir(exist_ok=True)
        (scratch / "base").write_bytes(base)
        (scratch / "patched").write_bytes(patched)
        rc = git(["merge-file", "-L", target, "-L", f"{path} (before the patch)", "-L", f"{path} (patch)",
                  str(repo / target), str(scratch / "base"), str(scratch / "patched")],
                 repo, check=False).returncode
        git(["rm", "-q", "--cached", "--", path], repo)
        if rc == 0:
            git(["add", "--", target], repo)
        else:
            # Leave the target unmerged, with the three sides in the index, so a person sees
            # it in `git status` and resolves it with `git add` like any other conflict.
            ours = git_text(["rev-parse", f"HEAD:{target}"], repo).strip()
            blobs = [git_text(["hash-object", "-w", str(scratch / n)], repo).strip() for n in ("base", "patched")]
            info = (f"0 {'0' * 40}\t{target}\n100644 {blobs[0]} 1\t{target}\n"
                    f"100644 {ours} 2\t{target}\n100644 {blobs[1]} 3\t{target}\n")
            git(["update-index", "--index-info"], repo, input=info.encode())
        followed.append(Followed(path, target, score))
    return followed


def hunk_signatures(raw: bytes) -> list[tuple[str, str, frozenset[bytes], frozenset[bytes]]]:
    """Per hunk: (file, header, removed lines, added lines), lines stripped, blanks dropped."""
    text = raw.decode("utf-8", errors="replace")
    if not text.startswith("diff --git "):
        text = text[text.find("\ndiff --git ") + 1:]
    out: list[tuple[str, str, frozenset[bytes], frozenset[bytes]]] = []
    diffs = parse_diffs(text, "patch")
    lines = text.split("\n")  # as parse_diffs splits: its line numbers index these
    for fd in diffs:
        for h in fd.hunks:
            removed: set[bytes] = set()
            added: set[bytes] = set()
            i = h.line  # 1-based line of the '@@' header; body follows
            old_left, new_left = h.old_len, h.new_len
            while (old_left > 0 or new_left > 0) and i < len(lines):
                line = lines[i]
                i += 1
                if line.startswith("\\"):
                    continue
                tag, body = line[:1], line[1:].strip().encode()
                if tag == "-":
                    old_left -= 1
                    if body:
                        removed.add(body)
                elif tag == "+":
                    new_left -= 1
                    if body:
                        added.add(body)
                else:
                    old_left -= 1
                    new_left -= 1
            out.append((fd.path, lines[h.line - 1].split(" @@")[0] + " @@", frozenset(removed),
                        frozenset(added)))
    return out


def absorbed_hunks(original: bytes, replayed: bytes) -> tuple[list[str], list[str]]:
    """Split the original patch's hunks into (still carried, no longer in the replayed patch).

    A hunk is carried when the replayed patch still removes its removed lines and adds its
    added lines (by content, so moved and renamed hunks count); otherwise the target already
    has that part.
    """
    new = hunk_signatures(replayed)
    new_removed = frozenset().union(*(s[2] for s in new)) if new else frozenset()
    new_added = frozenset().union(*(s[3] for s in new)) if new else frozenset()
    kept: list[str] = []
    gone: list[str] = []
    for path, header, removed, added in hunk_signatures(original):
        label = f"{path} {header}"
        if (removed <= new_removed) and (added <= new_added) and (removed or added):
            kept.append(label)
        else:
            gone.append(label)
    return kept, gone
