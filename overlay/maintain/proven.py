"""What is proven of each patch, per release, said once (``make status``): whether it was rebased (the
outcome the rebase that wrote that release's series gave it), whether it is on GLM-5's path (the rebase's
``off-model-path`` verdict, else what ran in an engine), and where an engine proved it (the engine-check
records under ``docs/records/engine/``: which record, which DCP size, when; ``engine_records``).

A record proves the version of a patch it ran: one that names its series (``meta.series``) says whether
that was this version; one that does not is older than the patch's ``Last-Update`` or not, and a
declared act counts there only when it is not (the record cannot say the build carried the patch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from overlay.build.pins import carried_releases, release_order
from overlay.build.series import Patch, Series
from overlay.errors import OverlayError
from overlay.maintain.engine_records import RAN, EngineRun, Proof, engine_runs, proofs, unattributed
from overlay.maintain.rebase.stale import rebase_report


@dataclass(frozen=True)
class PatchProof:
    """One patch of one release's series."""

    name: str
    rebased: str
    on_path: str
    engine: tuple[str, ...]  # one line per record that proves it: where, when, DCP size, how

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "rebased": self.rebased, "on_path": self.on_path, "engine": list(self.engine)}


@dataclass(frozen=True)
class ReleaseProof:
    """One release in ``patches/``: how its series came, each patch, the engine runs of its build."""

    release: str
    source: str
    patches: tuple[PatchProof, ...]
    runs: tuple[str, ...]  # every recorded run of the build: where, when, verdict, DCP sizes

    def to_dict(self) -> dict[str, object]:
        return {"release": self.release, "source": self.source, "patches": [p.to_dict() for p in self.patches],
                "runs": list(self.runs)}


def _rebase_report(folder: Path) -> tuple[str, dict[str, dict]]:
    """(the release rebased from, patch name -> its entry) of ``folder/rebase.json``; ("", {}) without one."""
    doc = rebase_report(folder / "rebase.json") if (folder / "rebase.json").exists() else None
    if doc is None or not doc.get("from"):
        return "", {}
    return str(doc["from"]), {str(e["name"]): e for e in doc["patches"] if "name" in e}


def _version_note(proof: Proof, patch: Patch) -> str | None:
    """How the run's version of ``patch`` relates to today's: "" this one (or not known to differ), a note,
    or None when the run cannot be said to have carried it at all."""
    run, last = proof.run, patch.trailers.get("Last-Update", "")
    if run.series:
        return "" if run.series.get(patch.name) == patch.sha256 else " (an earlier version of it)"
    if last and run.day < last:
        return None if proof.kind == "acts" else f" (before its Last-Update, {last})"
    return ""


def _run_label(run: EngineRun) -> str:
    """``where (day, GPUs ...)``: how a line names the run it speaks of."""
    return f"{run.where} ({run.day}" + (f", GPUs {run.gpus}" if run.gpus else "") + ")"


def _engine_lines(patch: Patch, runs: list[EngineRun]) -> tuple[list[str], list[Proof]]:
    """One line per run that proves ``patch``, and the proofs of runs that carried this version of it."""
    lines, current = [], []
    for run in runs:
        proof = proofs(run).get(patch.name)
        note = _version_note(proof, patch) if proof else None
        if proof is None or note is None:
            continue
        lines.append(f"{_run_label(run)} DCP {proof.dcp}: {proof.detail}{note}")
        if not note:  # a run of another version of the patch says nothing of where this one runs
            current.append(proof)
    return lines, current


def _unexercised(patch: Patch, runs: list[EngineRun]) -> list[str]:
    """For a patch no run proves: the runs that carried this version of it (``meta.series``), passed, and
    measured its lines under coverage with none of them run. Not a proof, said so: the build served with it,
    and the cases did not reach it (e.g. a DCP patch at DCP 1)."""
    lines = []
    for run in runs:
        if run.series.get(patch.name) != patch.sha256:
            continue
        seen = [(c.dcp, added) for c in run.cases if not c.variant and c.verdict in RAN
                for name, _, added in c.liveness if name == patch.name]
        if seen:
            dcp = ", ".join(map(str, sorted({d for d, _ in seen})))
            lines.append(f"not proven: {_run_label(run)} DCP {dcp}: its build served with this version "
                         f"and {len(seen)} case(s) passed, but none of its {seen[0][1]} added statements ran")
    return lines


