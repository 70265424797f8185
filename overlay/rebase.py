"""``make rebase TO=x.y.z``: carry the series onto another vLLM release, and say what upstream took.

A scratch repository ``.work/rebase-<to>/`` gets the history the replay needs: the base
release's text files (tag ``base``), the series on top as commits (branch ``old``), and the
target release as a commit on top of the base (tag ``target``, branch ``new``). Each patch is
then classified, in series order, on ``new``:

``upstream``
    it reverse-applies to the target, or the 3-way merge leaves nothing to commit;
``upstream-by-behaviour``
    its own tests (``tests/patches/test_<name>.py``) fail on the old base and pass on the
    target without it: upstream fixed the bug its own way, the patch is dropped;
``applied``
    it applies exactly (the file is carried verbatim);
``refreshed``
    it applies after a 3-way merge with rename detection (the refreshed patch is exported);
``partly-upstream``
    carried, but part of it is already there (hunks the target has, or tests that already pass);
``conflict`` / ``conflict-resolved``
    the merge stopped: the run reports the hunks and leaves the worktree for plain git;
    ``make rebase-continue`` picks up after a person resolved it.

Nothing is written under ``patches/<to>/`` until every patch is classified: the folder is
written under a temporary name and renamed. Tests drive :func:`start` and :func:`resume`
with tree-filling callables and a fake test runner; the CLI uses :func:`rebase_release`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlay.errors import KernelPatchError, OverlayError
from overlay.git import git, git_text
from overlay.pins import Pin, load_pin, pin_dir
from overlay.rebase_resolve import abort, pick, try_candidates
from overlay.rebase_stale import later_pin_notes, sha256_of
from overlay.replay import (
    ConflictHunk,
    TreeSource,
    absorbed_hunks,
    am,
    applies,
    conflict_report,
    in_progress,
    init_base,
    unmerged,
)
from overlay.series import Patch, Series
from overlay.swap import exchange
from overlay.workspace import extract_text_tree, format_patch

STATE = "overlay-rebase.json"  # inside the scratch repository's .git: survives git commands


class RebaseError(OverlayError):
    """A rebase cannot start or continue (state missing, unresolved paths, target exists)."""


@dataclass(frozen=True)
class TestRun:
    """One run of a patch's own tests against one tree."""

    __test__ = False  # not a pytest test class, whatever its name

    status: str  # "passed" (rc 0), "failed" (rc 1: tests ran, some failed), "error" (did not run)
    passed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    summary: str = ""
    reasons: tuple[str, ...] = ()  # per failed test, the first line of its failure message

    def to_dict(self) -> dict[str, object]:
        return {"status": self.status, "passed": list(self.passed), "failed": list(self.failed),
                "summary": self.summary, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, d: dict) -> TestRun:
        return cls(d["status"], tuple(d["passed"]), tuple(d["failed"]), d["summary"], tuple(d.get("reasons", ())))


TestRunner = Callable[[Patch, Path], TestRun | None]
"""``run(patch, tree)`` runs the patch's tests with ``import vllm`` resolving to ``tree``;
``None`` when the patch has no tests."""


def test_file(tests_dir: Path, patch_name: str) -> Path:
    """``tests/patches/test_<name>.py`` for ``<name>.patch`` (dashes become underscores)."""
    return tests_dir / f"test_{patch_name.removesuffix('.patch').replace('-', '_')}.py"


def test_files(tests_dir: Path, patch_name: str) -> list[Path]:
    """A patch's test files: ``test_<name>.py`` and its parts ``test_<name>__<part>.py``."""
    main = test_file(tests_dir, patch_name)
    return [main, *sorted(main.parent.glob(f"{main.stem}__*.py"))]


def pytest_runner(tests_dir: Path, *, cwd: Path | None = None, timeout: float = 900) -> TestRunner:
    """Run a patch's :func:`test_files` in a subprocess with ``OVERLAY_VLLM_TREE=<tree>``.

    Like ``tests/test_patches_against_base.py``: the repository's ``conftest.py`` puts the
    tree first on ``sys.path``; ``PYTHONPATH`` does the same for test folders without it.
    """
    import subprocess

    def run(patch: Patch, tree: Path) -> TestRun | None:
        files = test_files(tests_dir, patch.name)
        if not files[0].is_file():
            return None
        env = dict(os.environ)
        env["OVERLAY_VLLM_TREE"] = str(tree)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # never leave __pycache__ in a tree under test
        with tempfile.TemporaryDirectory(prefix="overlay-tests-") as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [sys.executable, "-m", "pytest", *map(str, files), "-m", "not gpu", "-q", "-p", "no:cacheprovider",
                   "-o", "addopts=", f"--junitxml={junit}"]
            try:
                proc = subprocess.run(cmd, cwd=cwd or tests_dir, env=env, capture_output=True, text=True,
                                      check=False, timeout=timeout)
            except subprocess.TimeoutExpired:
                return TestRun("error", summary=f"timed out after {timeout:.0f} s")
            passed, failed, reasons = _junit(junit)
        tail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
        summary = tail[-1] if tail else f"pytest exited {proc.returncode}"
        status = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
        if status == "error":
            summary = f"rc={proc.returncode}: " + " | ".join(tail[-3:])
        return TestRun(status, passed, failed, summary, reasons)

    return run


