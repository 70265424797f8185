"""Findings, step results and the verdict of a regression run.

A finding is either a ``regression`` (the build misbehaved: exit 1) or ``harness`` (the run could
not judge something: exit 2). Regressions win: a real regression found by a run that also
stumbled is still a regression.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from overlay.regress.profiles import Profile

Kind = Literal["regression", "harness"]
Status = Literal["pass", "fail", "error", "skipped"]

EXIT_PASS, EXIT_REGRESSION, EXIT_HARNESS = 0, 1, 2
VERDICT_WORDS = {EXIT_PASS: "pass", EXIT_REGRESSION: "regression", EXIT_HARNESS: "harness"}


@dataclass(frozen=True)
class Finding:
    check: str
    kind: Kind
    message: str


@dataclass
class StepResult:
    name: str
    status: Status
    summary: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_status(findings: list[Finding]) -> Status:
    if any(f.kind == "regression" for f in findings):
        return "fail"
    return "error" if findings else "pass"


def verdict(steps: list[StepResult]) -> tuple[str, int]:
    findings = [f for s in steps for f in s.findings]
    if any(f.kind == "regression" for f in findings):
        return "regression", EXIT_REGRESSION
    if findings:
        return "harness failure", EXIT_HARNESS
    return "pass", EXIT_PASS


def write_verdict(out_dir: Path, exit_code: int, reasons: list[str], report: Path | None = None) -> str:
    """Write ``verdict`` (one word: pass, regression, harness) and ``verdict.json`` into ``out_dir``.

    What ``make regress`` reads back: make itself exits 2 for any failing recipe, so its status can
    say only pass or not; these files say which failure it was. Returns the word.
    """
    word = VERDICT_WORDS.get(exit_code, "harness")
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"verdict": word, "exit_code": exit_code, "reasons": reasons,
           "report": report.name if report is not None else None}  # beside it (never a machine's path)
    (out_dir / "verdict.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / "verdict").write_text(word + "\n", encoding="utf-8")
    return word


class Progress:
    """Progress lines on stderr, each stamped with the time since the run started."""

    def __init__(self, stream: Any = None) -> None:
        self.start = time.monotonic()
        self.stream = stream

    def __call__(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.start)
        stream = self.stream or sys.stderr
        print(f"[regress {elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=stream, flush=True)


@dataclass
class RunReport:
    """A whole run: the profile, the server it judged, every step's result and the verdict."""

    profile: Profile
    base_url: str
    attached: bool
    out_dir: Path
    started: str
    steps: list[StepResult] = field(default_factory=list)
    verdict: str = ""
    exit_code: int = 2
    server_log: str | None = None
    seconds: float = 0.0
