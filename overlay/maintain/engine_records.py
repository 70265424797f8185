"""The engine-check runs kept as records, where the guides put them (``docs/records/engine/``): which
build each ran (``meta.vllm``), where, when, on which GPUs, and per case its DCP size, verdict, seed-bug
variant and patch liveness; and what a run proves of each patch of its build.

A record is any ``*.json`` under the folder that reads as an engine check's ``results.json`` (``meta`` and
``cases``). One that names no build (``meta.vllm``, written since 2026-12-02) is listed apart, never
counted for a release; ``meta.series`` (each patch's name and sha256, written since 2026-12-05) says which
version of each patch the build carried. What a run proves of a patch, strongest first (:func:`proofs`):
its seed-bug variant (the build without it) failed a case as expected; its added statements ran in a case
that passed (``engine-check --coverage``); a case that declares it acts (the release's ``engine.toml`` ``[acts]``)
passed.

Every record is read through :mod:`overlay.jsonfile` and held to the shape the code below relies on; one
that is not (not JSON, nested too deep, a link to ``/dev/zero``, a field of the wrong type) is left out of
every count and named by :func:`unreadable` (``make status`` prints it in one line and the rest as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay import jsonfile
from overlay.errors import OverlayError
from overlay.releases.engine_cases import case_problem, declared_acts

RECORDS = Path("docs") / "records" / "engine"  # below the repository
RAN = ("pass", "reference", "spread")  # the verdicts of a case that ran and agreed (or is the yardstick)
WHAT = "an engine-check record"


class RecordError(OverlayError):
    """A record under ``docs/records/engine/`` that cannot be read as one (named, never counted)."""


def records_root(patches_root: Path) -> Path:
    """``docs/records/engine/`` of the repository whose ``patches/`` is ``patches_root``."""
    return patches_root.resolve().parent / RECORDS


@dataclass(frozen=True)
class CaseRun:
    """One case (or seed-bug variant job) of a run."""

    name: str
    verdict: str
    dcp: int
    case: dict[str, Any]  # the case as run (``Case.to_dict()``)
    variant: str = ""  # "minus-<patch stem>" / "stock": the seed-bug variant the job ran
    liveness: tuple[tuple[str, int, int], ...] = ()  # (patch, ran, added) under --coverage


@dataclass(frozen=True)
class EngineRun:
    """One engine-check run of one build."""

    where: str  # the record, relative to the records folder (the file too unless it is results.json)
    release: str  # x.y.z of meta.vllm
    when: str
    gpus: str
    verdict: str
    cases: tuple[CaseRun, ...]
    series: dict[str, str]  # patch name -> sha256 of the build's series (meta.series); {} where not recorded

    @property
    def day(self) -> str:
        return self.when[:10]


@dataclass(frozen=True)
class Proof:
    """What one run shows of one patch."""

    run: EngineRun
    kind: str  # "variant" | "ran" | "acts" (strongest first)
    dcp: int
    case: str
    detail: str
    weight: int = 0  # among proofs of one kind and DCP size, the larger shows more (statements ran)


def _case(raw: dict[str, Any], where: str, source: str) -> CaseRun:
    """One case of a record, its fields checked (``where``: its place in the record, ``cases[3]``)."""
    def get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], at: str = where) -> Any:
        return jsonfile.get(doc, key, kind, at, source, RecordError)

    case = get(raw, "case", dict, where) or {}
    if case and (problem := case_problem({"name": raw.get("name"), **case})):
        raise RecordError(f"{source}: {where}.case.{problem}")
    for key in ("name", "verdict", "status", "variant"):
        get(raw, key, str)
    live = get(get(raw, "liveness", dict) or {}, "patches", list, f"{where}.liveness") or []
    counted = []
    for i, p in enumerate(live):
        at = f"{where}.liveness.patches[{i}]"
        if isinstance(p, dict) and {"patch", "ran", "added"} <= set(p):
            counted.append((get(p, "patch", str, at), get(p, "ran", int, at), get(p, "added", int, at)))
    return CaseRun(str(raw.get("name") or case.get("name")), str(raw.get("verdict") or raw.get("status")),
                   int(case.get("dcp") or 1), case, str(raw.get("variant") or ""), tuple(counted))


def _read(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None for other JSON beside the records (a case's output: no ``meta`` and
    ``cases``); :class:`RecordError` naming the file and the field for one that cannot be read as either."""
    doc = jsonfile.read(path, RecordError, WHAT, nonfinite=True)  # a case's output may hold a -inf logprob
    if not (isinstance(doc.get("meta"), dict) and isinstance(doc.get("cases"), list)):
        return None
    source, meta = str(path), doc["meta"]
    for key in ("vllm", "started", "gpus"):
        jsonfile.get(meta, key, str, "meta", source, RecordError)
    for i, p in enumerate(jsonfile.get(meta, "series", list, "meta", source, RecordError) or []):
        for key in ("name", "sha256"):
            jsonfile.get(jsonfile.need(p, dict, f"meta.series[{i}]", source, RecordError), key, str,
                         f"meta.series[{i}]", source, RecordError)
    jsonfile.get(jsonfile.get(doc, "summary", dict, "", source, RecordError) or {}, "verdict", str, "summary",
                 source, RecordError)
    return doc


