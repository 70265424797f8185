"""The CLI's entry points: ``make rebase`` (fetch and verify both releases, then run) and
``make rebase-continue``."""

from __future__ import annotations

from pathlib import Path

from overlay.build.pins import Pin, check_version, load_pin, pin_dir, release_order
from overlay.build.series import Series
from overlay.lock import holder_of
from overlay.maintain.rebase.classify import resume, start
from overlay.maintain.rebase.deps import deps_for
from overlay.maintain.rebase.runcache import maybe_cached
from overlay.maintain.rebase.state import STATE, Outcome, RebaseError, State, prepared_pin, work_dir, work_lock
from overlay.maintain.rebase.testrun import pytest_runner
from overlay.maintain.workspace import extract_text_tree
from overlay.releases.facts import ReleaseFacts, ReleaseFactsError, release_facts


def rebase_release(patches_root: Path, from_version: str, to_version: str, *,
                   work_root: Path = Path(".work"), tests_dir: Path = Path("tests/patches"),
                   run_tests: bool = True) -> Outcome:
    """``make rebase TO=...``: fetch and verify both wheels, then :func:`start`."""
    from overlay.build.fetch import fetch_release, fetch_wheel

    check_version(to_version, "TO (--to)")  # before it names a folder, a download or a report
    check_forward(patches_root, check_version(from_version, "VLLM (--vllm)"), to_version)
    Series.load(pin_dir(patches_root, from_version)).require_patches(f"there is nothing to carry onto {to_version}")
    base_pin = load_pin(patches_root, from_version)
    base_wheel = fetch_wheel(base_pin)
    prepared = prepared_pin(patches_root, to_version)
    if prepared is not None:
        target_pin, target_wheel = prepared, fetch_wheel(prepared)
    else:
        target_pin, target_wheel = fetch_release(to_version)
    facts = {"from": release_facts_of(base_wheel).to_dict(), "to": release_facts_of(target_wheel).to_dict()}
    deps = deps_for({from_version: base_wheel, target_pin.version: target_wheel})
    runner = (maybe_cached(pytest_runner(tests_dir, cwd=Path.cwd(), deps=deps), tests_dir, cwd=Path.cwd())
              if run_tests else None)
    return start(patches_root, from_version, target_pin,
                 lambda d: _extract(base_wheel, d), lambda d: _extract(target_wheel, d),
                 work=work_dir(to_version, work_root), tests_dir=tests_dir, runner=runner, facts=facts)


def release_facts_of(wheel: Path) -> ReleaseFacts:
    """The release facts of a release's wheel (its GLM-5 path, runner, DCP defaults: ``REBASE.md`` says what
    changed); a release they cannot describe is refused in one line before the run, whose GLM-5 path
    tests could judge nothing there."""
    try:
        return release_facts(wheel)
    except ReleaseFactsError as exc:
        raise RebaseError(f"rebase: {exc}") from None


def check_forward(patches_root: Path, from_version: str, to_version: str) -> None:
    """A rebase carries ``patches/<from>/`` onto a later release: the series' own release (whose folder is the
    live series, not an earlier rebase's result to remove) or an older one is refused before any download."""
    series = f"{pin_dir(patches_root, from_version)}/, VLLM={from_version}"
    if to_version == from_version:
        raise RebaseError(f"TO (--to) {to_version} is the series' own release ({series}): a rebase carries that "
                          f"series onto a later release; name one after {from_version}")
    if release_order(to_version) < release_order(from_version):
        raise RebaseError(f"TO (--to) {to_version} is older than the series' release ({series}): a rebase carries "
                          f"a series forward only; name a release after {from_version}")


def continue_release(to_version: str | None = None, *, work_root: Path = Path(".work"),
                     tests_dir: Path = Path("tests/patches"), run_tests: bool = True,
                     left_out: str | None = None, why: str = "") -> Outcome:
    """``make rebase-continue``: the one rebase in progress (or the one onto ``to_version``); ``why``
    (``WHY=...``): the person's reason for their resolution; with ``left_out`` (``LEFT_OUT=1 WHY=...``)
    the patch it stopped at is left out for that reason."""
    if to_version:
        work = work_dir(check_version(to_version, "TO (--to)"), work_root)
    else:
        found = sorted(p for p in work_root.glob("rebase-*") if (p / ".git" / STATE).is_file())
        if not found:
            half = sorted(p.name for p in work_root.glob("rebase-*") if p.is_dir() and not p.name.endswith("-stopped")
                          and holder_of(work_lock(p)) is None)  # a live rebase's, still preparing: not to remove
            raise RebaseError(f"no rebase in progress under {work_root}/" + (
                f" ({', '.join(half)}: stopped before it began; remove it and run make rebase again)" if half else ""))
        if len(found) > 1:
            raise RebaseError(f"several rebases in progress ({', '.join(p.name for p in found)}); pass TO=")
        work = found[0]
    runner = None
    if run_tests:
        from overlay.build.fetch import fetch_wheel

        state = State.load(work)
        target = Pin.from_dict(state.pin, f"target pin of the rebase onto {state.to_version}")
        wheels = {state.from_version: fetch_wheel(load_pin(Path(state.patches_root), state.from_version)),
                  target.version: fetch_wheel(target)}
        runner = maybe_cached(pytest_runner(tests_dir, cwd=Path.cwd(), deps=deps_for(wheels)), tests_dir,
                              cwd=Path.cwd())
    return resume(work, runner=runner, left_out=left_out, why=why)


def _extract(wheel: Path, dest: Path) -> None:
    extract_text_tree(wheel, dest)
