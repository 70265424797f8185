"""``make cherry-pick REF=...``: add an upstream change to the series, with ``Origin:`` pointing upstream.

REF is an upstream pull request number (fetched from the vLLM git remote as ``pull/<n>/head``;
the remote is ``$VLLM_REMOTE``, default GitHub), a commit of that remote, or a patch file.
The change is cut down to the files the wheel ships (upstream's ``tests/``, ``docs/`` ... are
named and left out), applied with ``git apply --3way`` in a scratch repository holding the
pinned base plus the series up to the requested place (default: the end), and the later
patches are checked to still apply on top. Only then are the patch file and the ``series``
line written. A conflict stops with the hunks and leaves ``.work/cherry-pick-<version>/``
to resolve with plain git; ``make cherry-pick-continue`` finishes.

A pick and a continue hold ``.work/.cherry-pick-<version>.lock`` (:mod:`overlay.lock`: a killed one
releases it), and the state file (``.git/overlay-cherry-pick.json``) is written only once a pick
stopped at its conflict. So a tree found without that state, the lock taken, is what a killed pick
left before its conflict: ``make cherry-pick`` removes it (and says so), ``cherry-pick-continue``
says there is nothing to continue and that ``make cherry-pick`` starts again. A continue that was
killed is run again as it is: it first puts the tree back to the resolved conflict (an ``am`` of a
later patch aborted, its own commit undone), and a pick whose patch is already in the series only
has its tree removed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from overlay import lock
from overlay.atomic import write_file
from overlay.build.diffs import parse_diffs
from overlay.build.pins import load_pin, pin_dir
from overlay.build.series import Patch, Series
from overlay.errors import ApplyError, GitError, OverlayError, SeriesError
from overlay.git import git, git_text, operand
from overlay.maintain.replay import ConflictHunk, TreeSource, am, conflict_report, init_base, unmerged
from overlay.maintain.workspace import format_patch, slug

DEFAULT_REMOTE = "https://github.com/vllm-project/vllm.git"
STATE = "overlay-cherry-pick.json"


class CherryPickError(OverlayError):
    """A cherry-pick cannot be done as asked (bad REF, name taken, nothing left to apply)."""


@dataclass
class Change:
    """An upstream change, cut to the package's files, with what it needs to become a patch."""

    diff: bytes
    subject: str
    body: str
    author_name: str
    author_email: str
    author_date: str
    origin: str
    bug: str = ""
    left_out: tuple[str, ...] = ()


@dataclass(frozen=True)
class PickOutcome:
    """A finished cherry-pick (``patch`` written) or one stopped at a conflict."""

    done: bool
    patch: Path | None
    name: str
    conflict: list[ConflictHunk]
    work: Path
    message: str
    left_out: tuple[str, ...] = ()


def remote_url(remote: str | None = None) -> str:
    """The upstream vLLM git remote: ``remote`` (``--remote``), ``$VLLM_REMOTE`` or GitHub; never an option."""
    if remote:
        return operand(remote, "--remote")
    if os.environ.get("VLLM_REMOTE"):
        return operand(os.environ["VLLM_REMOTE"], "VLLM_REMOTE")
    return DEFAULT_REMOTE


def web_url(remote: str) -> str | None:
    """``https://github.com/<org>/<repo>`` for a GitHub remote, else ``None``."""
    m = re.match(r"^(?:https://github\.com/|git@github\.com:|ssh://git@github\.com/)([^/]+)/(.+?)(?:\.git)?/?$",
                 remote)
    return f"https://github.com/{m[1]}/{m[2]}" if m else None


def _origin_commit(remote: str, sha: str) -> str:
    web = web_url(remote)
    return f"upstream, {web}/commit/{sha}" if web else f"upstream, {remote} commit {sha}"


def _pr_url(remote: str, number: int) -> str:
    web = web_url(remote)
    return f"{web}/pull/{number}" if web else f"{remote} pull/{number}/head"


# --- reading REF ---------------------------------------------------------------------------

def _package_dirs(repo: Path) -> list[str]:
    """Top-level folders of the base tree (``vllm``): the paths a patch may touch."""
    names = git_text(["ls-tree", "--name-only", "base"], repo).split()
    return [n for n in names if (repo / n).is_dir()] or names