def _where(root: Path, path: Path) -> str:
    rel = path.relative_to(root)
    return (rel.parent if rel.name == "results.json" else rel).as_posix()


def _run(root: Path, path: Path) -> EngineRun | None:
    """The run recorded at ``path`` (None: not a record, or one that names no build); :class:`RecordError`."""
    doc = _read(path)
    build = str(doc["meta"].get("vllm") or "").split("+")[0].split(" ")[0] if doc else ""
    if not doc or not build:
        return None
    series = {str(p.get("name")): str(p.get("sha256")) for p in doc["meta"].get("series") or []}
    cases = tuple(_case(c, f"cases[{i}]", str(path)) for i, c in enumerate(doc["cases"]) if isinstance(c, dict))
    return EngineRun(_where(root, path), build, str(doc["meta"].get("started", "?")),
                     str(doc["meta"].get("gpus", "")), str((doc.get("summary") or {}).get("verdict", "?")),
                     cases, series)


def _records(root: Path) -> list[Path]:
    return sorted(root.rglob("*.json")) if root.is_dir() else []


def engine_runs(root: Path, release: str | None = None) -> list[EngineRun]:
    """The runs recorded under ``root`` (of ``release``'s build only, when given), oldest first; a record
    that cannot be read is left out (:func:`unreadable` names it)."""
    runs = []
    for path in _records(root):
        try:
            run = _run(root, path)
        except RecordError:
            continue
        if run is not None and (release is None or run.release == release):
            runs.append(run)
    return sorted(runs, key=lambda r: r.when)


def unreadable(root: Path) -> list[str]:
    """One line per file under ``root`` that cannot be read as a record, naming it and what is wrong."""
    lines = []
    for path in _records(root):
        try:
            _run(root, path)
        except RecordError as exc:
            lines.append(str(exc))
    return lines


def unattributed(root: Path) -> list[str]:
    """The records under ``root`` that name no build (``meta.vllm``): counted for no release."""
    out = []
    for path in _records(root):
        try:
            doc = _read(path)
        except RecordError:
            continue
        if doc is not None and not doc["meta"].get("vllm"):
            out.append(_where(root, path))
    return out


def _acts(case: CaseRun, release: str) -> tuple[str, ...]:
    """The patches the case declares must act on ``release``'s build (its ``engine.toml`` ``[acts]``, read the
    one way the engine check reads them: :func:`overlay.releases.engine_cases.declared_acts`)."""
    return declared_acts(case.case, release)


def proofs(run: EngineRun) -> dict[str, Proof]:
    """Patch file name -> the strongest thing ``run`` shows of it (see the module's docstring); a declared
    act counts only for a patch of the run's series where the record names it."""
    out: dict[str, Proof] = {}

    def offer(patch: str, proof: Proof) -> None:
        rank = ("variant", "ran", "acts")
        have = out.get(patch)
        key = (rank.index(proof.kind), -proof.dcp, -proof.weight)
        if have is None or key < (rank.index(have.kind), -have.dcp, -have.weight):
            out[patch] = proof

    for c in run.cases:
        base = str(c.case.get("name") or c.name)
        if c.variant.startswith("minus-") and c.verdict == "expected-fail":
            offer(f"{c.variant.removeprefix('minus-')}.patch",
                  Proof(run, "variant", c.dcp, base, f"the build without it failed `{base}` as its seed bug does"))
        if c.variant or c.verdict not in RAN:
            continue
        for patch, n, added in c.liveness:
            if n:
                offer(patch, Proof(run, "ran", c.dcp, c.name,
                                   f"{n} of its {added} added statements ran in `{c.name}`, which passed", n))
        for patch in _acts(c, run.release):
            if not run.series or patch in run.series:
                offer(patch, Proof(run, "acts", c.dcp, c.name, f"`{c.name}`, where it acts, passed"))
    return out
