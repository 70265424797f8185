"""``make status``: one row per patch: name, subject, origin, kind, files, applies or not.

The release that absorbed a patch comes from its ``Applied-Upstream:`` trailer, or else from
the ``rebase.json`` files that ``make rebase`` wrote for later releases (the first release
where the patch was found ``upstream`` or ``upstream-by-behaviour``; ``partly <release>`` when
only part of it was). Each row also says when a later pin (one whose ``rebase.json`` says it
was rebased from this one) carries an older version of the patch, or lacks it
(:mod:`overlay.maintain.rebase.stale`). A ``rebase.json`` entry may also say that the patch, as
carried there, does not run on the served model's path (``off_model_path``: why, in a sentence); the
row shows it for that pin's own series and as a later pin's note for the pin it was rebased from.
"""

from __future__ import annotations

import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from overlay.build.apply import apply_series, wheel_reader
from overlay.build.fetch import fetch_wheel
from overlay.build.pins import load_pin, pin_dir
from overlay.build.series import Series
from overlay.errors import ApplyError
from overlay.maintain.rebase.stale import later_pin_notes, rebase_report
from overlay.maintain.rebase.state import UPSTREAM as UPSTREAM_OUTCOMES


@dataclass(frozen=True)
class PatchStatus:
    """The state of one patch against the pinned base."""

    name: str
    subject: str
    origin: str
    kind: str
    files: tuple[str, ...]
    applies: bool
    detail: str
    applied_upstream: str
    later: tuple[str, ...] = ()  # "<pin>: stale: ..." / "<pin>: missing: ..." / "<pin>: off the model's path: ..."
    notes: tuple[str, ...] = ()  # what this pin's own rebase.json says of it ("off the model's path: ...")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["files"] = list(self.files)
        d["later"] = list(self.later)
        d["notes"] = list(self.notes)
        return d


OFF_MODEL_PATH = "off_model_path"  # a rebase.json entry's key: why the carried patch does not run on the model's path
OFF_MODEL_PATH_LABEL = "off the model's path"


def off_path_notes(patches_root: Path, version: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """What the ``rebase.json`` reports say of patches that do not run on the model's path.

    Returns (own, later): patch name -> notes from ``patches/<version>/rebase.json`` (this pin's own
    rebase), and patch name -> ``"<pin>: off the model's path: ..."`` from the pins rebased from
    ``version``, oldest first.
    """
    from packaging.version import Version

    own: dict[str, list[str]] = {}
    later: list[tuple[Version, str, str]] = []
    for report in patches_root.glob("*/rebase.json"):
        doc = rebase_report(report)
        if doc is None:
            continue  # not a rebase report this tool wrote; status must still work
        release, entries = Version(doc["to"]), doc["patches"]
        if report.parent.name != doc["to"] or version not in (doc["to"], doc.get("from")):
            continue
        for entry in entries:
            why = entry.get(OFF_MODEL_PATH) if isinstance(entry, dict) else None
            if not why and isinstance(entry, dict) and entry.get("outcome") == "off-model-path":
                why = entry.get("evidence")  # the rebase's own outcome (state.OUTCOMES)
            name = entry.get("name") if isinstance(entry, dict) else None
            if not (isinstance(why, str) and why.strip() and isinstance(name, str)):
                continue
            if doc["to"] == version:
                own.setdefault(name, []).append(f"{OFF_MODEL_PATH_LABEL}: {why.strip()}")
            else:
                later.append((release, name, f"{doc['to']}: {OFF_MODEL_PATH_LABEL}: {why.strip()}"))
    by_name: dict[str, list[str]] = {}
    for _, name, note in sorted(later, key=lambda t: t[0]):
        by_name.setdefault(name, []).append(note)
    return own, by_name


def absorbed_in(patches_root: Path, version: str) -> dict[str, str]:
    """Patch name -> first later release whose rebase found it upstream (from ``rebase.json``)."""
    from packaging.version import Version

    found: dict[str, tuple[Version, str]] = {}
    partly: dict[str, tuple[Version, str]] = {}
    for report in patches_root.glob("*/rebase.json"):
        doc = rebase_report(report)
        if doc is None:
            continue  # not a rebase report this tool wrote; status must still work
        release, entries = Version(doc["to"]), doc["patches"]
        if doc.get("from") != version:
            continue
        for entry in entries:
            outcome, evidence = entry.get("outcome"), str(entry.get("evidence", ""))
            if outcome == "left-out":
                into = None  # left out by a person, not upstream: later_pin_notes says why
            elif outcome in UPSTREAM_OUTCOMES or entry.get("carried") is False:
                into = found  # dropped: upstream has it (a resolved conflict may drop it too)
            elif outcome == "partly-upstream" or evidence.startswith("partly upstream"):
                into = partly
            else:
                into = None
            name = entry.get("name")
            if into is not None and name and (name not in into or release < into[name][0]):
                into[name] = (release, str(release))
    out = {name: f"partly {v}" for name, (_, v) in partly.items()}
    out.update({name: v for name, (_, v) in found.items()})
    return out


def series_status(patches_root: Path, version: str, *, base_wheel: Path | None = None) -> list[PatchStatus]:
    """Apply the series cumulatively and report, per patch, whether it applies."""
    pin = load_pin(patches_root, version)
    series = Series.load(pin_dir(patches_root, version))
    wheel = base_wheel or fetch_wheel(pin)
    rows: list[PatchStatus] = []
    absorbed = absorbed_in(patches_root, version)
    later = later_pin_notes(patches_root, version)
    own_off, later_off = off_path_notes(patches_root, version)
    with zipfile.ZipFile(wheel) as zf:
        read_base = wheel_reader(zf)
        # The files as the patches that applied so far left them (None: deleted). Each patch is
        # applied once, on top of that, instead of the whole good prefix again.
        state: dict[str, bytes | None] = {}

        def read(path: str) -> bytes | None:
            return state[path] if path in state else read_base(path)

        for patch in series.patches:
            if patch.kind == "kernel":
                # Compiled sources are not in the wheel; make image applies them to the sdist.
                ok, detail = True, "kernel patch: applied by `make image` to the source"
            else:
                try:
                    applied = apply_series((patch,), read, label=f"vllm {pin.version}")
                    ok, detail = True, ""
                    state.update(applied.changed)
                    state.update(dict.fromkeys(applied.deleted))
                except ApplyError as exc:
                    ok, detail = False, str(exc)
            rows.append(PatchStatus(patch.name, patch.subject, patch.origin, patch.kind,
                                    patch.touched, ok, detail,
                                    patch.applied_upstream or absorbed.get(patch.name, ""),
                                    (*(n.describe() for n in later.get(patch.name, ())),
                                     *later_off.get(patch.name, ())),
                                    tuple(own_off.get(patch.name, ()))))
    return rows


def format_table(rows: list[PatchStatus], version: str) -> str:
    """A plain-text table for the terminal."""
    if not rows:
        return f"vllm {version}: the series is empty\n"
    header = ("patch", "kind", "applies", "upstream", "origin", "subject")
    body = [
        (r.name, r.kind, "yes" if r.applies else "NO", r.applied_upstream or "-", r.origin or "-", r.subject)
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in (header, *body)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *body):
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    for r in rows:
        lines.append(f"  {r.name}: {', '.join(r.files)}")
        if r.detail and not r.applies:
            lines.append(f"    {r.detail}")
        for note in r.notes:
            lines.append(f"    {note}")
        for note in r.later:
            lines.append(f"    later pin {note}")
    return "\n".join(lines) + "\n"