def _junit(path: Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if not path.exists():
        return (), (), ()
    passed: list[str] = []
    failed: list[str] = []
    reasons: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            failed.append(name)
            reasons.append(_reason(bad.get("message") or "", bad.text or ""))
        elif case.find("skipped") is None:
            passed.append(name)
    return tuple(passed), tuple(failed), tuple(reasons)


_EXC = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$")


def _reason(message: str, text: str) -> str:
    """One line saying why a test failed: the innermost exception, else the message's first line."""
    found = [m[1] for line in (message + "\n" + text).splitlines() if (m := _EXC.match(line))]
    found = [f for f in found if not f.startswith("AssertionError: Traceback")]
    first = message.strip().splitlines()
    return (found[-1] if found else first[0] if first else "")[:200]


@dataclass
class Result:
    """The classification of one patch."""

    name: str
    outcome: str
    evidence: str
    still_needed: list[str] = field(default_factory=list)
    absorbed: list[str] = field(default_factory=list)
    behaviour: dict[str, dict] = field(default_factory=dict)  # "old-base" / "target" -> TestRun
    conflicts: list[dict] = field(default_factory=list)
    carried: bool = False  # the patch is in the new series
    candidates: list[dict] = field(default_factory=list)  # resolution attempts (rebase_resolve.Attempt)
    source_sha256: str = ""  # the source patch file this result was classified from


@dataclass
class State:
    """Everything ``make rebase-continue`` needs, stored in the scratch repository."""

    from_version: str
    to_version: str
    pin: dict
    patches_root: str
    tests_dir: str
    names: list[str]
    old_commits: list[str]
    index: int = 0
    results: list[dict] = field(default_factory=list)
    exported: dict[str, str] = field(default_factory=dict)  # name -> "verbatim" | commit id
    pending: dict = field(default_factory=dict)  # the patch stopped at: head before, behaviour

    def save(self, work: Path) -> None:
        path = work / ".git" / STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, work: Path) -> State:
        path = work / ".git" / STATE
        if not path.is_file():
            raise RebaseError(f"{work}: no rebase in progress there (no .git/{STATE})")
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class Outcome:
    """What a run (or a continue) ended with."""

    done: bool
    out_dir: Path | None
    results: list[Result]
    conflict: list[ConflictHunk]
    work: Path
    message: str


def work_dir(to_version: str, root: Path = Path(".work")) -> Path:
    """The worktree a rebase to ``to_version`` uses and leaves behind on a conflict."""
    return root / f"rebase-{to_version}"


# --- the run ------------------------------------------------------------------------------

def start(
    patches_root: Path,
    from_version: str,
    target_pin: Pin,
    fill_base: TreeSource,
    fill_target: TreeSource,
    *,
    work: Path,
    tests_dir: Path,
    runner: TestRunner | None = None,
) -> Outcome:
    """Set up the scratch repository for ``from_version`` -> ``target_pin`` and classify the series.

    Refuses when ``work`` exists or ``patches/<to>/`` holds more than a prepared ``pin.toml``. On an
    error before the first conflict the scratch repository is removed again.
    """
    to = target_pin.version
    out = pin_dir(patches_root, to)
    prepared = prepared_pin(patches_root, to)
    if prepared is not None and (prepared.wheel, prepared.sha256) != (target_pin.wheel, target_pin.sha256):
        raise RebaseError(f"{out / 'pin.toml'}: pins {prepared.wheel} ({prepared.sha256[:12]}...), "
                          f"the rebase was given {target_pin.wheel} ({target_pin.sha256[:12]}...)")
    if work.exists():
        raise RebaseError(f"{work}: a rebase onto {to} is in progress: `make rebase-continue`, or remove it")
    series = Series.load(pin_dir(patches_root, from_version))
    if series.kernel_patches:
        _refuse_kernel(series)
    work.parent.mkdir(parents=True, exist_ok=True)
    try:
        old_commits = _prepare(work, series, from_version, to, fill_base, fill_target)
        state = State(from_version, to, {"version": to, "wheel": target_pin.wheel, "sha256": target_pin.sha256},
                      str(patches_root), str(tests_dir), [p.name for p in series.patches], old_commits)
        state.save(work)
        return _run(work, state, series, runner)
    except BaseException as exc:
        if work.exists() and not in_progress(work):
            _keep_partial_report(work, exc)
            shutil.rmtree(work)
        raise


