"""Findings, step results and the verdict of a regression run.

A finding is either a ``regression`` (the build misbehaved: exit 1) or ``harness`` (the run could
not judge something: exit 2). Regressions win: a real regression found by a run that also
stumbled is still a regression.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["regression", "harness"]
Status = Literal["pass", "fail", "error", "skipped"]

EXIT_PASS, EXIT_REGRESSION, EXIT_HARNESS = 0, 1, 2


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


class Progress:
    """Progress lines on stderr, each stamped with the time since the run started."""

    def __init__(self, stream: Any = None) -> None:
        self.start = time.monotonic()
        self.stream = stream

    def __call__(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.start)
        stream = self.stream or sys.stderr
        print(f"[regress {elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=stream, flush=True)
