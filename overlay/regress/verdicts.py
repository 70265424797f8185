"""Expected verdicts of several regression runs: did each run reach the verdict it should?

The proof that ``make regress`` catches what broke our users is a set of runs whose outcome is
known in advance: the whole series must pass, and a tree without one fix must be a regression
for the right reason. Each expectation is ``NAME=VERDICT[:REASON]`` for the run folder
``ROOT/NAME`` (its ``verdict.json``, written by every run, crashed or not):

- ``pass``: the verdict is pass;
- ``regression:server-died``: a regression whose findings say the server died;
- ``regression:CHECK``: a regression found by ``CHECK`` (e.g. ``differential``, ``acceptance``),
  the server still alive.

``overlay regress-verdicts ROOT NAME=EXPECT ...`` (:func:`judge_runs`) writes ``ROOT/verdicts.md`` (a table
with every run's findings) and ``ROOT/verdicts.json`` and exits 0 when every run met its
expectation, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlay import jsonfile
from overlay.atomic import write_file
from overlay.regress.errors import RegressError

DIED = "server died"


@dataclass
class Outcome:
    name: str
    expected: str
    verdict: str
    reasons: list[str] = field(default_factory=list)
    met: bool = False
    why: str = ""


def parse_expectation(text: str) -> tuple[str, str, str | None]:
    """``NAME=VERDICT[:REASON]`` -> (name, verdict, reason); raise ValueError with the argument."""
    name, sep, rest = text.partition("=")
    verdict, _, reason = rest.partition(":")
    if not sep or not name or verdict not in ("pass", "regression", "harness") or (verdict == "pass" and reason):
        raise ValueError(f"{text!r}: expected NAME=pass, NAME=regression[:server-died|:CHECK] or NAME=harness")
    return name, verdict, reason or None


def judge(name: str, verdict: str, reason: str | None, doc: dict | None) -> Outcome:
    expected = verdict + (f":{reason}" if reason else "")
    if doc is None:
        return Outcome(name, expected, "none", why="no verdict.json: the run did not get far enough to write one")
    got, reasons = str(doc.get("verdict")), [str(r) for r in doc.get("reasons") or []]
    out = Outcome(name, expected, got, reasons)
    if got != verdict:
        out.why = f"verdict {got}, expected {verdict}"
        return out
    if reason == "server-died":
        out.met = any(DIED in r for r in reasons)
        out.why = "" if out.met else "a regression, but no finding says the server died"
    elif reason:
        out.met = any(r.startswith(f"{reason}: regression:") and DIED not in r for r in reasons)
        out.why = "" if out.met else f"a regression, but not one found by {reason} with the server alive"
    else:
        out.met = True
    return out


def markdown(outcomes: list[Outcome]) -> str:
    lines = ["# Expected verdicts", "", "| run | expected | verdict | met | findings |",
             "| --- | --- | --- | --- | --- |"]
    for o in outcomes:
        found = "<br>".join(r.replace("|", "\\|") for r in o.reasons) or "-"
        lines.append(f"| {o.name} | {o.expected} | {o.verdict} | {'yes' if o.met else 'NO: ' + o.why} | {found} |")
    met = sum(o.met for o in outcomes)
    return "\n".join([*lines, "", f"{met} of {len(outcomes)} runs reached their expected verdict.", ""])


def judge_runs(root: Path, expectations: list[str]) -> int:
    """Judge each ``NAME=EXPECT`` against ``root/NAME/verdict.json``; write ``verdicts.md`` and ``.json``.

    Returns 0 when every run met its expectation, 1 otherwise; a malformed expectation or an unreadable
    ``verdict.json`` is a :class:`RegressError` (exit 2): the proof itself could not be read.
    """
    outcomes = []
    for arg in expectations:
        try:
            name, verdict, reason = parse_expectation(arg)
        except ValueError as exc:
            raise RegressError(str(exc)) from None
        path = root / name / "verdict.json"
        doc = jsonfile.read(path, RegressError, "a run's verdict.json") if path.exists() else None
        if doc is not None:
            jsonfile.get(doc, "verdict", str, "", str(path), RegressError)
            for i, r in enumerate(jsonfile.get(doc, "reasons", list, "", str(path), RegressError) or []):
                jsonfile.need(r, str, f"reasons[{i}]", str(path), RegressError)
        outcomes.append(judge(name, verdict, reason, doc))
    text = markdown(outcomes)
    write_file(root / "verdicts.md", text)
    write_file(root / "verdicts.json", json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    sys.stdout.write(text)
    return 0 if all(o.met for o in outcomes) else 1