def prepared_pin(patches_root: Path, to: str) -> Pin | None:
    """What may wait in ``patches/<to>/`` before a rebase onto ``to``: nothing, an empty folder, or only
    ``pin.toml`` (the target pinned by hand: its wheel and digest are used instead of the index's).

    Anything else is an earlier rebase's result, which a new one must not overwrite.
    """
    out = pin_dir(patches_root, to)
    if not out.exists():
        return None
    if not out.is_dir():
        raise RebaseError(f"{out}: is a file, not a release folder; remove it to rebase onto {to}")
    other = sorted(p.name for p in out.iterdir() if p.name != "pin.toml")
    if other:
        raise RebaseError(f"{out}: already exists (holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}); "
                          f"remove it to rebase onto {to} again")
    return load_pin(patches_root, to) if (out / "pin.toml").exists() else None


def _keep_partial_report(work: Path, exc: BaseException) -> None:
    """Before a failed run's worktree goes: move what it classified to ``<work>-stopped/``."""
    if not (work / "rebase.json").is_file():
        return
    kept = work.with_name(work.name + "-stopped")
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for name in ("rebase.json", "REBASE.md"):
        if (work / name).is_file():
            shutil.move(work / name, kept / name)
    print(f"rebase: stopped ({type(exc).__name__}); what it classified before: {kept / 'REBASE.md'}",
          file=sys.stderr, flush=True)


def resume(work: Path, *, runner: TestRunner | None = None) -> Outcome:
    """Take up a rebase stopped at a conflict, once a person resolved it with git."""
    state = State.load(work)
    series = Series.load(pin_dir(Path(state.patches_root), state.from_version))
    if [p.name for p in series.patches] != state.names:
        raise RebaseError(f"patches/{state.from_version}/series changed since the rebase started; start again")
    patch = series.patches[state.index]
    left = unmerged(work)
    if left:
        raise RebaseError(f"{patch.name}: still unmerged: {', '.join(left)} (resolve, `git add`, then continue)")
    marked = _files_with_markers(work)
    if marked:
        raise RebaseError(f"{patch.name}: conflict markers left in {', '.join(marked)}")
    head_before = state.pending["head"]
    if in_progress(work):
        if git(["diff", "--cached", "--quiet", "HEAD"], work, check=False).returncode == 0:
            git(["cherry-pick", "--skip"], work)
        else:
            git(["cherry-pick", "--continue"], work, env={"GIT_EDITOR": "true"})
    head = _rev(work, "HEAD")
    if git(["diff", "--quiet", head_before, head], work, check=False).returncode == 0 and head != head_before:
        raise RebaseError(f"{patch.name}: the resolution commit is empty; reset it and continue")
    behaviour = state.pending.get("behaviour", {})
    conflicts = state.pending.get("conflicts", [])
    where = ", ".join(sorted({c["path"] for c in conflicts}))
    if head == head_before:
        res = Result(patch.name, "conflict-resolved",
                     f"the 3-way merge conflicted in {where}; a person resolved it to no change, so the patch "
                     "is dropped (judged already upstream)", behaviour=behaviour, conflicts=conflicts)
    else:
        if git_text(["rev-list", "--count", f"{head_before}..{head}"], work).strip() != "1":
            raise RebaseError(f"{patch.name}: resolve into one commit on top of {head_before[:12]}")
        kept, gone = absorbed_hunks(patch.raw, format_patch(work, head))
        res = Result(patch.name, "conflict-resolved",
                     f"the 3-way merge conflicted in {where}; a person resolved it"
                     + (f"; hunks no longer needed: {', '.join(gone)}" if gone else ""),
                     still_needed=kept, absorbed=gone, behaviour=behaviour, conflicts=conflicts, carried=True)
        state.exported[patch.name] = head
    res.source_sha256 = sha256_of(patch.raw)
    res.candidates = state.pending.get("candidates", [])
    state.results.append(asdict(res))
    state.index += 1
    state.pending = {}
    state.save(work)
    return _run(work, state, series, runner)


def _refuse_kernel(series: Series) -> None:
    names = ", ".join(p.name for p in series.kernel_patches)
    raise KernelPatchError(
        f"patch {names} touches compiled sources; rebasing csrc/ from the sdists is not wired into "
        "`make rebase` yet"
    )


def _rev(repo: Path, rev: str) -> str:
    return git_text(["rev-parse", rev], repo).strip()


