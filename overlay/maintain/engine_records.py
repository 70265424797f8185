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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

RECORDS = Path("docs") / "records" / "engine"  # below the repository
RAN = ("pass", "reference", "spread")  # the verdicts of a case that ran and agreed (or is the yardstick)


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


def _case(raw: dict[str, Any]) -> CaseRun:
    case = raw.get("case") if isinstance(raw.get("case"), dict) else {}
    live = (raw.get("liveness") or {}).get("patches") if isinstance(raw.get("liveness"), dict) else None
    return CaseRun(str(raw.get("name") or case.get("name")), str(raw.get("verdict") or raw.get("status")),
                   int(case.get("dcp") or 1), case, str(raw.get("variant") or ""),
                   tuple((str(p["patch"]), int(p["ran"]), int(p["added"])) for p in live or []
                         if isinstance(p, dict) and {"patch", "ran", "added"} <= set(p)))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and isinstance(doc.get("cases"), list)
    return doc if ok else None


def _where(root: Path, path: Path) -> str:
    rel = path.relative_to(root)
    return (rel.parent if rel.name == "results.json" else rel).as_posix()


def engine_runs(root: Path, release: str | None = None) -> list[EngineRun]:
    """The runs recorded under ``root`` (of ``release``'s build only, when given), oldest first."""
    runs = []
    for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
        doc = _read(path)
        build = str(doc["meta"].get("vllm") or "").split("+")[0].split(" ")[0] if doc else ""
        if not doc or not build or (release is not None and build != release):
            continue
        series = {str(p.get("name")): str(p.get("sha256")) for p in doc["meta"].get("series") or []
                  if isinstance(p, dict)}
        runs.append(EngineRun(_where(root, path), build, str(doc["meta"].get("started", "?")),
                              str(doc["meta"].get("gpus", "")), str((doc.get("summary") or {}).get("verdict", "?")),
                              tuple(_case(c) for c in doc["cases"] if isinstance(c, dict)), series))
    return sorted(runs, key=lambda r: r.when)


def unattributed(root: Path) -> list[str]:
    """The records under ``root`` that name no build (``meta.vllm``): counted for no release."""
    return [_where(root, p) for p in sorted(root.rglob("*.json")) if root.is_dir()
            if (doc := _read(p)) is not None and not doc["meta"].get("vllm")]


def _acts(case: CaseRun, release: str) -> tuple[str, ...]:
    """The patches the case declares must act on ``release``'s build (its ``engine.toml`` ``[acts]``, as the
    engine check reads them)."""
    from overlay.engine.workload import Case, declared_acts

    names = {f.name for f in fields(Case)}
    try:
        built = Case(**{k: tuple(v) if k == "prompt_lens" else v for k, v in case.case.items() if k in names})
    except TypeError:
        return ()
    return declared_acts(built, release)


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
