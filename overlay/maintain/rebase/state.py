"""A rebase's state and results: the scratch repository's state file, each patch's result, the
outcome of a run, and ``RebaseError``."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from overlay.build.pins import Pin, load_pin, pin_dir
from overlay.errors import OverlayError, shown
from overlay.maintain.replay import ConflictHunk

STATE = "overlay-rebase.json"  # inside the scratch repository's .git: survives git commands

OUTCOMES: dict[str, str] = {
    "upstream": "upstream has the same change; dropped",
    "upstream-by-behaviour": "upstream fixed it its own way (its tests pass without it); dropped",
    "applied": "applies exactly; carried verbatim",
    "refreshed": "applies after a 3-way merge; carried as the refreshed patch",
    "partly-upstream": "part of it is upstream; the rest is carried",
    "auto-resolved": ("conflicted; a mechanical candidate was accepted because the patch's own tests pass on "
                      "the target with it and the later patches still merge"),
    "conflict": "set aside: needs a person",
    "conflict-resolved": "conflicted; resolved by a person",
    "left-out": ("set aside, then left out of the series by a person for the reason given "
                 "(`make rebase-continue LEFT_OUT=1 WHY=...`): neither carried nor judged upstream"),
    "off-model-path": ("carried, but off the model's path: with it, its tests find it in the tree but not on the "
                       "path GLM-5 runs in this release (it changes nothing GLM-5 runs); needs a person to carry "
                       "it onto that path"),
    "contradicted": ("set aside: needs a person; its tests contradict the target's own behaviour, so they "
                     "cannot vouch for carrying it"),
}
"""Every outcome a patch's classification can have, and what it means (``REBASE.md``'s words).

The one list: ``docs/rebase/README.md``'s table says when each is given, in this order, and
``tests/test_one_source.py`` holds it and what ``classify`` gives to this. When a patch's tests
make it "upstream-by-behaviour" (or "contradicted") is the rule of
:func:`overlay.maintain.rebase.verdict.behaviour_verdict`, stated there only.
"""
UPSTREAM: tuple[str, ...] = ("upstream", "upstream-by-behaviour")  # dropped because upstream has it


class RebaseError(OverlayError):
    """A rebase cannot start or continue (state missing, unresolved paths, target exists)."""


@dataclass
class Result:
    """The classification of one patch."""

    name: str
    outcome: str
    evidence: str
    still_needed: list[str] = field(default_factory=list)
    absorbed: list[str] = field(default_factory=list)
    behaviour: dict[str, dict] = field(default_factory=dict)  # "old-base" / "target" / "target-with-it" -> TestRun
    conflicts: list[dict] = field(default_factory=list)
    carried: bool = False  # the patch is in the new series
    candidates: list[dict] = field(default_factory=list)  # resolution attempts (rebase_resolve.Attempt)
    source_sha256: str = ""  # the source patch file this result was classified from
    changes: list[str] = field(default_factory=list)  # carried: "path: Class.method, ..." its lines are in
    reason: str = ""  # left-out: the person's reason (WHY=)
    on_model_path: str = ""  # carried: its GLM-5 path tests pass with it and fail without it (model_path.on_path)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"{self.name}: {self.outcome!r} is not an outcome (OUTCOMES: {', '.join(OUTCOMES)})")


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
    facts: dict = field(default_factory=dict)  # {"from": ..., "to": ...}: each release's ReleaseFacts.to_dict()

    def save(self, work: Path) -> None:
        path = work / ".git" / STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, work: Path) -> State:
        path = work / ".git" / STATE
        if not path.is_file():
            half = (" (a rebase that stopped before it began: remove it and run make rebase again)"
                    if work.exists() else "")
            raise RebaseError(f"{work}: no rebase in progress there (no .git/{STATE}){half}")
        from overlay import jsonfile

        doc = jsonfile.read(path, RebaseError, "a rebase's state")
        names = {f.name for f in fields(cls)}
        for key, kind in (("from_version", str), ("to_version", str), ("pin", dict), ("patches_root", str),
                          ("tests_dir", str), ("names", list), ("old_commits", list), ("index", int),
                          ("results", list), ("exported", dict), ("pending", dict), ("facts", dict)):
            jsonfile.get(doc, key, kind, "", str(path), RebaseError)
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        odd = sorted(set(doc) - names) + [f"{k} missing" for k in sorted(required - set(doc))]
        if odd:
            raise RebaseError(f"{path}: not a rebase's state this tool wrote ({', '.join(map(shown, odd))})")
        return cls(**doc)


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


def work_lock(work: Path) -> Path:
    """The lock a rebase holds on its worktree while it runs (``.work/.rebase-<to>.lock``, :mod:`overlay.lock`)."""
    return work.with_name(f".{work.name}.lock")




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