def _clear_worktree(repo: Path) -> None:
    for entry in repo.iterdir():
        if entry.name == ".git":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _prepare(work: Path, series: Series, from_version: str, to: str,
             fill_base: TreeSource, fill_target: TreeSource) -> list[str]:
    """History ``base`` -> ``target`` (branch ``new``) and ``base`` + series (branch ``old``)."""
    init_base(work, fill_base, from_version)
    git(["checkout", "-q", "-b", "old"], work)
    old_commits: list[str] = []
    for patch in series.patches:
        am(work, patch, f"vllm {from_version} itself; fix the series first (`make status`)")
        old_commits.append(_rev(work, "HEAD"))
    git(["checkout", "-q", "-b", "new", "base"], work)
    _clear_worktree(work)
    fill_target(work)
    git(["add", "-A"], work)
    git(["commit", "-q", "--allow-empty", "-m", f"vllm {to}"], work)
    git(["tag", "target"], work)
    return old_commits


def _tree_at(work: Path, rev: str, dest: Path) -> Path:
    """Check out ``rev`` into ``dest`` without touching the worktree or its index."""
    dest.mkdir(parents=True, exist_ok=True)
    import tarfile
    from io import BytesIO

    data = git(["archive", "--format=tar", rev], work).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _behaviour(work: Path, patch: Patch, old_parent: str, runner: TestRunner | None) -> dict[str, dict]:
    if runner is None:
        return {}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="overlay-rebase-trees-") as tmp:
        for label, rev in (("old-base", old_parent), ("target", "HEAD")):
            tree = _tree_at(work, rev, Path(tmp) / label)
            run = runner(patch, tree)
            if run is None:
                return {}
            runs[label] = run.to_dict()
    return runs


def _behaviour_verdict(runs: dict[str, dict]) -> tuple[str, list[str], list[str], str]:
    """("absorbed" | "partial" | "needed" | "unknown", tests now passing, still failing, note)."""
    if not runs:
        return "unknown", [], [], "no tests of its own"
    old, new = TestRun.from_dict(runs["old-base"]), TestRun.from_dict(runs["target"])
    if old.status != "failed":
        return "unknown", [], [], (f"its tests do not fail on the old base ({old.status}: {old.summary}); "
                                   "they cannot tell whether upstream fixed it")
    if new.status == "error":
        return "unknown", [], [], f"its tests could not run on the target ({new.summary})"
    fixed = sorted(set(old.failed) & set(new.passed))
    still = sorted(set(old.failed) & set(new.failed))
    if new.status == "passed":
        return "absorbed", fixed, [], (f"its tests fail on the old base ({old.summary}) and pass on the "
                                       f"target without it ({new.summary})")
    if fixed:
        return "partial", fixed, still, (f"of its tests that fail on the old base, {len(fixed)} pass on the "
                                         f"target without it ({', '.join(fixed)}) and {len(still)} still fail "
                                         f"({', '.join(still)})" + _differently(old, new))
    return "needed", [], still, (f"its tests still fail on the target without it ({new.summary})"
                                 + _differently(old, new))


def _differently(old: TestRun, new: TestRun) -> str:
    """A warning when the tests fail on the target for other reasons than on the old base.

    A test that fails there with, say, an AttributeError from its own harness may not fit the
    release (``tests/compat.py``) rather than show that the bug is still there.
    """
    before = dict(zip(old.failed, old.reasons, strict=False))
    changed = [(t, why) for t, why in zip(new.failed, new.reasons, strict=False) if t in before and before[t] != why]
    if not changed:
        return ""
    test, why = changed[0]
    return (f"; but {len(changed)} of them fail differently there (e.g. {test}: {why}), so the tests may not "
            "fit this release: check tests/compat.py before trusting this")


