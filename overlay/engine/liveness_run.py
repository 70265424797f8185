"""Patch liveness in the engine check (``engine-check --coverage``): which added statements of each patch ran.

A case that passes says nothing of a patch whose lines never ran in it. With ``--coverage`` every engine
process of a job runs under coverage.py, measuring the ``vllm`` package only, and after the job its data
files are combined and held against the liveness lines file (``engine.liveness_lines``): per patch, its
added statements inside function bodies (``liveness.body_statements``: a ``def``, an import or a class
attribute runs at import, in every case, and would make every patch look live) and how many of them ran
(``overlay.maintain.liveness.liveness``), in the job's record (``liveness``) and in REPORT.md as a table
case x patch, ``ran/added``. A case declares the patches that must act in it (``workload.Case.acts``); a
declared patch that ran none of its added statements fails the case, in one line naming the patch, the
case and its count. An undeclared one is only reported.

How every process of an engine is measured (coverage.py 7.16, ``[run]`` of the job's rc file):

- a new interpreter (``run_case`` itself, vLLM's spawned engine core and workers, any subprocess) runs
  ``coverage_site/sitecustomize.py``, first on the job's ``PYTHONPATH``, which calls
  ``coverage.process_startup()`` (coverage's own ``a1_coverage.pth``, where pip installed it, does the
  same; a second call does nothing); it reads ``COVERAGE_PROCESS_START``, the job's rc file;
- a forked one (vLLM's default ``VLLM_WORKER_MULTIPROC_METHOD=fork`` while CUDA is not initialized):
  ``patch = fork`` restarts measurement in the child with its own data file, and ``patch = _exit`` saves
  it when multiprocessing ends the child with ``os._exit`` (no ``atexit`` there);
- one stopped with SIGTERM (vLLM's shutdown, the check's kill of a job's group): vLLM's own handlers
  raise ``SystemExit`` (``atexit`` saves), and ``sigterm = true`` saves in a process without one. The
  check sends SIGTERM to a job's group and waits ``KILL_GRACE_S`` before its SIGKILL.

``parallel = true`` gives each process its own data file in ``<out>/<job>/coverage/``. What it cannot see:
code that torch.compile traced into a graph (Dynamo interprets its bytecode, the graph replays it) and
work replayed from CUDA graphs; attention backends, the DCP combine, metadata builders and the model
runner run as Python (custom ops, host code). ``COVERAGE_CORE=sysmon`` (Python >= 3.12) measures with
less overhead than the default C tracer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay.engine.inputs import EngineCheckError
from overlay.engine.liveness_lines import ENV, Lines, load_lines

SITE = Path(__file__).resolve().with_name("coverage_site")  # its sitecustomize.py starts coverage.py
KILL_GRACE_S = 10.0  # SIGTERM, then this long for a job's processes to save their data, then SIGKILL


def rc_text(data_file: Path) -> str:
    """The coverage.py configuration of one job: every process its own data file under ``data_file``'s folder."""
    return (f"# engine-check --coverage: one job's processes (overlay/engine/liveness_run.py)\n"
            f"[run]\nparallel = true\ndata_file = {data_file}\nsigterm = true\ninclude = */vllm/*\n"
            "patch =\n    fork\n    _exit\n")


def job_env(folder: Path) -> dict[str, str]:
    """Write ``folder/coverage.rc`` (data into ``folder/coverage/``, emptied: a job run again starts anew) and
    return what the job's environment adds: ``COVERAGE_PROCESS_START``."""
    data = folder / "coverage"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    rc = folder / "coverage.rc"
    rc.write_text(rc_text(data / ".coverage"))
    return {"COVERAGE_PROCESS_START": str(rc)}


def combine(folder: Path) -> Path:
    """Combine the data files of ``folder`` (one per process) into ``folder/.coverage``; return that file."""
    from coverage import Coverage

    data_file = folder / ".coverage"
    cov = Coverage(data_file=str(data_file), config_file=False, messages=False)
    cov.combine([str(folder)], keep=False)
    cov.save()
    return data_file


def in_series_order(lines: Lines) -> dict[str, dict[str, list[int]]]:
    """``lines.lines`` with the series' patches first, in series order (the file's keys are sorted)."""
    return {p: lines.lines.get(p, {}) for p in (*lines.series, *(p for p in lines.lines if p not in lines.series))}


def job_liveness(lines: Lines, data_file: Path, tree: Path) -> dict[str, Any]:
    """Each patch's added statements in function bodies of ``tree`` (holding the ``vllm/`` that ran) and
    how many of them ``data_file`` saw run; with how many files of the package were measured at all."""
    from overlay.build.fetch import recorded_path
    from overlay.maintain.liveness import body_statements, executed, liveness

    ran = executed(data_file) if data_file.is_file() else {}
    live = liveness(in_series_order(lines), tree, ran, counted=body_statements)
    return {"measured_files": len(ran), "tree": recorded_path(tree), "patches": [p.to_dict() for p in live]}


