"""The rebase run: prepare the scratch repository, then classify each patch in series order into
one of :data:`overlay.maintain.rebase.state.OUTCOMES`, resolving conflicts where tests can."""

from __future__ import annotations

import contextlib
import shutil
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from overlay import lock
from overlay.atomic import scratch
from overlay.build.pins import Pin, pin_dir
from overlay.build.series import Patch, Series
from overlay.errors import KernelPatchError
from overlay.git import git, git_text
from overlay.interrupt import sigterm_as_interrupt
from overlay.maintain.rebase import history
from overlay.maintain.rebase.model_path import on_path
from overlay.maintain.rebase.report import write_release, write_report
from overlay.maintain.rebase.resolve import NOTHING_LEFT, abort, pick, try_candidates
from overlay.maintain.rebase.stale import sha256_of
from overlay.maintain.rebase.state import STATE, Outcome, RebaseError, Result, State, prepared_pin, work_lock
from overlay.maintain.rebase.testrun import TestRun, TestRunner, test_file
from overlay.maintain.rebase.verdict import Verdict, behaviour_verdict, old_base_failure
from overlay.maintain.replay import (
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
from overlay.maintain.workspace import format_patch


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
    facts: dict | None = None,
) -> Outcome:
    """Set up the scratch repository for ``from_version`` -> ``target_pin`` and classify the series
    (``facts``: both releases' facts, ``{"from": ..., "to": ...}``, for the report).

    Refuses when ``work`` exists or ``patches/<to>/`` holds more than a prepared ``pin.toml``. On an
    error before the first conflict the scratch repository is removed again.
    """
    to = target_pin.version
    out = pin_dir(patches_root, to)
    prepared = prepared_pin(patches_root, to)
    if prepared is not None and (prepared.wheel, prepared.sha256) != (target_pin.wheel, target_pin.sha256):
        raise RebaseError(f"{out / 'pin.toml'}: pins {prepared.wheel} ({prepared.sha256[:12]}...), "
                          f"the rebase was given {target_pin.wheel} ({target_pin.sha256[:12]}...)")
    work.parent.mkdir(parents=True, exist_ok=True)
    with _held(work, to):  # a second rebase onto `to` is refused while this one runs, never told to remove it
        if work.exists():
            if not (work / ".git" / STATE).is_file():  # stopped before its state was saved (a kill, a power cut)
                raise RebaseError(f"{work}: a rebase onto {to} that stopped before it began (no .git/{STATE}): "
                                  f"remove it (rm -rf {work}) and run make rebase again")
            raise RebaseError(f"{work}: a rebase onto {to} is in progress: `make rebase-continue`, or remove it")
        series = Series.load(pin_dir(patches_root, from_version))
        if series.kernel_patches:
            _refuse_kernel(series)
        try:
            with sigterm_as_interrupt():  # SIGTERM cleans up as SIGINT does
                old_commits = prepare(work, series, from_version, to, fill_base, fill_target)
                state = State(from_version, to, {"version": to, "wheel": target_pin.wheel, "sha256": target_pin.sha256},
                              str(patches_root), str(tests_dir), [p.name for p in series.patches], old_commits,
                              facts=dict(facts or {}))
                state.save(work)
                return _run(work, state, series, runner)
        except BaseException as exc:
            if work.exists() and not in_progress(work):
                _keep_partial_report(work, exc)
                shutil.rmtree(work)
            raise


def _held(work: Path, to: str) -> contextlib.AbstractContextManager[None]:
    """The lock of the rebase running in ``work`` (:func:`state.work_lock`), taken at once or refused."""
    return lock.held(work_lock(work), f"{work}: a rebase onto {to} is running there now: wait for it to stop",
                     wait=False)


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


def resume(work: Path, *, runner: TestRunner | None = None, left_out: str | None = None, why: str = "") -> Outcome:
    """Take up a rebase stopped at a conflict, once a person resolved it with git (``why``: their reason,
    recorded with it); or, with ``left_out`` (the person's reason), leave the patch it stopped at out of
    the series (``left-out``). Refused while another rebase or continue runs in ``work``."""
    with _held(work, work.name.removeprefix("rebase-")):
        return _resume(work, runner=runner, left_out=left_out, why=why)


