"""``make patch-tests-matrix``: every patch's own tests on every release of a range, with and without
the patch, as one table of patch x release.

For each release the series is replayed in its order onto the release's tree (in a scratch git
repository built as ``make rebase`` builds its own): a patch is applied as the release's own
series carries it (``patches/<release>/``), else by the same 3-way merge the rebase tries. Each
patch's tests run on the tree just before it (the release plus the earlier patches: "without
it") and, when they do not pass there, on the tree with it. A cell is one of

``passes without it``
    its tests pass on the release with the earlier patches, without it: the release behaves as they
    expect, and the patch is not applied there. Not the rebase's ``upstream-by-behaviour``, which
    also needs them to fail on the old base (:func:`overlay.maintain.rebase.verdict.behaviour_verdict`);
``passes with the patch``
    its tests fail without it by behaviour and pass with it;
``off the model's path``
    with the patch some of its tests find it in the tree but off the path the model runs
    (``compat.OffModelPath``: the GLM-5 path harness; red): it changes nothing the model runs there;
``fails``
    they fail by behaviour with the patch too (red), or the patch does not merge onto the
    release (explained: the rebase's job, not the tests');
``cannot run``
    a harness error (red: the tests do not follow this release's API; fix the named test file),
    or every test skipped, with the reason (explained).

Red cells make the run exit 1: the tests cannot judge that release.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.pins import check_version, is_release, pin_dir, release_order
from overlay.build.series import Patch, Series
from overlay.errors import OverlayError, SeriesError
from overlay.git import git, git_text
from overlay.maintain.rebase.classify import prepare
from overlay.maintain.rebase.history import tree_at
from overlay.maintain.rebase.resolve import abort, pick
from overlay.maintain.rebase.testrun import TestRun, TestRunner, test_file
from overlay.maintain.replay import am, in_progress, unmerged
from overlay.maintain.trees import copy_tree

VERDICTS = ("passes without it", "passes with the patch", "off the model's path", "fails", "cannot run")


@dataclass
class Cell:
    """One patch on one release."""

    patch: str
    release: str
    verdict: str  # one of VERDICTS
    why: str
    red: bool = False  # the tests cannot judge this release, or contradict the patch
    applied: str = ""  # how the patch came onto the release ("carried", "3-way merge", "" not applied)
    without: dict = field(default_factory=dict)  # TestRun.to_dict()
    with_patch: dict = field(default_factory=dict)
    seconds: float = 0.0

    def short(self) -> str:
        """The table's text: the verdict, said more exactly where it has two readings; red in bold."""
        text = self.verdict
        if self.verdict == "fails":
            text = "fails with the patch" if self.with_patch else "fails without it; not applied"
        elif self.verdict == "cannot run" and not self.red:
            text = "cannot run (skipped)"
        return f"**{text}**" if self.red else text


Trees = Callable[[str], Path]
"""``tree(version)`` is that release's unpacked text tree (:func:`overlay.maintain.trees.release_tree`)."""