def _on_path(entry: dict | None, current: list[Proof]) -> str:
    if entry and (entry.get("off_model_path") or entry.get("outcome") == "off-model-path"):
        return "no: off-model-path in its rebase.json (the patch is in the tree, GLM-5's path does not take it)"
    if entry and entry.get("on_model_path"):
        return f"yes, by its GLM-5 path tests (rebase.json): {entry['on_model_path']}"
    ran = [p for p in current if p.kind in ("variant", "ran")]
    if ran:
        best = max(ran, key=lambda p: (p.kind == "variant", p.dcp, p.weight))
        return f"yes, in GLM-5's engine: {best.detail} ({best.run.where}, DCP {best.dcp})"
    return "not judged: no rebase verdict, and no engine record shows its lines run or its seed bug"


def release_proof(patches_root: Path, release: str, runs: list[EngineRun]) -> ReleaseProof:
    """What is proven of ``release``'s series (``patches/<release>/``), from ``runs`` (its build's records)."""
    folder = patches_root / release
    series = Series.load(folder)
    base, entries = _rebase_report(folder)
    rows = []
    for patch in series.patches:
        entry = entries.get(patch.name)
        if not base:
            rebased = "- (written on this release)"
        elif entry is None:
            rebased = f"not in rebase.json: added after the rebase from {base}"
        else:
            rebased = f"{entry.get('outcome')} from {base}"
        lines, current = _engine_lines(patch, runs)
        rows.append(PatchProof(patch.name, rebased, _on_path(entry, current),
                               tuple(lines or _unexercised(patch, runs))
                               or ("never: no engine-check record of this build shows it",)))
    recorded = tuple(f"{r.where} ({r.when}): {r.verdict}; DCP {', '.join(map(str, sorted({c.dcp for c in r.cases})))}"
                     for r in runs)
    return ReleaseProof(release, f"rebased from {base}" if base else "written on this release", tuple(rows), recorded)


def proven(patches_root: Path, records: Path,
           runs: list[EngineRun] | None = None) -> tuple[list[ReleaseProof], list[str]]:
    """Every release ``patches_root`` holds a series for, oldest first, and the records that name no build
    (``runs``: the records already read, :func:`overlay.maintain.engine_records.engine_runs`)."""
    releases = carried_releases(patches_root)
    runs = engine_runs(records) if runs is None else runs
    out = []
    for release in releases:
        try:
            out.append(release_proof(patches_root, release, [r for r in runs if r.release == release]))
        except OverlayError:
            continue  # a folder that is not a release: `make status` of that release says why
    return out, unattributed(records)


def retired(patches_root: Path, runs: list[EngineRun]) -> dict[str, int]:
    """Release -> how many of the engine records ``runs`` name a build of it, for the releases no longer
    carried (their folders retired from ``patches/``; the records stay as history)."""
    carried = set(carried_releases(patches_root))
    found: dict[str, int] = {}
    for run in runs:
        if run.release not in carried:
            found[run.release] = found.get(run.release, 0) + 1
    return dict(sorted(found.items(), key=lambda kv: release_order(kv[0])))


def format_proven(releases: list[ReleaseProof], unnamed: list[str], records: Path,
                  unread: list[str] | None = None, *, default: str | None = None,
                  gone: dict[str, int] | None = None) -> str:
    """The section ``make status`` prints after its table: which releases are carried (``default``: the
    default's, the oldest being production's), then each; ``unread``: one line per record that cannot be read
    (``engine_records.unreadable``), counted for none; ``gone``: the retired releases' records (:func:`retired`)."""
    try:
        shown = records.relative_to(Path.cwd())
    except ValueError:
        shown = records
    lines = [""]
    if releases:
        said = []
        for i, rel in enumerate(releases):
            roles = [*(["production's, the oldest"] if i == 0 and len(releases) > 1 else []),
                     *(["the default"] if rel.release == default else [])]
            said.append(f"{rel.release} ({', '.join(roles)})" if roles else rel.release)
        lines.append(f"Carried releases: {', '.join(said)}")
    lines.append(f"What is proven, per release and patch (rebased; on GLM-5's path; proven in an engine: the "
                 f"records in {shown}/):")
    for rel in releases:
        lines.append(f"{rel.release} ({len(rel.patches)} patches, {rel.source}; "
                     f"{len(rel.runs)} engine-check record(s) of its build)")
        for p in rel.patches:
            lines += [f"  {p.name}", f"    rebased: {p.rebased}", f"    on GLM-5's path: {p.on_path}"]
            lines += [f"    engine: {e}" for e in p.engine]
    if unnamed:
        lines.append(f"records that name no build (meta.vllm), counted for none: {', '.join(unnamed)}")
    lines += [f"record not read, counted for none: {line}" for line in unread or ()]
    if gone:
        lines.append("records of releases no longer carried (retired, kept as history): "
                     + ", ".join(f"{r} ({n})" for r, n in gone.items()))
    return "\n".join(lines) + "\n"