def _resume(work: Path, *, runner: TestRunner | None, left_out: str | None, why: str) -> Outcome:
    state = State.load(work)
    series = Series.load(pin_dir(Path(state.patches_root), state.from_version))
    if [p.name for p in series.patches] != state.names:
        raise RebaseError(f"patches/{state.from_version}/series changed since the rebase started; start again")
    patch = series.patches[state.index]
    if left_out is not None:
        return _leave_out(work, state, series, patch, left_out, runner)
    left = unmerged(work)
    if left:
        raise RebaseError(f"{patch.name}: still unmerged: {', '.join(left)} (resolve, `git add`, then continue)")
    marked = history.files_with_markers(work)
    if marked:
        raise RebaseError(f"{patch.name}: conflict markers left in {', '.join(marked)}")
    head_before = state.pending["head"]
    if in_progress(work):
        if git(["diff", "--cached", "--quiet", "HEAD"], work, check=False).returncode == 0:
            git(["cherry-pick", "--skip"], work)
        else:
            git(["cherry-pick", "--continue"], work, env={"GIT_EDITOR": "true"})
    head = history.rev(work, "HEAD")
    if git(["diff", "--quiet", head_before, head], work, check=False).returncode == 0 and head != head_before:
        raise RebaseError(f"{patch.name}: the resolution commit is empty; reset it and continue")
    behaviour = state.pending.get("behaviour", {})
    conflicts = state.pending.get("conflicts", [])
    where = ", ".join(sorted({c["path"] for c in conflicts}))
    if state.pending.get("outcome") == "contradicted":
        cause = "its tests contradicted the target's own behaviour" + (
            f" and the 3-way merge conflicted in {where}" if conflicts else "")
    else:
        cause = f"the 3-way merge conflicted in {where}"
    if head == head_before:
        res = Result(patch.name, "conflict-resolved",
                     f"{cause}; a person resolved it to no change, so the patch "
                     "is dropped (judged already upstream)", behaviour=behaviour, conflicts=conflicts)
    else:
        if git_text(["rev-list", "--count", f"{head_before}..{head}"], work).strip() != "1":
            raise RebaseError(f"{patch.name}: resolve into one commit on top of {head_before[:12]}")
        # A hunk the person's commit does not hold line for line was ported differently or dropped by
        # them: the matcher cannot tell which, and neither is "already upstream" (Result.absorbed).
        kept, other = absorbed_hunks(patch.raw, format_patch(work, head))
        res = Result(patch.name, "conflict-resolved",
                     f"{cause}; a person resolved it"
                     + (f"; hunks not carried as written (ported differently or dropped by the person, not "
                        f"judged upstream): {', '.join(other)}" if other else ""),
                     still_needed=kept, behaviour=behaviour, conflicts=conflicts, carried=True)
        state.exported[patch.name] = head
    why = " ".join(why.split())
    if why:
        res.evidence += f"; the person's reason: {why}"
        res.reason = why
    res.source_sha256 = sha256_of(patch.raw)
    res.candidates = state.pending.get("candidates", [])
    if res.carried:
        _on_model_path(work, state, patch, res, runner)
    state.results.append(asdict(res))
    state.index += 1
    state.pending = {}
    state.save(work)
    return _run(work, state, series, runner)


def _leave_out(work: Path, state: State, series: Series, patch: Patch, why: str,
               runner: TestRunner | None) -> Outcome:
    """The patch the rebase stopped at, left out of the series for the person's reason ``why``: whatever
    was done in the worktree is undone (the cherry-pick aborted, the tree back on the head it was tried
    on), it is recorded ``left-out`` with the reason, and the later patches are classified."""
    why = " ".join(why.split())
    if not why:
        raise RebaseError(f"{patch.name}: leaving a patch out needs the reason (WHY=...): it goes into "
                          "REBASE.md and rebase.json")
    head_before = state.pending["head"]
    if in_progress(work):
        abort(work)
    git(["reset", "-q", "--hard", head_before], work)
    git(["clean", "-fdq"], work)  # the report stays: it is excluded there
    conflicts = state.pending.get("conflicts", [])
    where = ", ".join(sorted({c["path"] for c in conflicts}))
    was = ("its tests contradicted the target's own behaviour" if state.pending.get("outcome") == "contradicted"
           else f"the 3-way merge conflicted in {where}" if where else "it was set aside")
    res = Result(patch.name, "left-out", f"{was}; a person left it out of the series: {why}",
                 behaviour=state.pending.get("behaviour", {}), conflicts=conflicts, reason=why)
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


