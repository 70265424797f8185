"""What the engine check expects of one release's build, read from that release's own folder
(``patches/<release>/engine.toml``): which patches must act in which cases (``engine-check --coverage``),
and what a seed-bug variant shows there where it differs from the default expectation
(:data:`overlay.engine.variants.EXPECT`). Nothing here names a release: a release folder without the
file declares no acts and keeps the default expectations.

The file::

    [acts]  # patch -> the conditions a case must meet, all of them, for the patch to have to act in it
    "dcp-project-before-merge.patch" = ["dcp>1", "env:VLLM_DCP_PROJECT_BEFORE_MERGE=1"]

    [[expect]]  # one job a variant must show on this build (several per variant allowed)
    variant = "stock"  # or a patch file name
    expect = "mismatch"  # "pass", "mismatch", "crash:<text>"
    symptom = "what the report said"
    case = "ref-dcp1-mtp-v1"  # or "" where no case can show it here

Conditions: ``dcp>1``, ``mtp``, ``piecewise-mtp`` (MTP in graphs under DCP with interleave > 1),
``v1-runner`` (the case runs Model Runner V1), ``env:NAME=VALUE``. Standard library only: the engine
check reads it on the device machine.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay.errors import OverlayError

TABLE = "engine.toml"
PATCHES = Path(__file__).resolve().parents[2] / "patches"
CONDITIONS = ("dcp>1", "mtp", "piecewise-mtp", "v1-runner")

Expectation = tuple[str, str, str | None]  # (expect, symptom, case)


class ReleaseTableError(OverlayError):
    """A release's ``engine.toml`` is unreadable or names something the check does not know."""


@dataclass(frozen=True)
class ReleaseTable:
    """One release's engine expectations: ``acts`` (patch -> conditions) and ``expect`` (variant -> jobs)."""

    acts: dict[str, tuple[str, ...]]
    expect: dict[str, tuple[Expectation, ...]]

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> ReleaseTable:
        """Validate ``data``; every problem is collected before raising."""
        problems: list[str] = []
        unknown = sorted(set(data) - {"acts", "expect"})
        if unknown:
            problems.append(f"unknown table(s) {', '.join(map(repr, unknown))}")
        acts: dict[str, tuple[str, ...]] = {}
        raw_acts = data.get("acts", {})
        if not isinstance(raw_acts, dict):
            problems.append("[acts] must be a table of patch = [conditions]")
            raw_acts = {}
        for patch, conds in raw_acts.items():
            if not patch.endswith(".patch") or not isinstance(conds, list) or not conds:
                problems.append(f"acts {patch!r}: a patch file name and a non-empty list of conditions")
                continue
            bad = [c for c in conds if not isinstance(c, str) or not _known(c)]
            if bad:
                problems.append(f"acts {patch!r}: unknown condition(s) {bad!r} (known: {', '.join(CONDITIONS)}, "
                                "env:NAME=VALUE)")
                continue
            acts[patch] = tuple(conds)
        expect: dict[str, tuple[Expectation, ...]] = {}
        raw_expect = data.get("expect", [])
        if not isinstance(raw_expect, list):
            problems.append("expect must be an array of tables ([[expect]])")
            raw_expect = []
        for i, job in enumerate(raw_expect):
            keys = {"variant", "expect", "symptom", "case"}
            if not isinstance(job, dict) or set(job) != keys or not all(isinstance(job[k], str) for k in keys):
                problems.append(f"expect[{i}]: needs exactly the strings {', '.join(sorted(keys))}")
                continue
            if not job["variant"] or not job["symptom"] or job["expect"].split(":", 1)[0] not in (
                    "pass", "mismatch", "crash"):
                problems.append(f"expect[{i}]: variant and symptom must be given, expect one of pass, mismatch, "
                                "crash:<text>")
                continue
            expect[job["variant"]] = (*expect.get(job["variant"], ()),
                                      (job["expect"], job["symptom"], job["case"] or None))
        if problems:
            raise ReleaseTableError(f"{source}: " + "; ".join(problems))
        return cls(acts, expect)


def _known(condition: str) -> bool:
    if condition in CONDITIONS:
        return True
    name, sep, _ = condition.removeprefix("env:").partition("=")
    return condition.startswith("env:") and bool(sep) and bool(name)


def load(release: str, patches_root: Path = PATCHES) -> ReleaseTable:
    """``patches/<release>/engine.toml`` (an empty table when the release folder has none)."""
    path = patches_root / release / TABLE
    if not path.is_file():
        return ReleaseTable({}, {})
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ReleaseTableError(f"{path}: cannot read the release's engine table: {exc}") from None
    return ReleaseTable.from_dict(data, str(path))


def predicate(conditions: tuple[str, ...], piecewise_mtp: Callable[[Any], bool],
              v1_runner: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A case predicate that holds when every condition does."""
    def holds(case: Any, condition: str) -> bool:
        if condition == "dcp>1":
            return case.dcp > 1
        if condition == "mtp":
            return bool(case.mtp)
        if condition == "piecewise-mtp":
            return piecewise_mtp(case)
        if condition == "v1-runner":
            return v1_runner(case)
        name, _, value = condition.removeprefix("env:").partition("=")
        return case.env.get(name) == value

    return lambda case: all(holds(case, c) for c in conditions)