def _run(work: Path, state: State, series: Series, runner: TestRunner | None) -> Outcome:
    """Classify every patch from ``state.index`` on; a conflict is set aside and the run goes on.

    A conflicting patch first gets its mechanical candidates (:mod:`overlay.rebase_resolve`);
    when none passes its tests it is set aside (``conflict``) and the later patches are
    classified on the target plus what was carried so far. With nothing set aside the release
    folder is written. Otherwise the report goes into ``work`` and the worktree is put back on
    the first set-aside patch's conflict: ``make rebase-continue`` takes up from there.
    """
    results = [Result(**r) for r in state.results]
    aside: list[tuple[int, str]] = []  # (index, the head it was tried on)
    for i in range(state.index, len(series.patches)):
        patch = series.patches[i]
        old_commit = state.old_commits[i]
        old_parent = state.old_commits[i - 1] if i else "base"
        head = _rev(work, "HEAD")
        print(f"rebase {state.to_version}: {patch.name} ...", file=sys.stderr, flush=True)
        res, stop = _classify(work, state, patch, old_commit, old_parent, head, runner)
        res.source_sha256 = sha256_of(patch.raw)
        if stop is not None:
            later = list(zip([p.name for p in series.patches[i + 1:]], state.old_commits[i + 1:], strict=True))
            if _resolve(work, state, patch, res, stop, head, old_commit, later, runner) is None:
                aside.append((i, head))
        depends = _rests_on(work, state, series, i, [j for j, _ in aside if j < i], res.outcome)
        if depends:
            res.evidence += "; " + depends
        results.append(res)
        # What is known so far, in the worktree after every patch: a run killed mid-way (a test
        # run can take minutes per patch) leaves the classification of the patches it got through.
        _write_report(work, state, results, work, pending=[series.patches[j].name for j, _ in aside],
                      unclassified=[p.name for p in series.patches[i + 1:]])
    if not aside:
        out = _finish(work, state, series, results)
        shutil.rmtree(work)
        return Outcome(True, out, results, [], work, f"wrote {out}")
    return _stop_at_first(work, state, series, results, aside)


def _resolve(work: Path, state: State, patch: Patch, res: Result, stop: list[ConflictHunk], head: str,
             old_commit: str, later: list[tuple[str, str]], runner: TestRunner | None) -> str | None:
    """Try the candidates for a conflicting ``patch``; fill ``res``; the accepted commit or None."""
    res.conflicts = [c.to_dict() for c in stop]
    where = ", ".join(sorted({c.path for c in stop}))
    accepted, attempts, note = try_candidates(work, patch, head, old_commit, later, runner,
                                              res.behaviour.get("target"), _tree_at)
    res.candidates = [a.to_dict() for a in attempts]
    if accepted is None:
        tried = "; ".join(f"{a.name}: {a.why}" for a in attempts) or note
        res.evidence = (f"the 3-way merge conflicted in {where} ({len(stop)} hunk(s)); set aside for a person "
                        f"(candidates: {tried})")
        return None
    kept, gone = absorbed_hunks(patch.raw, format_patch(work, accepted.commit))
    res.outcome, res.carried, res.still_needed, res.absorbed = "auto-resolved", True, kept, gone
    res.evidence = (f"the 3-way merge conflicted in {where}; candidate {accepted.name} ({accepted.description}) "
                    f"accepted: {accepted.why}" + (f"; hunks dropped with it: {', '.join(gone)}" if gone else ""))
    state.exported[patch.name] = accepted.commit
    return accepted.commit


_BLAME_COMMIT = re.compile(r"^([0-9a-f]{40}) \d+ \d+")


def _rests_on(work: Path, state: State, series: Series, i: int, aside: list[int], outcome: str) -> str:
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


def _stop_at_first(work: Path, state: State, series: Series, results: list[Result],
                   aside: list[tuple[int, str]]) -> Outcome:
    """Report every patch into ``work``, then leave the first set-aside conflict for a person."""
    _write_report(work, state, results, work, pending=[series.patches[j].name for j, _ in aside])
    first, head = aside[0]
    git(["reset", "-q", "--hard", head], work)
    git(["clean", "-fdq"], work)  # the report stays: it is excluded there
    pick(work, state.old_commits[first])
    hunks = conflict_report(work)
    names = [p.name for p in series.patches]
    state.index = first
    state.results = [asdict(r) for r in results[:first]]
    state.exported = {n: v for n, v in state.exported.items() if n in names[:first]}
    res = results[first]
    state.pending = {"head": head, "behaviour": res.behaviour, "conflicts": [c.to_dict() for c in hunks],
                     "candidates": res.candidates}
    state.save(work)
    return Outcome(False, None, results, hunks, work,
                   _conflict_message(work, series.patches[first], hunks, results, [j for j, _ in aside]))


