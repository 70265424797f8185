"""The liveness lines file: which lines of the patched tree each patch of a series added, for the engine check.

``engine-check --coverage`` counts, per case and patch, how many of the patch's added statements ran
(``engine.liveness_run``). Which lines a patch added comes from ``overlay.maintain.liveness.attribution``
(git blame of the series replayed onto the release's files), which needs git and the series: it is made
where they are and read where the engines run (the GPU device has neither). One JSON document::

    {"format": 1, "release": "0.28.0", "vllm": "0.28.0+ovl...", "series": ["a.patch", ...],
     "lines": {"a.patch": {"vllm/x.py": [12, 13, ...]}, ...}}

``vllm`` is the version of the wheel the series builds (``make build``): the check refuses a file made for
another build than the engines import, whose line numbers would count other statements.

- :func:`lines_doc` (CPU): the document for a release's series (``overlay liveness-lines``);
- :func:`staged_lines` (CPU): the file ``make device-stage`` puts beside the manifest, when the staged
  wheel is the series' own;
- :func:`load_lines` (anywhere): the document read back and checked against the build the engines
  import and the patches the cases declare.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from overlay import jsonfile
from overlay.engine.inputs import EngineCheckError
from overlay.errors import shown
from overlay.maintain.liveness import file_problem

if TYPE_CHECKING:
    from overlay.build.pipeline import SeriesWheel

FILE = "liveness.json"  # its name in the stage, beside manifest.json
ENV = "OVERLAY_LIVENESS"  # scripts/device-run.sh sets it to the unpacked file: engine-check's default --liveness
FORMAT = 1


@dataclass(frozen=True)
class Lines:
    """A liveness lines document, read back (:func:`load_lines`)."""

    path: Path
    release: str
    vllm: str
    series: tuple[str, ...]
    lines: dict[str, dict[str, list[int]]]


def lines_doc(target: SeriesWheel, *, cache: Path | None = None) -> dict[str, object]:
    """The lines document of a release's series, as the front door loaded it (its base tree extracted once
    into the cache, the series replayed with git)."""
    from overlay.maintain.liveness import attribution
    from overlay.maintain.trees import pinned_tree

    lines = attribution(pinned_tree(target.pin, cache=cache), target.series.patches)
    return {"format": FORMAT, "release": target.release, "vllm": target.version,
            "series": [p.name for p in target.series.patches], "lines": lines}


def dump(doc: dict[str, object]) -> bytes:
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def summary(doc: dict[str, object]) -> str:
    lines = doc["lines"]
    assert isinstance(lines, dict)
    count = sum(len(v) for files in lines.values() for v in files.values())
    files = len({f for files in lines.values() for f in files})
    return f"{FILE}: vllm {doc['vllm']}, {len(lines)} patch(es), {count} added line(s) in {files} file(s)"


def staged_lines(target: SeriesWheel, wheel: Path) -> dict[str, bytes]:
    """``{FILE: document}`` for ``make device-stage`` when ``wheel`` is the one the release's series builds;
    else nothing, said on stderr (the lines of another series would count other statements)."""
    if wheel.name != target.filename:
        print(f"[device-stage] {FILE} not staged: {wheel.name} is not the wheel of patches/{target.release}/series "
              f"({target.filename}); engine-check --coverage then needs --liveness FILE", file=sys.stderr, flush=True)
        return {}
    doc = lines_doc(target)
    print(f"[device-stage] {summary(doc)} (engine-check --coverage)", file=sys.stderr, flush=True)
    return {FILE: dump(doc)}


def load_lines(path: Path, installed: str, declared: Iterable[tuple[str, str]] = ()) -> Lines:
    """The document at ``path``, refused in one line when it is not one, when it was made for another build
    than ``installed`` (the vLLM version the engines import), or when a case of ``declared`` (case, patch)
    names a patch its series does not hold."""
    what = f"a liveness lines file of format {FORMAT} (overlay liveness-lines writes one)"
    source = f"--liveness {path}"
    doc = jsonfile.read(path, EngineCheckError, what, source=source)
    if doc.get("format") != FORMAT or not isinstance(doc.get("lines"), dict):
        raise EngineCheckError(f"{source}: not {what}")
    for key in ("vllm", "release"):
        jsonfile.get(doc, key, str, "", source, EngineCheckError)
    for i, name in enumerate(jsonfile.get(doc, "series", list, "", source, EngineCheckError, [])):
        jsonfile.need(name, str, f"series[{i}]", source, EngineCheckError)
    for patch, files in doc["lines"].items():
        for file, numbers in jsonfile.need(files, dict, f"lines.{patch}", source, EngineCheckError).items():
            where = f"lines.{patch}.{file}"
            if problem := file_problem(file):
                raise EngineCheckError(f"{source}: lines.{patch}: {shown(file)}: {problem}")
            for i, n in enumerate(jsonfile.need(numbers, list, where, source, EngineCheckError)):
                jsonfile.need(n, int, f"{where}[{i}]", source, EngineCheckError)
    if doc.get("vllm") != installed:
        raise EngineCheckError(f"--liveness {path}: made for vllm {doc.get('vllm')}, the engines import "
                               f"{installed or '(none)'}: its line numbers are another build's (make it for "
                               "this build: overlay liveness-lines, or make device-stage)")
    series = tuple(doc.get("series") or ())
    for case, patch in declared:
        if patch not in series:
            raise EngineCheckError(f"case {case} declares {patch}, which is not in the series of vllm "
                                   f"{doc['vllm']} ({path})")
    return Lines(path, str(doc.get("release", "")), str(doc["vllm"]), series,
                 {p: {f: list(v) for f, v in files.items()} for p, files in doc["lines"].items()})