def prepare(work: Path, series: Series, from_version: str, to: str,
             fill_base: TreeSource, fill_target: TreeSource) -> list[str]:
    """History ``base`` -> ``target`` (branch ``new``) and ``base`` + series (branch ``old``)."""
    init_base(work, fill_base, from_version)
    git(["checkout", "-q", "-b", "old"], work)
    old_commits: list[str] = []
    for patch in series.patches:
        am(work, patch, f"vllm {from_version} itself; fix the series first (`make status`)")
        old_commits.append(history.rev(work, "HEAD"))
    git(["checkout", "-q", "-b", "new", "base"], work)
    history.clear_worktree(work)
    fill_target(work)
    git(["add", "-A"], work)
    git(["commit", "-q", "--allow-empty", "-m", f"vllm {to}"], work)
    git(["tag", "target"], work)
    return old_commits


def _behaviour(work: Path, patch: Patch, old_parent: str, runner: TestRunner | None) -> dict[str, dict]:
    if runner is None:
        return {}
    runs: dict[str, dict] = {}
    with scratch("overlay-rebase-trees-") as tmp:  # two release trees: a killed run's removed by the next
        for label, rev in (("old-base", old_parent), ("target", "HEAD")):
            tree = history.tree_at(work, rev, Path(tmp) / label)
            run = runner(patch, tree)
            if run is None:
                return {}
            if label == "old-base" and (tool := old_base_failure(run)) is not None:
                raise OldBaseError(f"{patch.name}: its tests cannot run on the old base (the series' own release "
                                   f"with the earlier patches): {tool}; that is this tool's failure, not the "
                                   "patch's, its tests' or the target's, and the rebase stops rather than judge "
                                   "without them")
            runs[label] = run.to_dict()
    return runs


class OldBaseError(RebaseError):
    """A patch's tests cannot run on the old base: the tool's own test environment or harness failed."""


def _on_model_path(work: Path, state: State, patch: Patch, res: Result, runner: TestRunner | None) -> None:
    """A carried patch, on the target with it (``HEAD``): the classes and methods its lines are in
    (``res.changes``), and its tests run there; those that find it in the tree but off the path GLM-5
    runs (``compat.OffModelPath``, the GLM-5 path harness) make it ``off-model-path``, never kept
    silently: it would change nothing GLM-5 runs. Its path tests passing with it and failing by
    behaviour without it put it on the path (``res.on_model_path``, :func:`model_path.on_path`)."""
    res.changes = history.changed_methods(work, "HEAD")
    if runner is None:
        return
    with scratch("overlay-rebase-trees-") as tmp:  # a killed run's removed by the next
        run = runner(patch, history.tree_at(work, "HEAD", Path(tmp) / "with-it"))
    if run is None:
        return
    res.behaviour["target-with-it"] = run.to_dict()
    off = run.off_path_failed
    if off:
        res.outcome = "off-model-path"
        res.evidence += (f"; with it on the target, {len(off)} of its tests find it off the path GLM-5 runs "
                         f"(`{off[0]}`): it changes nothing GLM-5 runs there")
        return
    without = TestRun.from_dict(res.behaviour["target"]) if res.behaviour.get("target") else None
    res.on_model_path = on_path(Path(state.tests_dir), patch.name, state.to_version, run, without)