def _classify(work: Path, state: State, patch: Patch, old_commit: str, old_parent: str, head: str,
              runner: TestRunner | None) -> tuple[Result, list[ConflictHunk] | None]:
    to = state.to_version
    if applies(work, patch.raw, reverse=True):
        return Result(patch.name, "upstream", f"reverse-applies to vllm {to}: upstream has this exact change"), None
    runs = _behaviour(work, patch, old_parent, runner)
    verdict, fixed, still, note = _behaviour_verdict(runs)
    if verdict == "absorbed":
        return Result(patch.name, "upstream-by-behaviour", note + "; dropped", absorbed=fixed,
                      behaviour=runs), None
    if applies(work, patch.raw):
        am(work, patch, f"vllm {to}")
        state.exported[patch.name] = "verbatim"
        if verdict == "partial":
            return Result(patch.name, "partly-upstream", note + "; the patch applies unchanged and is carried",
                          still_needed=still, absorbed=fixed, behaviour=runs, carried=True), None
        return Result(patch.name, "applied", f"applies to vllm {to} exactly; carried verbatim"
                      + (f" ({note})" if runs else ""), behaviour=runs, carried=True), None
    _, stderr, followed = pick(work, old_commit)
    moved = "; ".join(f"followed {f.old} into {f.new} ({f.containment:.0%} of its lines are there)"
                      for f in followed)
    if in_progress(work):
        if unmerged(work):
            return Result(patch.name, "conflict", "", behaviour=runs), conflict_report(work)
        if git(["diff", "--cached", "--quiet", "HEAD"], work, check=False).returncode == 0:
            abort(work)
            return Result(patch.name, "upstream", f"the 3-way merge onto vllm {to} leaves nothing to commit"
                          + (f" ({moved})" if moved else ""), behaviour=runs), None
        raise RebaseError(f"{patch.name}: git cherry-pick stopped: "
                          + stderr.decode(errors="replace").strip().splitlines()[-1])
    new = _rev(work, "HEAD")
    if new == head or git(["diff", "--quiet", head, new], work, check=False).returncode == 0:
        if new != head:
            git(["reset", "-q", "--hard", head], work)
        return Result(patch.name, "upstream", f"the 3-way merge onto vllm {to} leaves nothing to commit",
                      behaviour=runs), None
    state.exported[patch.name] = new
    kept, gone = absorbed_hunks(patch.raw, format_patch(work, new))
    renames = _renames(work, old_commit, new)
    how = "applies after a 3-way merge" + (f" ({'; '.join(filter(None, [renames, moved]))})"
                                          if renames or moved else "")
    if gone or verdict == "partial":
        parts = []
        if gone:
            parts.append(f"vllm {to} already has hunk(s) {', '.join(gone)}; still needed: {', '.join(kept)}")
        if verdict == "partial":
            parts.append(note)
        return Result(patch.name, "partly-upstream", f"{how}; " + "; ".join(parts),
                      still_needed=kept + still, absorbed=gone + fixed, behaviour=runs, carried=True), None
    return Result(patch.name, "refreshed", how + "; the refreshed patch is exported"
                  + (f" ({note})" if runs else ""), behaviour=runs, carried=True), None


def _renames(work: Path, old_commit: str, new_commit: str) -> str:
    old_files = set(git_text(["diff-tree", "--no-commit-id", "--name-only", "-r", old_commit], work).split())
    new_files = set(git_text(["diff-tree", "--no-commit-id", "--name-only", "-r", new_commit], work).split())
    gone, came = sorted(old_files - new_files), sorted(new_files - old_files)
    if not gone:
        return ""
    return f"followed {', '.join(gone)} to {', '.join(came) or 'nothing'}"


def _files_with_markers(work: Path) -> list[str]:
    changed = git_text(["diff", "--name-only", "HEAD"], work).split()
    bad = []
    for path in changed:
        file = work / path
        if file.is_file() and any(line.startswith(b"<<<<<<< ") for line in file.read_bytes().splitlines()):
            bad.append(path)
    return bad


def _conflict_message(work: Path, patch: Patch, hunks: list[ConflictHunk], results: list[Result],
                      aside: list[int]) -> str:
    names = [results[j].name for j in aside]
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines = [f"classified {len(results)} patch(es): " + ", ".join(f"{n} {o}" for o, n in counts.items())
             + f"; {len(names)} need(s) a person: {', '.join(names)}; the report is {work / 'REBASE.md'}",
             f"conflict: {patch.name} does not merge onto the target; {len(hunks)} hunk(s) to resolve in {work}:"]
    lines += [f"  {h.describe()}" for h in hunks]
    lines += [
        "resolve there with plain git (edit, `git add <file>`; `git cherry-pick --continue` is optional),",
        "or make the patch empty (`git checkout HEAD -- .`) to drop it; then run `make rebase-continue`.",
    ]
    return "\n".join(lines)


# --- writing the release folder ------------------------------------------------------------

