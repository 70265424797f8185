"""The engine check's cases as data, read by the engine check and by what judges its records
(:mod:`overlay.maintain.engine_records`), neither importing the other: a case's fields as a record holds
them (:data:`CASE_FIELDS`, :func:`case_problem`), the conditions a case meets (:func:`holds`), and what the
engine check expects of one release's build, read from that release's own folder
(``patches/<release>/engine.toml``): which patches must act in which cases (``engine-check --coverage``),
and what a seed-bug variant shows there where it differs from the default expectation
(:data:`overlay.engine.variants.EXPECT`). Nothing here names a release: a release folder without the
file declares no acts and keeps the default expectations.

The file::

    [acts]  # patch -> the conditions a case must meet, all of them, for the patch to have to act in it
    "dcp-project-before-merge.patch" = ["dcp>1", "projection:on"]

    [[expect]]  # one job a variant must show on this build (several per variant allowed)
    variant = "stock"  # or a patch file name
    expect = "mismatch"  # "pass", "mismatch", "crash:<text>"
    symptom = "what the report said"
    case = "ref-dcp1-mtp-v1"  # or "" where no case can show it here

Conditions: ``dcp>1``, ``mtp``, ``piecewise-mtp`` (MTP in graphs under DCP with interleave > 1),
``v1-runner`` (the case runs Model Runner V1), ``projection:on`` / ``projection:off`` (the case asks the
projection through ``W_UV`` before the DCP merge on / off, however its build spells it; a case that leaves it to
the build asks neither), ``env:NAME=VALUE`` (any variable but the projection's, which no case sets). Standard
library only: the engine check reads it on the device machine.

A case here is either the engine check's ``Case`` or its record (the dict ``Case.to_dict`` writes, where a
field at its default is left out): :func:`holds` and :func:`declared_acts` read both, and a record written before
cases had ``projection`` (the projection as ``env`` ``VLLM_DCP_PROJECT_BEFORE_MERGE`` 1 / 0) as if it had it
(:func:`record_projection`).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay.build.pins import REPO_PATCHES, default_version
from overlay.errors import OverlayError
from overlay.jsonfile import kind_problem
from overlay.releases.derive import PROJECTION_ENV
from overlay.releases.projection import ProjectionError, value_of_env

TABLE = "engine.toml"
PATCHES = REPO_PATCHES
CONDITIONS = ("dcp>1", "mtp", "piecewise-mtp", "v1-runner", "projection:on", "projection:off")
PROJECTIONS = ("on", "off")  # what a case may ask of the projection ("" leaves it to the build)

Expectation = tuple[str, str, str | None]  # (expect, symptom, case)
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # a case that runs Model Runner V1 (where a release has both)

# each field of a case as JSON holds it (``Case.to_dict``): what a results file read back is held to
CASE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str, "role": str, "tp": int, "dcp": int, "backend": str, "eager": bool, "mtp": bool, "env": dict,
    "reverse": bool, "max_num_batched_tokens": int, "note": str, "compare_to": str, "interleave": int,
    "graphs": str, "prompt_lens": list, "q_replicate": bool, "resolves": dict, "release": str, "log_lines": list,
    "projection": str}


def case_problem(doc: dict[str, Any]) -> str | None:
    """What keeps ``doc`` (a case read back from a file) from being a case ``Case.to_dict`` writes:
    ``name`` missing, a field of the wrong type; None when it is one."""
    if not isinstance(doc.get("name"), str):
        return "name: a case needs a name (a string)"
    for key, kind in CASE_FIELDS.items():
        if key in doc and doc[key] is not None and (problem := kind_problem(doc[key], kind)):
            return f"{key}: {problem}"
    for key in ("prompt_lens", "log_lines"):
        kind = int if key == "prompt_lens" else str
        for i, item in enumerate(doc.get(key) or ()):
            if problem := kind_problem(item, kind):
                return f"{key}[{i}]: {problem}"
    try:
        record_projection(doc)
    except ProjectionError as exc:
        return str(exc)
    return None


def record_projection(doc: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """A case record's projection (``on``, ``off`` or ``""``: the build's own) and its ``env`` without the
    projection's variable: a record written before cases had ``projection`` carries it as ``env``
    ``VLLM_DCP_PROJECT_BEFORE_MERGE`` 1 / 0. :class:`ProjectionError` in one line naming the case for a value
    that is neither, or a record whose two say different things."""
    where = f"case {doc.get('name')!r}"
    env = dict(doc.get("env") or {})
    legacy = value_of_env(env.pop(PROJECTION_ENV, None), where)
    projection = doc.get("projection") or ""
    if projection not in ("", *PROJECTIONS):
        raise ProjectionError(f"{where}: projection {projection!r}: expected on, off or none (the build's own)")
    if legacy is not None and projection and legacy != projection:
        raise ProjectionError(f"{where}: projection {projection!r} but {PROJECTION_ENV}={doc['env'][PROJECTION_ENV]!r}")
    return projection or legacy or "", env


_DEFAULTS: dict[str, Any] = {"dcp": 1, "mtp": False, "eager": False, "interleave": 1}


def _field(case: Any, name: str) -> Any:
    """A case's field, from a ``Case`` or its record (where a field at its default is left out; an older
    record's projection read from its env, :func:`record_projection`)."""
    if isinstance(case, Mapping):
        if name in ("projection", "env"):
            projection, env = record_projection(case)
            return projection if name == "projection" else env
        value = case.get(name)
        return ({} if name == "env" else _DEFAULTS[name]) if value is None else value
    return getattr(case, name)


