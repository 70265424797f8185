"""The upstream reports judged on GLM-5's path, per carried release: ``patches/<release>/upstream-reports.toml``.

Each entry is one upstream report (or a finding of our own) and our verdict on it for that release's build:
``shows`` (it happens on our path), ``cannot-happen`` (the release's code rules it out: the lines that do),
``fixed-by`` (a patch of the series fixes it) or ``pending`` (what will judge it). :func:`load` reads the file,
refusing a malformed entry in one line naming the file and the field; :func:`problems` holds the record to
what it points at (each evidence line still quoted at its place in the unpatched release tree, each test id's
file and function, each fix patch in the series, each engine case among the engine check's); ``make status``
prints :func:`format_reports`. The file's own header says what each field holds.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay import textfile
from overlay.errors import OverlayError

FILE = "upstream-reports.toml"
VERDICTS = ("shows", "cannot-happen", "fixed-by", "pending")
_TEXT_FIELDS = ("title", "summary", "carried_by", "unfixed", "awaits")
_LIST_FIELDS = ("tests", "engine_cases", "fix")
_FIELDS = {"report", "verdict", "evidence", *_TEXT_FIELDS, *_LIST_FIELDS}
_TEST_ID = re.compile(r"^(?P<file>tests/[\w/.-]+\.py)::(?P<func>\w+)(\[[^\]]+\])?$")


class ReportsError(OverlayError):
    """A malformed ``upstream-reports.toml``."""


@dataclass(frozen=True)
class Evidence:
    """A line of the unpatched release tree that the verdict rests on."""

    path: str  # relative to the tree: vllm/...
    line: int
    quote: str  # text that line holds

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "line": self.line, "quote": self.quote}


@dataclass(frozen=True)
class Report:
    """One upstream report and our verdict on it for one release."""

    report: str
    title: str
    verdict: str
    summary: str
    evidence: tuple[Evidence, ...] = ()
    tests: tuple[str, ...] = ()
    engine_cases: tuple[str, ...] = ()
    fix: tuple[str, ...] = ()
    carried_by: str = ""
    unfixed: str = ""
    awaits: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"report": self.report, "title": self.title, "verdict": self.verdict, "summary": self.summary,
                "evidence": [e.to_dict() for e in self.evidence], "tests": list(self.tests),
                "engine_cases": list(self.engine_cases), "fix": list(self.fix), "carried_by": self.carried_by,
                "unfixed": self.unfixed, "awaits": self.awaits}


def record_path(patches_root: Path, release: str) -> Path:
    return patches_root / release / FILE


def load(patches_root: Path, release: str) -> list[Report]:
    """The reports judged for ``release`` (none where its folder has no record)."""
    path = record_path(patches_root, release)
    if not path.is_file():
        return []
    shown = f"{release}/{FILE}"
    text = textfile.decode(path.read_bytes(), shown, ReportsError)
    textfile.refuse_crlf(text, shown, ReportsError)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ReportsError(f"{shown}: not TOML: {e}") from None
    extra = sorted(set(doc) - {"report"})
    if extra:
        raise ReportsError(f"{shown}: {extra[0]}: unknown table (only [[report]] entries)")
    entries = doc.get("report", [])
    if not isinstance(entries, list):
        raise ReportsError(f"{shown}: report: must be [[report]] entries")
    out = [_entry(entry, f"{shown}: report[{i}]") for i, entry in enumerate(entries)]
    seen: set[str] = set()
    for i, r in enumerate(out):
        if r.report in seen:
            raise ReportsError(f"{shown}: report[{i}].report: {r.report} is judged twice")
        seen.add(r.report)
    return out


def _entry(entry: Any, where: str) -> Report:
    if not isinstance(entry, dict):
        raise ReportsError(f"{where}: must be a table")
    name = entry.get("report")
    if not isinstance(name, str) or not name.strip():
        raise ReportsError(f"{where}.report: a non-empty string is needed (upstream's number, or a name)")
    report = name.strip()
    where = f"{where} ({report})"
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ReportsError(f"{where}.{unknown[0]}: unknown field (known: {', '.join(sorted(_FIELDS))})")

    def text(name: str, required: bool = False) -> str:
        value = entry.get(name, "")
        if not isinstance(value, str) or (required and not value.strip()):
            raise ReportsError(f"{where}.{name}: {'a non-empty ' if required else 'a '}string is needed")
        return value.strip()

    def strings(name: str) -> tuple[str, ...]:
        value = entry.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ReportsError(f"{where}.{name}: a list of non-empty strings is needed")
        return tuple(v.strip() for v in value)

    verdict = text("verdict", required=True)
    if verdict not in VERDICTS:
        raise ReportsError(f"{where}.verdict: {verdict!r} is none of {', '.join(VERDICTS)}")
    r = Report(report=report, title=text("title", required=True), verdict=verdict,
               summary=text("summary", required=True), evidence=_evidence(entry.get("evidence", []), where),
               tests=strings("tests"), engine_cases=strings("engine_cases"), fix=strings("fix"),
               carried_by=text("carried_by"), unfixed=text("unfixed"), awaits=text("awaits"))
    for test in r.tests:
        if not _TEST_ID.match(test):
            raise ReportsError(f"{where}.tests: {test!r} is not a test id (tests/<file>.py::<function>[<params>])")
    _verdict_needs(r, where)
    return r


def _evidence(value: Any, where: str) -> tuple[Evidence, ...]:
    if not isinstance(value, list):
        raise ReportsError(f"{where}.evidence: a list of {{ path, line, quote }} is needed")
    out = []
    for i, item in enumerate(value):
        at = f"{where}.evidence[{i}]"
        if not isinstance(item, dict) or set(item) != {"path", "line", "quote"}:
            raise ReportsError(f"{at}: needs exactly path, line and quote")
        path, line, quote = item["path"], item["line"], item["quote"]
        if not isinstance(path, str) or not path.startswith("vllm/") or ".." in Path(path).parts:
            raise ReportsError(f"{at}.path: a path inside the release tree (vllm/...) is needed")
        if not isinstance(line, int) or isinstance(line, bool) or line < 1:
            raise ReportsError(f"{at}.line: a line number (1 or more) is needed")
        if not isinstance(quote, str) or not quote.strip():
            raise ReportsError(f"{at}.quote: the text of that line is needed")
        out.append(Evidence(path, line, quote.strip()))
    return tuple(out)


def _verdict_needs(r: Report, where: str) -> None:
    """What each verdict must carry to be evidence rather than an opinion."""
    if r.verdict == "cannot-happen" and not r.evidence:
        raise ReportsError(f"{where}.evidence: cannot-happen needs the release's lines that rule it out")
    if r.verdict == "fixed-by" and not (r.fix and r.tests):
        raise ReportsError(f"{where}.fix: fixed-by needs the fix patch and the tests that fail without it")
    if r.verdict == "shows":
        if not (r.tests or r.evidence or r.carried_by):
            raise ReportsError(f"{where}.tests: shows needs the tests or the release's lines that show it")
        if not (r.fix or r.carried_by or r.unfixed):
            raise ReportsError(f"{where}.fix: shows needs a fix patch, carried_by, or unfixed (why none)")
    if r.verdict == "pending" and not r.awaits:
        raise ReportsError(f"{where}.awaits: pending needs what will judge it")


def problems(reports: list[Report], *, tree: Path, repo: Path, series: set[str], cases: set[str]) -> list[str]:
    """Where ``reports`` no longer point at something real: an evidence line not quoted at its place in
    ``tree`` (the unpatched release tree, holding ``vllm/``), a test id whose file or function ``repo`` lacks,
    a fix patch not in ``series``, an engine case not among ``cases``. One line each."""
    out = []
    for r in reports:
        for e in r.evidence:
            lines = _lines(tree / e.path)
            if lines is None:
                out.append(f"{r.report}: {e.path}: not in the release tree")
            elif e.line > len(lines) or e.quote not in lines[e.line - 1]:
                found = [i + 1 for i, text in enumerate(lines) if e.quote in text]
                moved = f" (now at line {', '.join(map(str, found[:3]))})" if found else " (not in the file)"
                out.append(f"{r.report}: {e.path}:{e.line} no longer reads {e.quote!r}{moved}")
        for test in r.tests:
            m = _TEST_ID.match(test)
            assert m is not None  # load() refused it otherwise
            source = _lines(repo / m["file"])
            if source is None:
                out.append(f"{r.report}: {test}: no file {m['file']}")
            elif not any(re.match(rf"\s*def {m['func']}\(", text) for text in source):
                out.append(f"{r.report}: {test}: {m['file']} defines no {m['func']}")
        out += [f"{r.report}: fix {name}: not in the series" for name in r.fix if name not in series]
        out += [f"{r.report}: engine case {name}: not a case of the engine check"
                for name in r.engine_cases if name not in cases]
    return out


def _lines(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def format_reports(release: str, reports: list[Report]) -> list[str]:
    """``make status``'s lines for one release's judged reports (none where it has no record)."""
    if not reports:
        return []
    counts = {v: sum(r.verdict == v for r in reports) for v in VERDICTS}
    said = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    lines = [f"Upstream reports judged on {release}'s GLM-5 path ({release}/{FILE}: {said}):"]
    for r in reports:
        lines.append(f"  {r.report}: {r.verdict}: {r.title}")
        lines += [f"    evidence: {e.path}:{e.line}" for e in r.evidence]
        lines += [f"    test: {t}" for t in r.tests]
        if r.fix:
            lines.append(f"    fix: {', '.join(r.fix)}")
        for label, value in (("carried by", r.carried_by), ("unfixed", r.unfixed), ("awaits", r.awaits)):
            if value:
                lines.append(f"    {label}: {' '.join(value.split())}")
        if r.engine_cases:
            lines.append(f"    engine cases (DCP 2): {', '.join(r.engine_cases)}")
    return lines