def _finish(work: Path, state: State, series: Series, results: list[Result]) -> Path:
    patches_root = Path(state.patches_root)
    out = pin_dir(patches_root, state.to_version)
    try:
        prepared = prepared_pin(patches_root, state.to_version)
    except RebaseError as exc:
        raise RebaseError(f"{out}: changed while the rebase ran; not overwriting it ({exc})") from None
    pin = Pin.from_dict(state.pin, f"target pin of the rebase onto {state.to_version}")
    tmp = Path(tempfile.mkdtemp(prefix=f".rebase-{state.to_version}-", dir=patches_root))
    try:
        names: list[str] = []
        for patch, res in zip(series.patches, results, strict=True):
            how = state.exported.get(patch.name)
            if not res.carried or how is None:
                continue
            raw = patch.raw if how == "verbatim" else format_patch(work, how)
            Patch.from_bytes(patch.name, raw, tmp / patch.name)  # refuse to write a broken file
            (tmp / patch.name).write_bytes(raw)
            names.append(patch.name)
        (tmp / "series").write_text(Series.render(names, header_from=(
            f"# Patch series for vLLM {state.to_version}, applied in this order by `make build`.\n"
            f"# Rebased from {state.from_version} by `make rebase` (see REBASE.md).\n")))
        if prepared is not None:  # the person's own file, comments and all
            shutil.copy2(out / "pin.toml", tmp / "pin.toml")
        else:
            (tmp / "pin.toml").write_text(pin.to_toml())
        _write_report(tmp, state, results, work)
        os.chmod(tmp, 0o755)
        if out.exists():  # prepared by a person (empty, or only pin.toml): swapped in one step
            exchange(tmp, out)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _write_report(dest: Path, state: State, results: list[Result], work: Path, *,
                  pending: list[str] | None = None, unclassified: list[str] | None = None) -> None:
    """``rebase.json`` and ``REBASE.md`` into ``dest`` (the release folder, or the worktree);
    ``unclassified``: the run is still going and these patches are not classified yet."""
    doc: dict[str, object] = {
        "from": state.from_version,
        "to": state.to_version,
        "target": state.pin,
        "trust": _TRUST,
        "pending": pending or [],
        "patches": [{"name": r.name, "outcome": r.outcome, "evidence": r.evidence, "carried": r.carried,
                     "still_needed": r.still_needed, "absorbed": r.absorbed, "behaviour": r.behaviour,
                     "conflicts": r.conflicts, "candidates": r.candidates, "source_sha256": r.source_sha256}
                    for r in results],
    }
    if unclassified is not None:
        doc["in_progress"] = {"classified": len(results), "unclassified": unclassified}
    (dest / "rebase.json").write_text(json.dumps(doc, indent=2) + "\n")
    (dest / "REBASE.md").write_text(report_markdown(state, results, work=work, pending=pending,
                                                    unclassified=unclassified))
    if dest == work:  # keep the report out of `git status` / `git add -A` there
        exclude = work / ".git" / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        have = exclude.read_text() if exclude.is_file() else ""
        if "/REBASE.md" not in have.split():
            exclude.write_text(have + "/REBASE.md\n/rebase.json\n")


_TRUST = ("the target wheel's sha256 is the digest PyPI publishes for it (read through pip's "
          "resolver report); pip checked the download against it and the tool hashed the file again")

_MEANING = {
    "applied": "applies exactly; carried verbatim",
    "refreshed": "applies after a 3-way merge; carried as the refreshed patch",
    "upstream": "upstream has the same change; dropped",
    "upstream-by-behaviour": "upstream fixed it its own way (its tests pass without it); dropped",
    "partly-upstream": "part of it is upstream; the rest is carried",
    "conflict": "set aside: needs a person",
    "conflict-resolved": "conflicted; resolved by a person",
    "auto-resolved": ("conflicted; a mechanical candidate was accepted because the patch's own tests pass on "
                      "the target with it and the later patches still merge"),
}