def run_matrix(patches_root: Path, from_version: str, releases: list[str], trees: Trees, runner: TestRunner,
               *, tests_dir: Path, progress: Callable[[str], None] | None = None) -> list[Cell]:
    """Every patch of ``patches/<from_version>/`` on every one of ``releases``."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    series = Series.load(pin_dir(patches_root, from_version))
    if series.kernel_patches:
        raise OverlayError("kernel patches cannot be replayed onto other releases yet: "
                           + ", ".join(p.name for p in series.kernel_patches))
    base = trees(from_version)
    cells: list[Cell] = []
    for release in releases:
        carried = _carried(patches_root, release)
        say(f"matrix {release}: {len(series.patches)} patch(es), "
            + (f"as patches/{release}/ carries them" if carried is not None else "replayed by 3-way merge"))
        target = trees(release)
        with scratch("overlay-matrix-") as tmp:  # a replay repository: a killed run's removed by the next
            work = Path(tmp) / "repo"
            old = prepare(work, series, from_version, release, partial(copy_tree, base),
                          partial(copy_tree, target))
            for patch, old_commit in zip(series.patches, old, strict=True):
                cell = _cell(work, patch, old_commit, release, carried, runner, tests_dir, Path(tmp))
                say(f"matrix {release}: {patch.name}: {cell.verdict}{' (red)' if cell.red else ''}: {cell.why} "
                    f"({cell.seconds:.0f} s)")
                cells.append(cell)
    return cells


def _carried(patches_root: Path, release: str) -> dict[str, Patch] | None:
    """The patches ``patches/<release>/series`` carries, by name; ``None`` without a series there."""
    folder = pin_dir(patches_root, release)
    if not (folder / "series").is_file():
        return None
    return {p.name: p for p in Series.load(folder).patches}


def _cell(work: Path, patch: Patch, old_commit: str, release: str, carried: dict[str, Patch] | None,
          runner: TestRunner, tests_dir: Path, tmp: Path) -> Cell:
    t0 = time.monotonic()
    head = git_text(["rev-parse", "HEAD"], work).strip()
    without = runner(patch, tree_at(work, head, tmp / f"{patch.name}-without"))
    if without is None:
        return Cell(patch.name, release, "cannot run", f"no {test_file(tests_dir, patch.name).name}", red=True,
                    seconds=time.monotonic() - t0)
    applied, note = ("", "")
    with_patch: TestRun | None = None
    if without.status != "passed":
        applied, note = _apply(work, patch, old_commit, release, carried)
        if applied:
            with_patch = runner(patch, tree_at(work, "HEAD", tmp / f"{patch.name}-with"))
    verdict, red, why = judge(without, with_patch, note)
    return Cell(patch.name, release, verdict, why, red, applied, without.to_dict(),
                with_patch.to_dict() if with_patch else {}, time.monotonic() - t0)


def _apply(work: Path, patch: Patch, old_commit: str, release: str,
           carried: dict[str, Patch] | None) -> tuple[str, str]:
    """Put ``patch`` on ``HEAD``: (how, "") when it is there, ("", why not) otherwise."""
    if carried is not None:
        if patch.name not in carried:
            return "", f"patches/{release}/ does not carry it"
        try:
            am(work, carried[patch.name], f"vllm {release} after the earlier patches")
        except SeriesError:
            return "", f"the patch patches/{release}/ carries does not apply after the earlier ones"
        return "carried", ""
    head = git_text(["rev-parse", "HEAD"], work).strip()
    pick(work, old_commit)
    if in_progress(work):
        conflicted = unmerged(work)
        abort(work)
        if conflicted:
            return "", f"it does not merge onto {release} (conflicts in {', '.join(conflicted)}): `make rebase`"
        return "", "the 3-way merge leaves nothing to commit"
    if git(["diff", "--quiet", head, "HEAD"], work, check=False).returncode == 0:
        git(["reset", "-q", "--hard", head], work)
        return "", "the 3-way merge leaves nothing to commit"
    return "3-way merge", ""


def judge(without: TestRun, with_patch: TestRun | None, note: str = "") -> tuple[str, bool, str]:
    """(verdict, red, why) of a cell from its two runs; ``note``: why the patch was not applied."""
    if without.status == "passed":
        return "passes without it", False, f"{len(without.passed)} passed" + _skips(without)
    if _blocked(without):
        return "cannot run", without.status != "skipped", "without it: " + without.first_error()
    failing = without.behaviour_failed
    first = f"{len(failing)} of {len(failing) + len(without.passed)} fail without it ({_first_behaviour(without)})"
    if with_patch is None:
        return "fails", False, f"{first}; the patch is not applied: {note}"
    if with_patch.status == "passed":
        return "passes with the patch", False, f"{first}; {len(with_patch.passed)} pass with it" + _skips(with_patch)
    if _blocked(with_patch):
        return "cannot run", with_patch.status != "skipped", "with the patch: " + with_patch.first_error()
    if with_patch.off_path_failed:
        off = with_patch.off_path_failed
        return "off the model's path", True, (f"{first}; with the patch {len(off)} find it off the path the model "
                                              f"runs ({_first_behaviour(with_patch)})")
    return "fails", True, f"{first}; with the patch {len(with_patch.behaviour_failed)} still fail " \
                          f"({_first_behaviour(with_patch)})"


def _blocked(run: TestRun) -> bool:
    """The run judged nothing (cannot run), or some of its tests could not get to the behaviour."""
    return run.cannot_run or bool(run.harness_failed)


def _first_behaviour(run: TestRun) -> str:
    for test, kind, why in zip(run.failed, run.kinds, run.reasons, strict=False):
        if kind in ("behaviour", "off-path"):
            return f"{test}: {why}"
    return run.summary


def _skips(run: TestRun) -> str:
    return f", {len(run.skipped)} skipped ({run.skip_reason})" if run.skipped else ""


def write_report(out: Path, cells: list[Cell], releases: list[str], from_version: str) -> Path:
    """``matrix.json`` and ``matrix.md`` (the table, then each cell's reason) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"from": from_version, "releases": releases, "cells": [asdict(c) for c in cells]}
    (out / "matrix.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "matrix.md").write_text(markdown(cells, releases, from_version))
    return out / "matrix.md"


def markdown(cells: list[Cell], releases: list[str], from_version: str) -> str:
    patches = list(dict.fromkeys(c.patch for c in cells))
    by = {(c.patch, c.release): c for c in cells}
    lines = [f"# Patch tests of the {from_version} series on every release", "",
             "Each patch's own tests on the release with the earlier patches of the series, without it and "
             "with it. **Red** (bold) cells: the tests cannot judge that release (a harness error), or fail with "
             "the patch.", "",
             "| patch | " + " | ".join(releases) + " |", "| --- |" + " --- |" * len(releases)]
    for name in patches:
        row = []
        for release in releases:
            c = by.get((name, release))
            row.append("" if c is None else c.short())
        lines.append(f"| `{name.removesuffix('.patch')}` | " + " | ".join(row) + " |")
    lines += ["", "## Why, per cell", ""]
    for c in cells:
        how = {"": "", "carried": f"; applied as patches/{c.release}/ carries it"}.get(
            c.applied, f"; applied by {c.applied}")
        lines.append(f"- `{c.patch.removesuffix('.patch')}` on {c.release}: {c.verdict}{' (red)' if c.red else ''}"
                     f": {c.why}{how} ({c.seconds:.0f} s)")
    return "\n".join(lines) + "\n"


def newer_pinned(from_version: str, roots: list[Path]) -> list[str]:
    """Every release newer than ``from_version`` with a ``pin.toml`` in one of ``roots`` (the release
    folders of ``patches/`` and the pins kept for tests), oldest first: the matrix's default columns."""
    found = {p.parent.name for root in roots if root.is_dir() for p in root.glob("*/pin.toml")
             if is_release(p.parent.name)}
    return sorted((v for v in found if release_order(v) > release_order(from_version)), key=release_order)


def main(patches_root: Path, from_version: str, releases: list[str] | None, out: Path, tests_dir: Path,
         pins_roots: list[Path]) -> int:
    """The CLI's run: fetch and verify each release's tree, run the matrix, write the report;
    exit 1 when a cell is red. No ``releases``: :func:`newer_pinned`."""
    from overlay.build.fetch import fetch_wheel
    from overlay.maintain.rebase.deps import deps_for
    from overlay.maintain.rebase.runcache import maybe_cached
    from overlay.maintain.rebase.testrun import pytest_runner
    from overlay.maintain.trees import release_tree

    if releases is None:
        releases = newer_pinned(from_version, [patches_root, *pins_roots])
        if not releases:
            raise OverlayError(f"no release newer than {from_version} is pinned in {patches_root}/ or "
                               f"{', '.join(map(str, pins_roots))}: name the columns (RELEASES=\"x.y.z ...\")")
    for release in releases:
        check_version(release, "--releases")
    twice = sorted({r for r in releases if releases.count(r) > 1}, key=releases.index)
    if twice:
        raise OverlayError(f"--releases: {', '.join(twice)} given twice (each would be fetched and run twice)")
    Series.load(pin_dir(patches_root, from_version)).require_patches("the matrix would have no row")
    if not test_file(tests_dir, "x").parent.is_dir():
        raise OverlayError(f"{tests_dir}: no such folder of patch tests")
    roots = [patches_root, *pins_roots]
    pins = {v: release_tree(v, roots) for v in dict.fromkeys([from_version, *releases])}
    deps = deps_for({v: fetch_wheel(pin) for v, (pin, _) in pins.items()})
    cells = run_matrix(patches_root, from_version, releases, lambda v: pins[v][1],
                       maybe_cached(pytest_runner(tests_dir, cwd=Path.cwd(), deps=deps), tests_dir, cwd=Path.cwd()),
                       tests_dir=tests_dir)
    report = write_report(out, cells, releases, from_version)
    red = [c for c in cells if c.red]
    counts = {v: sum(c.verdict == v for c in cells) for v in VERDICTS}
    print(", ".join(f"{n} {v}" for v, n in counts.items() if n) + f"; {len(red)} red; report {report}",
          file=sys.stderr)
    return 1 if red else 0