def _cut(repo: Path, a: str, b: str) -> tuple[bytes, tuple[str, ...]]:
    """The diff ``a..b`` limited to the package, and the paths left out."""
    keep = _package_dirs(repo)
    every = git_text(["diff", "--name-only", "-z", a, b], repo).split("\0")
    left_out = tuple(sorted(p for p in every if p and p.split("/", 1)[0] not in keep))
    diff = git(["diff", "--full-index", "--binary", a, b, "--", *keep], repo).stdout
    return diff, left_out


def _keep_package(diff: bytes, keep: list[str]) -> tuple[bytes, tuple[str, ...]]:
    """Drop the ``diff --git`` sections of a patch file outside the package folders."""
    sections = re.split(rb"(?m)^(?=diff --git )", diff)
    kept, left_out = [sections[0]] if not sections[0].startswith(b"diff --git ") else [], []
    for section in sections:
        if not section.startswith(b"diff --git "):
            continue
        files = parse_diffs(section.decode(errors="replace"), "patch")
        path = files[0].path if files else ""
        if path.split("/", 1)[0] in keep:
            kept.append(section)
        else:
            left_out.append(path)
    return b"".join(kept), tuple(sorted(left_out))


def _commit_meta(repo: Path, rev: str) -> tuple[str, str, str, str, str]:
    fmt = git_text(["log", "-1", "--format=%s%x00%b%x00%an%x00%ae%x00%aI", rev], repo)
    subject, body, name, email, date = fmt.split("\0")
    return subject.strip(), body.strip(), name, email, date.strip()


def _fetch(repo: Path, remote: str, refspecs: list[str], what: str) -> None:
    try:
        git(["fetch", "-q", "--no-tags", "--", operand(remote, "the vLLM remote"), *refspecs], repo)
    except GitError as exc:
        raise CherryPickError(f"cannot fetch {what} from {remote}: {exc.stderr.strip().splitlines()[-1]}") from None


def change_from_pr(repo: Path, remote: str, number: int) -> Change:
    """``pull/<n>/head`` against the remote's default branch: every commit of the PR, squashed."""
    _fetch(repo, remote, [f"+pull/{number}/head:refs/overlay/pr", "+HEAD:refs/overlay/upstream"],
           f"pull request {number}")
    head = git_text(["rev-parse", "refs/overlay/pr"], repo).strip()
    mb = git_text(["merge-base", "refs/overlay/upstream", "refs/overlay/pr"], repo).strip()
    commits = git_text(["rev-list", "--reverse", f"{mb}..{head}"], repo).split()
    if not commits:
        raise CherryPickError(f"pull request {number} has no commits beyond the remote's default branch")
    subject, body, name, email, date = _commit_meta(repo, commits[-1] if len(commits) == 1 else commits[0])
    if len(commits) > 1:
        listed = "\n".join(f"  {git_text(['log', '-1', '--format=%h %s', c], repo).strip()}" for c in commits)
        body = (body + "\n\n" if body else "") + f"Squashed from {len(commits)} commits of the pull request:\n{listed}"
    diff, left_out = _cut(repo, mb, head)
    return Change(diff, subject, body, name, email, date, _origin_commit(remote, head),
                  _pr_url(remote, number), left_out)


def change_from_commit(repo: Path, remote: str, ref: str) -> Change:
    """One upstream commit (fetched by name or id), against its first parent."""
    operand(ref, "REF")
    try:
        _fetch(repo, remote, [f"+{ref}:refs/overlay/commit"], f"commit {ref}")
    except CherryPickError:
        # Servers that refuse unadvertised ids: fetch the branches and tags and look it up.
        _fetch(repo, remote, ["+refs/heads/*:refs/overlay/heads/*", "+refs/tags/*:refs/overlay/tags/*"],
               "the remote's branches")
        if git(["rev-parse", "-q", "--verify", f"{ref}^{{commit}}"], repo, check=False).returncode != 0:
            raise CherryPickError(f"{ref!r} is not a commit of {remote}") from None
        git(["update-ref", "refs/overlay/commit", f"{ref}^{{commit}}"], repo)
    sha = git_text(["rev-parse", "refs/overlay/commit"], repo).strip()
    subject, body, name, email, date = _commit_meta(repo, sha)
    diff, left_out = _cut(repo, f"{sha}^", sha)
    return Change(diff, subject, body, name, email, date, _origin_commit(remote, sha), "", left_out)