def report_markdown(state: State, results: list[Result], *, work: Path | None = None,
                    pending: list[str] | None = None, unclassified: list[str] | None = None) -> str:
    """``REBASE.md``: a table, the resolution steps when patches need a person, the reasoning per
    patch, and what other pins rebased from the same base carry (``unclassified``: a run still going)."""
    lines = [f"# Rebase of the series from vLLM {state.from_version} to {state.to_version}", ""]
    if unclassified is not None:
        lines += [f"**In progress** (or stopped): {len(results)} of {len(results) + len(unclassified)} "
                  f"patches classified; not yet: {', '.join(unclassified) or 'none'}.", ""]
    lines += [
        f"Target wheel `{state.pin['wheel']}`, sha256 `{state.pin['sha256']}`: {_TRUST}.",
        "",
        "| patch | outcome | carried | evidence |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        short = r.evidence.split("; ")[0]
        depends = re.search(r"(?:depends on|rests on lines written by) set-aside ([\w.-]+)", r.evidence)
        if depends:
            short += f" (depends on set-aside `{depends[1]}`)"
        short = short.replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.outcome} | {'yes' if r.carried else 'no'} | {short} |")
    if pending:
        lines += ["", f"## To resolve: {len(pending)} patch(es) need a person", "",
                  f"`{pending[0]}` waits in `{work}` mid-cherry-pick, its conflicts staged as in any git merge.",
                  "",
                  "1. Resolve there with plain git (edit, `git add <file>`), or make the patch empty "
                  "(`git checkout HEAD -- .`) to drop it.",
                  f"2. `make rebase-continue TO={state.to_version}`: it records the patch as conflict-resolved and "
                  "classifies the later patches again on top of it (candidates included), stopping at the next "
                  "patch that still needs a person.",
                  f"3. When nothing is left, `patches/{state.to_version}/` is written with the final report.",
                  "", "Set aside in this run: " + ", ".join(f"`{n}`" for n in pending) + "."]
    lines += ["", "## Reasoning", ""]
    for r in results:
        lines += [f"### `{r.name}`: {r.outcome}", "", f"{_MEANING[r.outcome]}. {r.evidence}.", ""]
        if r.still_needed:
            lines += ["Still needed: " + ", ".join(f"`{s}`" for s in r.still_needed) + ".", ""]
        if r.absorbed:
            lines += ["Already upstream: " + ", ".join(f"`{s}`" for s in r.absorbed) + ".", ""]
        for label, run in r.behaviour.items():
            lines.append(f"- its tests on the {label.replace('-', ' ')}: {run['status']} ({run['summary']})")
            if label == "target":
                for test, why in list(zip(run["failed"], run.get("reasons", []), strict=False))[:5]:
                    lines.append(f"  - still failing there: `{test}`: {why}")
        for c in r.conflicts:
            lines.append(f"- conflict: {ConflictHunk(**c).describe()}")
        for a in r.candidates:
            verdict = "accepted" if a["accepted"] else "rejected"
            lines.append(f"- candidate {a['name']} ({a['description']}): {verdict}: {a['why']}"
                         + (f" [commit {a['commit'][:12]}; files {', '.join(a['files'])}]" if a["commit"] else ""))
        if r.source_sha256:
            lines.append(f"- rebased from the source patch with sha256 `{r.source_sha256}`")
        if r.behaviour or r.conflicts or r.candidates or r.source_sha256:
            lines.append("")
    lines += _other_pins(state)
    return "\n".join(lines).rstrip() + "\n"


def _other_pins(state: State) -> list[str]:
    """Other pins rebased from the same base that carry an older version of a patch, or lack one."""
    try:
        notes = later_pin_notes(Path(state.patches_root), state.from_version)
    except OverlayError:
        return []
    rows = [f"- `{name}`: {n.describe()}" for name, found in notes.items() for n in found
            if n.pin != state.to_version]
    if not rows:
        return []
    return ["## Other pins rebased from " + state.from_version, "", *rows, ""]


# --- the CLI entry points -------------------------------------------------------------------

def rebase_release(patches_root: Path, from_version: str, to_version: str, *,
                   work_root: Path = Path(".work"), tests_dir: Path = Path("tests/patches"),
                   run_tests: bool = True) -> Outcome:
    """``make rebase TO=...``: fetch and verify both wheels, then :func:`start`."""
    from overlay.fetch import fetch_release, fetch_wheel

    base_pin = load_pin(patches_root, from_version)
    base_wheel = fetch_wheel(base_pin)
    prepared = prepared_pin(patches_root, to_version)
    if prepared is not None:
        target_pin, target_wheel = prepared, fetch_wheel(prepared)
    else:
        target_pin, target_wheel = fetch_release(to_version)
    runner = pytest_runner(tests_dir, cwd=Path.cwd()) if run_tests else None
    return start(patches_root, from_version, target_pin,
                 lambda d: _extract(base_wheel, d), lambda d: _extract(target_wheel, d),
                 work=work_dir(to_version, work_root), tests_dir=tests_dir, runner=runner)


def continue_release(to_version: str | None = None, *, work_root: Path = Path(".work"),
                     tests_dir: Path = Path("tests/patches"), run_tests: bool = True) -> Outcome:
    """``make rebase-continue``: the one rebase in progress (or the one onto ``to_version``)."""
    if to_version:
        work = work_dir(to_version, work_root)
    else:
        found = sorted(p for p in work_root.glob("rebase-*") if (p / ".git" / STATE).is_file())
        if not found:
            raise RebaseError(f"no rebase in progress under {work_root}/")
        if len(found) > 1:
            raise RebaseError(f"several rebases in progress ({', '.join(p.name for p in found)}); pass TO=")
        work = found[0]
    runner = pytest_runner(tests_dir, cwd=Path.cwd()) if run_tests else None
    return resume(work, runner=runner)


def _extract(wheel: Path, dest: Path) -> None:
    extract_text_tree(wheel, dest)