def _run(work: Path, state: State, series: Series, runner: TestRunner | None) -> Outcome:
    """Classify every patch from ``state.index`` on; a conflict is set aside and the run goes on.

    A conflicting patch first gets its mechanical candidates (:mod:`overlay.maintain.rebase.resolve`);
    when none passes its tests it is set aside (``conflict``), as is a patch whose tests the
    target contradicts (``contradicted``, no candidates), and the later patches are
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
        head = history.rev(work, "HEAD")
        print(f"rebase {state.to_version}: {patch.name} ...", file=sys.stderr, flush=True)
        classified = _classify(work, state, patch, old_commit, old_parent, head, runner)
        res = classified.result
        res.source_sha256 = sha256_of(patch.raw)
        if classified.then is Then.SET_ASIDE:
            aside.append((i, head))  # no candidate either: the tests cannot vouch for any
        elif classified.then is Then.RESOLVE:
            later = list(zip([p.name for p in series.patches[i + 1:]], state.old_commits[i + 1:], strict=True))
            if _resolve(work, state, patch, res, classified.conflicts, head, old_commit, later, runner) is None:
                aside.append((i, head))
        depends = history.rests_on(work, state, series, i, [j for j, _ in aside if j < i], res.outcome)
        if depends:
            res.evidence += "; " + depends
        if res.carried and not any(j == i for j, _ in aside):
            _on_model_path(work, state, patch, res, runner)
        results.append(res)
        # What is known so far, in the worktree after every patch: a run killed mid-way (a test
        # run can take minutes per patch) leaves the classification of the patches it got through.
        write_report(work, state, results, work, pending=[series.patches[j].name for j, _ in aside],
                      unclassified=[p.name for p in series.patches[i + 1:]])
    if not aside:
        out = write_release(work, state, series, results)
        shutil.rmtree(work)
        return Outcome(True, out, results, [], work, f"wrote {out}")
    return _stop_at_first(work, state, series, results, aside)


def _resolve(work: Path, state: State, patch: Patch, res: Result, stop: list[ConflictHunk], head: str,
             old_commit: str, later: list[tuple[str, str]], runner: TestRunner | None) -> str | None:
    """Try the candidates for a conflicting ``patch``; fill ``res``; the accepted commit or None."""
    res.conflicts = [c.to_dict() for c in stop]
    where = ", ".join(sorted({c.path for c in stop}))
    accepted, attempts, note = try_candidates(work, patch, head, old_commit, later, runner,
                                              res.behaviour.get("target"), history.tree_at)
    res.candidates = [a.to_dict() for a in attempts]
    if accepted is None:
        tried = "; ".join(f"{a.name}: {a.why}" for a in attempts) or note
        res.evidence = (f"the 3-way merge conflicted in {where} ({len(stop)} hunk(s)); set aside for a person "
                        f"(candidates: {tried})")
        target = TestRun.from_dict(res.behaviour["target"]) if res.behaviour.get("target") else None
        if target is not None and target.cannot_run and any(a.why == NOTHING_LEFT for a in attempts):
            res.evidence += (f"; the target's side leaves nothing of the patch, but its tests cannot run on the "
                             f"target ({target.first_error()}): fix {_tests_of(state, patch)} first, and a "
                             "rebase judges it by behaviour")
        return None
    kept, gone = absorbed_hunks(patch.raw, format_patch(work, accepted.commit))
    res.outcome, res.carried, res.still_needed, res.absorbed = "auto-resolved", True, kept, gone
    res.evidence = (f"the 3-way merge conflicted in {where}; candidate {accepted.name} ({accepted.description}) "
                    f"accepted: {accepted.why}" + (f"; hunks dropped with it: {', '.join(gone)}" if gone else ""))
    state.exported[patch.name] = accepted.commit
    return accepted.commit


def _stop_at_first(work: Path, state: State, series: Series, results: list[Result],
                   aside: list[tuple[int, str]]) -> Outcome:
    """Report every patch into ``work``, then leave the first set-aside conflict for a person."""
    write_report(work, state, results, work, pending=[series.patches[j].name for j, _ in aside])
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
                     "candidates": res.candidates, "outcome": res.outcome}
    state.save(work)
    return Outcome(False, None, results, hunks, work,
                   _conflict_message(work, series.patches[first], hunks, results, [j for j, _ in aside]))


def _tests_of(state: State, patch: Patch) -> str:
    """The patch's test file, as the evidence names it (the one to fix when its tests cannot run)."""
    return str(test_file(Path(state.tests_dir), patch.name))


class Then(Enum):
    """What the run does with a patch once :func:`_classify` has looked at it."""

    GO_ON = "go on"  # classified: the next patch
    RESOLVE = "resolve"  # the merge conflicted: try the candidates (resolve), else set it aside
    SET_ASIDE = "set aside"  # for a person, no candidates (its tests contradict the target)


@dataclass
class Classified:
    result: Result
    then: Then = Then.GO_ON
    conflicts: list[ConflictHunk] = field(default_factory=list)  # with Then.RESOLVE: the conflicting hunks