def change_from_file(path: Path, origin: str | None) -> Change:
    """A format-patch file (its message and trailers kept) or a plain diff (``origin`` required)."""
    raw = path.read_bytes()
    if raw.startswith(b"From "):
        patch = Patch.from_bytes(path.name, raw, path)
        diff_at = raw.find(b"\ndiff --git ")
        diff = raw[diff_at + 1:]
        m = re.match(r"^(.*?)(?: <([^>]*)>)?$", patch.author)
        date = _header(raw, "Date")
        got_origin = origin or patch.origin or _sha_origin(raw)
        if not got_origin:
            raise CherryPickError(f"{path}: no 'Origin:' trailer and no upstream commit id; pass ORIGIN=<url>")
        body = patch.body
        return Change(diff, patch.subject, body, (m[1] if m else patch.author) or "unknown",
                      (m[2] if m else "") or "unknown@localhost", date, got_origin, patch.bug)
    if not origin:
        raise CherryPickError(f"{path}: a plain diff says nothing of where it comes from; pass ORIGIN=<url>")
    return Change(raw, path.stem.replace("-", " "), "", "unknown", "unknown@localhost", "", origin)


def _header(raw: bytes, key: str) -> str:
    m = re.search(rb"^" + key.encode() + rb": (.+)$", raw.split(b"\n\n", 1)[0], re.M)
    if not m:
        return ""
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(m[1].decode()).isoformat()
    except (TypeError, ValueError):
        return ""


def _sha_origin(raw: bytes) -> str:
    m = re.match(rb"^From ([0-9a-f]{40}) ", raw)
    if m and m[1] != b"0" * 40:
        return _origin_commit(remote_url(), m[1].decode())
    return ""


def ref_file(ref: str) -> Path | None:
    """The patch file ``ref`` names, or ``None`` for a PR number or a commit.

    A REF that looks like a path (starts with '/', '.' or '~', ends with .patch or .diff, or has a
    '/' after a local folder: ``patches/x``) must be a file: a missing one is "no such file", never
    a commit looked up on the network. A '/' alone does not make a path (``refs/tags/v0.28.1``,
    ``releases/v0.28.0`` are upstream refs).
    """
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    head = ref.split("/", 1)[0]
    looks_like_path = (ref.startswith(("/", ".", "~")) or ref.endswith((".patch", ".diff"))
                       or ("/" in ref and Path(head).expanduser().is_dir()))
    if not looks_like_path:
        return None
    if path.is_dir():
        raise CherryPickError(f"{ref}: is a directory, not a patch file")
    raise CherryPickError(f"no such file: {ref}")


# --- the pick --------------------------------------------------------------------------------

def _message(change: Change, today: str) -> str:
    trailers = [f"Origin: {change.origin}"]
    if change.bug:
        trailers.append(f"Bug: {change.bug}")
    trailers.append(f"Last-Update: {today}")
    body = re.sub(r"(?m)^(Origin|Bug|Applied-Upstream|Last-Update|Signed-off-by): .*\n?", "", change.body).strip()
    parts = [change.subject, body] if body else [change.subject]
    if change.left_out:
        parts.append("Upstream files not carried (not in the wheel): " + ", ".join(change.left_out) + ".")
    return "\n\n".join([*parts, "\n".join(trailers)]) + "\n"


def _position(names: list[str], after: str | None, before: str | None) -> int:
    if after and before:
        raise CherryPickError("give AFTER= or BEFORE=, not both")
    for anchor, shift in ((after, 1), (before, 0)):
        if anchor:
            if anchor not in names:
                raise CherryPickError(f"{anchor!r} is not in the series ({', '.join(names) or 'empty'})")
            return names.index(anchor) + shift
    return len(names)