@dataclass
class Measure:
    """``--coverage`` for one check: the lines file, where jobs write their data, the tree the engines import."""

    lines: Lines
    out: Path
    tree: Path

    def env(self, job: str) -> dict[str, str]:
        return job_env(self.out / job)

    def finish(self, job: str, acts: Iterable[str], own_tree: bool, record: dict[str, Any]) -> None:
        """Combine job ``job``'s data and put its liveness in ``record`` (a job on a variant's own tree:
        not counted, the lines file is the series')."""
        from coverage.exceptions import CoverageException

        doc: dict[str, Any] = {"acts": list(acts)}
        if own_tree:
            doc["skipped"] = "on a variant's tree: the lines are the series'"
        else:
            try:
                doc |= job_liveness(self.lines, combine(self.out / job / "coverage"), self.tree)
            except (CoverageException, sqlite3.Error, OSError) as exc:  # a file a killed process left half-written
                doc["skipped"] = f"its coverage data could not be read: {exc}"
        record["liveness"] = doc


def installed_vllm() -> tuple[str, Path | None]:
    """The full version of the vLLM the engines import (``0.28.0+ovl...``) and the folder holding its
    ``vllm/`` package, found without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("vllm")
    except PackageNotFoundError:
        found = ""
    spec = importlib.util.find_spec("vllm")
    where = list(spec.submodule_search_locations or []) if spec else []
    return found, Path(where[0]).parent if where else None


def start(liveness: Path | None, out: Path, declared: Iterable[tuple[str, str]]) -> Measure:
    """``--coverage``'s checks before anything runs, each one line: coverage.py importable, the lines file
    (``--liveness``, else ``$OVERLAY_LIVENESS``) made for the installed build, every declared patch in it."""
    if importlib.util.find_spec("coverage") is None:
        raise EngineCheckError("engine-check --coverage: coverage.py is not importable here (pyproject's test "
                               "extra pins coverage==7.16.2; the device has it)")
    path = liveness or (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
    if path is None:
        raise EngineCheckError(f"engine-check --coverage needs --liveness FILE (overlay liveness-lines writes it; "
                               f"on the device scripts/device-run.sh sets {ENV} to the staged one)")
    version, tree = installed_vllm()
    lines = load_lines(path, version, declared)
    if tree is None:
        raise EngineCheckError("engine-check --coverage: no vllm package to import here")
    return Measure(lines, out, tree)


def problems(record: Mapping[str, Any]) -> list[str]:
    """One line per declared patch of ``record`` that ran none of its added statements (none without
    ``--coverage``, for a job it did not count, or for one that did not run to its end)."""
    doc = record.get("liveness") or {}
    if "patches" not in doc or record.get("status") != "ok":
        return []
    by_name = {p["patch"]: p for p in doc["patches"]}
    name = record.get("name") or record["case"]["name"]
    found = []
    for patch in doc.get("acts", []):
        p = by_name.get(patch, {"added": 0, "ran": 0})
        if p["ran"] == 0:
            found.append(f"liveness: {patch} ran none of its {p['added']} added statements in {name} "
                         f"(the case declares it must act)")
    return found


def table(records: list[dict[str, Any]]) -> list[str]:
    """REPORT.md's liveness section: one row per job, one column per patch (series order), ``ran/added``;
    none when no record was measured."""
    measured = [r for r in records if "patches" in (r.get("liveness") or {})]
    if not measured:
        return []
    patches = [p["patch"] for p in measured[0]["liveness"]["patches"]]
    head = "| case | files measured | " + " | ".join(p.removesuffix(".patch") for p in patches) + " |"
    lines = ["", "## Patch liveness (`--coverage`)", "",
             "The statements each patch added inside function bodies that ran in the case's processes, "
             "`ran/added` (definitions, imports and class attributes run at import: not counted). **Bold**: the "
             "case declares the patch must act (`Case.acts`); it fails when none ran. Code torch.compile traced "
             "into a graph is not seen (`overlay/engine/liveness_run.py`).", "",
             head, "|" + " --- |" * (len(patches) + 2)]
    for r in records:
        doc = r.get("liveness") or {}
        name = r.get("name") or r["case"]["name"]
        if "patches" not in doc:
            why = doc.get("skipped") or ("reused" if r.get("reused") else r.get("status", ""))
            lines.append(f"| {name} | not measured: {why} |" + " |" * len(patches))
            continue
        by_name = {p["patch"]: p for p in doc["patches"]}
        cells = []
        for patch in patches:
            p = by_name.get(patch)
            cell = f"{p['ran']}/{p['added']}" if p else ""
            cells.append(f"**{cell}**" if patch in doc.get("acts", []) else cell)
        lines.append(f"| {name} | {doc['measured_files']} | " + " | ".join(cells) + " |")
    return lines