def _classify(work: Path, state: State, patch: Patch, old_commit: str, old_parent: str, head: str,
              runner: TestRunner | None) -> Classified:
    to = state.to_version
    if applies(work, patch.raw, reverse=True):
        return Classified(Result(patch.name, "upstream",
                                 f"reverse-applies to vllm {to}: upstream has this exact change"))
    runs = _behaviour(work, patch, old_parent, runner)
    verdict, fixed, still, note = behaviour_verdict(runs, _tests_of(state, patch))
    if verdict is Verdict.UPSTREAM_BY_BEHAVIOUR:
        return Classified(Result(patch.name, "upstream-by-behaviour", note + "; dropped", absorbed=fixed,
                                 behaviour=runs))
    if verdict is Verdict.CONTRADICTED:  # never carried on tests the target contradicts: set aside
        return Classified(Result(patch.name, "contradicted", note, still_needed=still, absorbed=fixed,
                                 behaviour=runs), Then.SET_ASIDE)
    if applies(work, patch.raw):
        am(work, patch, f"vllm {to}")
        state.exported[patch.name] = "verbatim"
        if verdict is Verdict.PARTIAL:
            return Classified(Result(patch.name, "partly-upstream", note + "; the patch applies unchanged and is "
                                     "carried", still_needed=still, absorbed=fixed, behaviour=runs, carried=True))
        return Classified(Result(patch.name, "applied", f"applies to vllm {to} exactly; carried verbatim"
                                 + (f" ({note})" if runs else ""), behaviour=runs, carried=True))
    _, stderr, followed = pick(work, old_commit)
    moved = "; ".join(f"followed {f.old} into {f.new} ({f.containment:.0%} of its lines are there)"
                      for f in followed)
    if in_progress(work):
        if unmerged(work):
            return Classified(Result(patch.name, "conflict", "", behaviour=runs), Then.RESOLVE, conflict_report(work))
        if git(["diff", "--cached", "--quiet", "HEAD"], work, check=False).returncode == 0:
            abort(work)
            return Classified(Result(patch.name, "upstream", f"the 3-way merge onto vllm {to} leaves nothing to "
                                     "commit" + (f" ({moved})" if moved else ""), behaviour=runs))
        raise RebaseError(f"{patch.name}: git cherry-pick stopped: "
                          + stderr.decode(errors="replace").strip().splitlines()[-1])
    new = history.rev(work, "HEAD")
    if new == head or git(["diff", "--quiet", head, new], work, check=False).returncode == 0:
        if new != head:
            git(["reset", "-q", "--hard", head], work)
        return Classified(Result(patch.name, "upstream", f"the 3-way merge onto vllm {to} leaves nothing to commit",
                                 behaviour=runs))
    state.exported[patch.name] = new
    kept, gone = absorbed_hunks(patch.raw, format_patch(work, new))
    renames = history.renames(work, old_commit, new)
    how = "applies after a 3-way merge" + (f" ({'; '.join(filter(None, [renames, moved]))})"
                                          if renames or moved else "")
    if gone or verdict is Verdict.PARTIAL:
        parts = []
        if gone:
            parts.append(f"vllm {to} already has hunk(s) {', '.join(gone)}; still needed: {', '.join(kept)}")
        if verdict is Verdict.PARTIAL:
            parts.append(note)
        return Classified(Result(patch.name, "partly-upstream", f"{how}; " + "; ".join(parts),
                                 still_needed=kept + still, absorbed=gone + fixed, behaviour=runs, carried=True))
    return Classified(Result(patch.name, "refreshed", how + "; the refreshed patch is exported"
                             + (f" ({note})" if runs else ""), behaviour=runs, carried=True))


def _conflict_message(work: Path, patch: Patch, hunks: list[ConflictHunk], results: list[Result],
                      aside: list[int]) -> str:
    names = [results[j].name for j in aside]
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines = [f"classified {len(results)} patch(es): " + ", ".join(f"{n} {o}" for o, n in counts.items())
             + f"; {len(names)} need(s) a person: {', '.join(names)}; the report is {work / 'REBASE.md'}"]
    if results[aside[0]].outcome == "contradicted":
        lines.append(f"contradicted: {patch.name}'s tests contradict the target's own behaviour (see the report)")
        if not hunks:
            lines += [f"it is applied in {work} as the commit on top: keep it (or amend it), or drop it with "
                      "`git reset --hard HEAD~1`; then run `make rebase-continue`."]
            return "\n".join(lines)
    lines.append(f"conflict: {patch.name} does not merge onto the target; {len(hunks)} hunk(s) to resolve in {work}:")
    lines += [f"  {h.describe()}" for h in hunks]
    lines += [
        "resolve there with plain git (edit, `git add <file>`; `git cherry-pick --continue` is optional),",
        "or make the patch empty (`git checkout HEAD -- .`) to drop it; then run `make rebase-continue`;",
        "or leave it out of the series with your reason: `make rebase-continue LEFT_OUT=1 WHY=\"...\"`.",
    ]
    return "\n".join(lines)


