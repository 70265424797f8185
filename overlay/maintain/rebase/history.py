"""What the rebase's scratch repository says: commits and trees (``rev``, ``tree_at``), where a
commit's added lines are (``changed_methods``), the files it renames or leaves conflict markers in,
and which set-aside patch wrote the lines a later patch rests on (``git blame``)."""

from __future__ import annotations

import re
import shutil
import tarfile
from io import BytesIO
from pathlib import Path

from overlay.build.series import Series
from overlay.git import git, git_text
from overlay.maintain.liveness import enclosing
from overlay.maintain.rebase.state import State


def rev(repo: Path, rev: str) -> str:
    return git_text(["rev-parse", rev], repo).strip()


def clear_worktree(repo: Path) -> None:
    for entry in repo.iterdir():
        if entry.name == ".git":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def tree_at(work: Path, rev: str, dest: Path) -> Path:
    """Check out ``rev`` into ``dest`` without touching the worktree or its index."""
    dest.mkdir(parents=True, exist_ok=True)
    data = git(["archive", "--format=tar", rev], work).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def changed_methods(work: Path, rev: str) -> list[str]:
    """``path: Class.method, ...`` for each Python file commit ``rev`` changes: where its added lines are."""
    out = git_text(["diff", "-U0", "--no-color", f"{rev}~1", rev, "--", "*.py"], work)
    added: dict[str, list[int]] = {}
    path = ""
    for line in out.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else ""
        elif line.startswith("@@") and path:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            if m and (count := int(m.group(2) or 1)):
                added.setdefault(path, []).extend(range(int(m.group(1)), int(m.group(1)) + count))
    found = []
    for path, numbers in sorted(added.items()):
        text = git(["show", f"{rev}:{path}"], work).stdout.decode(errors="replace")
        try:
            names = enclosing(text, numbers)
        except SyntaxError:
            names = ["(does not parse)"]
        found.append(f"{path}: {', '.join(names)}")
    return found


_BLAME_COMMIT = re.compile(r"^([0-9a-f]{40}) \d+ \d+")


def rests_on(work: Path, state: State, series: Series, i: int, aside: list[int], outcome: str) -> str:
    """Evidence that patch ``i`` depends on a set-aside patch: lines it changes or keeps as
    context were written by that patch (``git blame`` on the old series)."""
    if not aside:
        return ""
    writers = {state.old_commits[j]: series.patches[j].name for j in aside}
    hits: dict[str, list[str]] = {}
    for fd in series.patches[i].files:
        if fd.old_path is None:
            continue
        for h in fd.hunks:
            if not h.old_start:
                continue
            span = f"{h.old_start},+{max(h.old_len, 1)}"
            proc = git(["blame", "--porcelain", "-L", span, state.old_commits[i - 1], "--", fd.old_path], work,
                       check=False)
            found = {m[1] for ln in proc.stdout.decode(errors="replace").splitlines()
                     if (m := _BLAME_COMMIT.match(ln))}
            for commit in found & writers.keys():
                hits.setdefault(writers[commit], []).append(f"{fd.old_path} @@ -{h.old_start},{h.old_len}")
    if not hits:
        return ""
    parts = [f"{name} ({', '.join(where)})" for name, where in hits.items()]
    if outcome == "conflict":
        return ("depends on set-aside " + "; ".join(parts) + ": its hunks rest on lines that patch wrote, so it "
                "may conflict only because that patch is missing; resolve that one first")
    return ("rests on lines written by set-aside " + "; ".join(parts)
            + ": check it again once that patch is resolved")


def renames(work: Path, old_commit: str, new_commit: str) -> str:
    old_files = set(git_text(["diff-tree", "--no-commit-id", "--name-only", "-r", old_commit], work).split())
    new_files = set(git_text(["diff-tree", "--no-commit-id", "--name-only", "-r", new_commit], work).split())
    gone, came = sorted(old_files - new_files), sorted(new_files - old_files)
    if not gone:
        return ""
    return f"followed {', '.join(gone)} to {', '.join(came) or 'nothing'}"


def files_with_markers(work: Path) -> list[str]:
    changed = git_text(["diff", "--name-only", "HEAD"], work).split()
    bad = []
    for path in changed:
        file = work / path
        if file.is_file() and any(line.startswith(b"<<<<<<< ") for line in file.read_bytes().splitlines()):
            bad.append(path)
    return bad