def cherry_pick(
    patches_root: Path,
    version: str,
    ref: str,
    *,
    fill_base: TreeSource,
    work: Path,
    remote: str | None = None,
    name: str | None = None,
    after: str | None = None,
    before: str | None = None,
    origin: str | None = None,
    today: str | None = None,
) -> PickOutcome:
    """Turn ``ref`` into a patch placed in ``patches/<version>/series``; see the module docstring."""
    directory = pin_dir(patches_root, version)
    file = None if ref.isdigit() else ref_file(ref)
    if file is None and not ref.isdigit():
        operand(ref, "REF")
    remote = remote_url(remote)  # refused before anything is set up
    series = Series.load(directory)
    names = [p.name for p in series.patches]
    pos = _position(names, after, before)
    with _held(work):
        if work.exists():
            _clear_or_refuse(work)
        try:
            init_base(work, fill_base, version)
            for patch in series.patches[:pos]:
                am(work, patch, f"vllm {version} with the patches before it")
            git(["tag", "place"], work)
            if ref.isdigit():
                change = change_from_pr(work, remote, int(ref))
            elif file is not None:
                change = change_from_file(file, origin)
                change.diff, change.left_out = _keep_package(change.diff, _package_dirs(work))
            else:
                change = change_from_commit(work, remote, ref)
            if origin:
                change.origin = origin
            if not parse_diffs(change.diff.decode(errors="replace"), ref):
                raise CherryPickError(f"{ref}: changes no file the wheel ships"
                                      + (f" (left out: {', '.join(change.left_out)})" if change.left_out else ""))
            name = name or slug(change.subject)
            if name in names or (directory / name).exists():
                raise CherryPickError(f"{directory / name}: the series already has a patch of that name; pass NAME=")
            Series.parse_names(name, "NAME")  # the same rules as a series line
            state = {"version": version, "patches_root": str(patches_root), "pos": pos, "name": name,
                     "today": today or datetime.date.today().isoformat(),
                     "change": {k: v for k, v in asdict(change).items() if k != "diff"}}  # the diff is applied
            proc = git(["apply", "--3way", "--whitespace=nowarn", "-"], work, input=change.diff, check=False)
            if proc.returncode != 0:
                if unmerged(work):
                    # only now is there something to continue: the state marks a pick stopped at its conflict
                    write_file(work / ".git" / STATE, json.dumps(state, indent=2) + "\n")
                    hunks = conflict_report(work)
                    return PickOutcome(False, None, name, hunks, work, _conflict_message(work, name, hunks),
                                       change.left_out)
                err = proc.stderr.decode(errors="replace").strip().splitlines()
                raise ApplyError(f"{ref}: does not apply to vllm {version}"
                                 + (f" + {pos} patch(es)" if pos else "") + (f": {err[-1]}" if err else ""))
            return _finish(work, state, series)
        except BaseException:
            if work.exists() and not (work / ".git" / STATE).is_file():
                shutil.rmtree(work)
            raise


def _held(work: Path) -> contextlib.AbstractContextManager[None]:
    """The lock of ``work``'s picks and continues (waits for another, saying so)."""
    work.parent.mkdir(parents=True, exist_ok=True)
    return lock.held(work.with_name(f".{work.name}.lock"), f"another cherry-pick in {work}")


def _state(path: Path) -> dict:
    """The state a cherry-pick stopped at a conflict wrote (:mod:`overlay.jsonfile`), its fields checked."""
    from overlay import jsonfile

    doc = jsonfile.read(path, CherryPickError, "a cherry-pick's state")
    for key in ("name", "patches_root", "version"):
        jsonfile.need(doc.get(key), str, key, str(path), CherryPickError)
    change = jsonfile.need(doc.get("change"), dict, "change", str(path), CherryPickError)
    jsonfile.need(change.get("left_out"), list, "change.left_out", str(path), CherryPickError)
    return doc


def _clear_or_refuse(work: Path) -> None:
    """Before a new pick into ``work``, which exists (the lock held, so no pick runs there): refuse when a
    conflict waits to be continued; remove a tree a killed pick left before its conflict, saying so."""
    state = work / ".git" / STATE
    if state.is_file():
        name = _state(state).get("name", "a patch")
        raise CherryPickError(f"{work}: the cherry-pick of {name} stopped at a conflict: resolve it there (edit, "
                              "`git add`) and run `make cherry-pick-continue`, or remove it "
                              f"(rm -rf {work}) to start again")
    print(f"cherry-pick: removing {work}, left by a cherry-pick that was killed before it reached a conflict "
          "(nothing in it to continue)", file=sys.stderr, flush=True)
    shutil.rmtree(work)


def cherry_pick_continue(work: Path) -> PickOutcome:
    """Finish a cherry-pick stopped at a conflict, once a person resolved it with git."""
    with _held(work):
        path = work / ".git" / STATE
        if not work.exists():
            raise CherryPickError(f"no cherry-pick to continue: {work} does not exist (a cherry-pick stopped at a "
                                  "conflict leaves it); start one with `make cherry-pick REF=...`")
        if not path.is_file():
            raise CherryPickError(f"{work}: left by a cherry-pick that was killed before it reached a conflict: "
                                  "nothing to continue; `make cherry-pick REF=...` removes it and starts again")
        state = _state(path)
        series = Series.load(pin_dir(Path(state["patches_root"]), state["version"]))
        if state["name"] in [p.name for p in series.patches]:  # a continue killed after it wrote the series
            shutil.rmtree(work)
            directory = series.directory
            return PickOutcome(True, directory / state["name"], state["name"], [], work,
                               f"{state['name']} was added already (a continue killed before it removed {work})",
                               tuple(state["change"]["left_out"]))
        _undo_killed_finish(work)
        left = unmerged(work)
        if left:
            raise CherryPickError(f"still unmerged: {', '.join(left)} (resolve, `git add`, then continue)")
        return _finish(work, state, series)