def piecewise_mtp(case: Any) -> bool:
    """MTP in graphs under DCP with interleave > 1: where flashmla-sparse-dcp-spec-cudagraphs reports
    single-token decodes (and spec decoding falls back to PIECEWISE); elsewhere it returns the release's
    own support."""
    return (_field(case, "dcp") > 1 and _field(case, "interleave") > 1 and bool(_field(case, "mtp"))
            and not _field(case, "eager"))


def v1_runner(case: Any) -> bool:
    """The case runs Model Runner V1 (:data:`V1_RUNNER_ENV`)."""
    key, value = next(iter(V1_RUNNER_ENV.items()))
    return _field(case, "env").get(key) == value


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
                                f"env:NAME=VALUE but {PROJECTION_ENV})")
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
    # the projection is no case's variable (each build spells it its own way): projection:on|off
    return condition.startswith("env:") and bool(sep) and bool(name) and name != PROJECTION_ENV


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


def holds(case: Any, conditions: tuple[str, ...]) -> bool:
    """Whether ``case`` (a ``Case`` or its record) meets every one of ``conditions``."""
    def one(condition: str) -> bool:
        if condition == "dcp>1":
            return _field(case, "dcp") > 1
        if condition == "mtp":
            return bool(_field(case, "mtp"))
        if condition == "piecewise-mtp":
            return piecewise_mtp(case)
        if condition == "v1-runner":
            return v1_runner(case)
        if condition.startswith("projection:"):
            return _field(case, "projection") == condition.removeprefix("projection:")
        name, _, value = condition.removeprefix("env:").partition("=")
        return _field(case, "env").get(name) == value

    return all(one(c) for c in conditions)


def declared_acts(case: Any, release: str | None, patches_root: Path = PATCHES) -> tuple[str, ...]:
    """The patches that must act in ``case`` (a ``Case`` or its record) on ``release``'s build (None: the
    default release's), by the ``[acts]`` of that release's own ``engine.toml``; none for a release without
    one. The names must be in the release's series (tests/engine/test_liveness_run.py; engine-check --coverage
    refuses one that is not)."""
    table = load(release or default_version(patches_root), patches_root)
    return tuple(name for name, conds in table.acts.items() if holds(case, conds))
