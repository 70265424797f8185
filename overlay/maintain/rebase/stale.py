"""Does a later pin carry the current version of each patch of the base pin?

``make rebase`` records, per patch, the sha256 of the source patch file it rebased from
(``source_sha256`` in ``patches/<to>/rebase.json``; a hand-ported patch may carry the same as a
``Rebased-From: <sha256>`` trailer, which wins). When the base pin's patch changes later, the
later pin carries an older version of it: a user moving to that release gets the old code, and
``make status`` says so. For reports written before the sha256 was recorded, the repository's
history stands in: the source patch as it was in the commit that last wrote the later pin's
copy (or, for a dropped patch, its ``rebase.json``).

A patch of the base pin that a later pin's rebase never saw (added to the series afterwards)
is ``missing``; one a person left out of that pin (``make rebase-continue LEFT_OUT=1 WHY=...``) is
``left out``, with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from overlay import digest
from overlay.build.pins import pin_dir
from overlay.build.series import Patch, Series
from overlay.errors import OverlayError
from overlay.git import git, git_text

TRAILER = "Rebased-From"


def sha256_of(raw: bytes) -> str:
    return digest.of_bytes(raw)


@dataclass(frozen=True)
class LaterPinNote:
    """What one later pin says about one patch of the base pin."""

    pin: str
    state: str  # "stale" | "missing" | "left out"
    detail: str

    def describe(self) -> str:
        return f"{self.pin}: {self.state}: {self.detail}"


class _NotAReport(OverlayError):
    pass


def rebase_report(report: Path) -> dict | None:
    """``patches/<to>/rebase.json`` as the rebase wrote it, read bounded (:mod:`overlay.jsonfile`) and never through
    a link out of the patches folder: its ``to`` a release, ``from`` a string, ``patches`` a list, of which only
    the objects with a string ``name`` are kept (each reader judges their other fields); None for anything else
    (``make status`` still works without it)."""
    from packaging.version import InvalidVersion, Version

    from overlay import jsonfile, textfile

    try:
        textfile.refuse_link_out(report, report.parent.parent, _NotAReport, "not read")
        doc = jsonfile.read(report, _NotAReport, "a rebase report")
        Version(jsonfile.need(doc.get("to"), str, "to", "", _NotAReport))
        jsonfile.get(doc, "from", str, "", "", _NotAReport)
        entries = jsonfile.need(doc.get("patches"), list, "patches", "", _NotAReport)
    except (_NotAReport, InvalidVersion):
        return None
    doc["patches"] = [e for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)]
    return doc


def _reports(patches_root: Path, version: str) -> list[tuple[str, dict]]:
    """(later version, its rebase.json) for every pin rebased from ``version``, oldest first."""
    from packaging.version import Version

    found: list[tuple[Version, str, dict]] = []
    for report in patches_root.glob("*/rebase.json"):
        doc = rebase_report(report)
        if doc is None:
            continue  # not a report this tool wrote
        if doc.get("from") == version and report.parent.name == doc["to"]:
            found.append((Version(doc["to"]), doc["to"], doc))
    return [(v, doc) for _, v, doc in sorted(found, key=lambda t: t[0])]


def _repo_of(path: Path) -> Path | None:
    proc = git(["rev-parse", "--show-toplevel"], path, check=False)
    return Path(proc.stdout.decode().strip()) if proc.returncode == 0 else None


def _sha_at_last_write(repo: Path, written: Path, source: Path) -> str | None:
    """sha256 of ``source`` as it was in the last commit that wrote ``written`` (None: unknown)."""
    rel_written = os.path.relpath(written.resolve(), repo)
    rel_source = os.path.relpath(source.resolve(), repo)
    commit = git_text(["log", "-1", "--format=%H", "--", rel_written], repo).strip()
    if not commit:
        return None
    proc = git(["show", f"{commit}:{rel_source}"], repo, check=False)
    return sha256_of(proc.stdout) if proc.returncode == 0 else None


def later_pin_notes(patches_root: Path, version: str) -> dict[str, list[LaterPinNote]]:
    """Patch name -> notes from the later pins rebased from ``version`` (only problems)."""
    source_dir = pin_dir(patches_root, version)
    series = Series.load(source_dir)
    reports = _reports(patches_root, version)
    if not reports:
        return {}
    repo = _repo_of(patches_root)
    notes: dict[str, list[LaterPinNote]] = {}
    for later, doc in reports:
        later_dir = pin_dir(patches_root, later)
        entries = {e.get("name"): e for e in doc.get("patches", []) if isinstance(e, dict)}
        try:
            carried = {p.name: p for p in Series.load(later_dir).patches}
        except OverlayError:
            carried = {}
        for patch in series.patches:
            note = _note(patch, later, later_dir, entries.get(patch.name), carried.get(patch.name), repo)
            if note is not None:
                notes.setdefault(patch.name, []).append(note)
    return notes


def _note(patch: Patch, later: str, later_dir: Path, entry: dict | None, copy: Patch | None,
          repo: Path | None) -> LaterPinNote | None:
    current = sha256_of(patch.raw)
    if entry is None and copy is None:
        return LaterPinNote(later, "missing", f"the rebase onto {later} did not see it (added to the series "
                                              f"later); `make rebase TO={later}` again, or carry it by hand")
    if copy is None and entry is not None and entry.get("outcome") == "left-out":
        return LaterPinNote(later, "left out", f"by a person: {entry.get('reason') or entry.get('evidence')}")
    if copy is not None and copy.raw == patch.raw:
        return None
    recorded, how = None, ""
    if copy is not None and copy.trailers.get(TRAILER):
        recorded, how = copy.trailers[TRAILER], f"its {TRAILER}: trailer"
    elif entry is not None and entry.get("source_sha256"):
        recorded, how = str(entry["source_sha256"]), "rebase.json"
    elif repo is not None:
        written = later_dir / patch.name if copy is not None else later_dir / "rebase.json"
        recorded, how = _sha_at_last_write(repo, written, patch.path), "the git history"
    if recorded is None or recorded == current:
        return None
    what = "carries an older version" if copy is not None else "dropped it judging an older version"
    return LaterPinNote(later, "stale", f"{what} (rebased from sha256 {recorded[:12]} per {how}; the source "
                                        f"is now {current[:12]}); `make rebase TO={later}` again, or port the "
                                        f"change and record sha256 {current} (rebase.json source_sha256, or a "
                                        f"{TRAILER}: trailer)")