def _undo_killed_finish(work: Path) -> None:
    """Put ``work`` back to the resolved conflict where a killed continue left it further on: a later
    patch's ``git am`` aborted, the commits after ``place`` undone with their changes staged."""
    if (work / ".git" / "rebase-apply").exists():
        git(["am", "--abort"], work)
    commits = git_text(["rev-list", "--reverse", "--first-parent", "place..HEAD"], work).split()
    if commits:
        git(["reset", "-q", "--hard", commits[0]], work)  # the pick's own commit, without later patches
        git(["reset", "-q", "--soft", "place"], work)


def _finish(work: Path, state: dict, series: Series) -> PickOutcome:
    change = Change(b"", **{**state["change"], "left_out": tuple(state["change"]["left_out"])})
    git(["add", "-A"], work)
    if git(["diff", "--cached", "--quiet", "place"], work, check=False).returncode == 0:
        raise CherryPickError(f"{state['name']}: the change is already in vllm {state['version']} "
                              "(with the series): nothing to add")
    for line in git_text(["diff", "--cached", "place"], work).splitlines():
        if line.startswith("+<<<<<<< ") or line.startswith("+>>>>>>> "):
            raise CherryPickError(f"{state['name']}: conflict markers are still staged")
    env = {"GIT_AUTHOR_NAME": change.author_name, "GIT_AUTHOR_EMAIL": change.author_email}
    if change.author_date:
        env["GIT_AUTHOR_DATE"] = change.author_date
    git(["commit", "-q", "-F", "-"], work, input=_message(change, state["today"]).encode(), env=env)
    raw = format_patch(work, "HEAD")
    name = state["name"]
    later = series.patches[state["pos"]:]
    for patch in later:
        try:
            am(work, patch, f"vllm {state['version']} with {name} with the patches before it")
        except SeriesError:
            raise ApplyError(f"with {name} at position {state['pos'] + 1}, the later patch {patch.name} no "
                             "longer applies; place it after that patch (AFTER=) or refresh that patch") from None
    directory = series.directory
    Patch.from_bytes(name, raw, directory / name)
    names = [p.name for p in series.patches]
    names.insert(state["pos"], name)
    text = Series.render(names, header_from=(directory / "series").read_text())
    write_file(directory / name, raw)  # the patch first: a series line never names a missing file
    write_file(directory / "series", text)
    shutil.rmtree(work)
    return PickOutcome(True, directory / name, name, [], work, f"added {name} at position {state['pos'] + 1}",
                       change.left_out)


def _conflict_message(work: Path, name: str, hunks: list[ConflictHunk]) -> str:
    lines = [f"conflict: {name} does not merge onto the base; {len(hunks)} hunk(s) to resolve in {work}:"]
    lines += [f"  {h.describe()}" for h in hunks]
    lines.append("resolve there with plain git (edit, `git add <file>`), then run `make cherry-pick-continue`.")
    return "\n".join(lines)


def cherry_pick_release(patches_root: Path, version: str, ref: str, *, work_root: Path = Path(".work"),
                        **kwargs: object) -> PickOutcome:
    """``make cherry-pick REF=...`` against the verified pinned wheel."""
    from overlay.build.fetch import fetch_wheel
    from overlay.maintain.workspace import extract_text_tree

    if not ref.isdigit() and ref_file(ref) is None:  # a missing patch file, a bad ref or remote: before any fetch
        operand(ref, "REF")
    remote_url(kwargs.get("remote"))  # type: ignore[arg-type]
    wheel = fetch_wheel(load_pin(patches_root, version))
    print(f"cherry-pick {ref} onto vllm {version} ...", file=sys.stderr, flush=True)
    return cherry_pick(patches_root, version, ref, fill_base=lambda d: extract_text_tree(wheel, d) and None,
                       work=work_root / f"cherry-pick-{version}", **kwargs)  # type: ignore[arg-type]
