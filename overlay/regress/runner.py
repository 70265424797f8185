"""One regression run: bring the server up (or attach), run the profile's checks, write the report.

The checks and their order are :data:`overlay.regress.checks.CHECKS`. A server that dies ends the
run with a ``server-died`` regression; the remaining checks are reported as skipped.
"""

from __future__ import annotations

import shlex
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from overlay.outpaths import check_dir, check_file
from overlay.regress.baseline_record import destinations, failed_checks, recorded_values, write_recorded_profile
from overlay.regress.checks import CHECKS, Check, function
from overlay.regress.client import check_url
from overlay.regress.errors import RegressError, ServerDied
from overlay.regress.profiles import Profile
from overlay.regress.report import write_report
from overlay.regress.results import (
    Finding,
    Progress,
    RunReport,
    StepResult,
    step_status,
    verdict,
    write_verdict,
)
from overlay.regress.server import Server
from overlay.regress.step import StepContext


def _summary(check: Check, data: dict[str, Any], findings: list[Finding]) -> str:
    if findings:
        return f"{len(findings)} finding(s): {findings[0].message}"
    return function(check.summary)(data)


def run(profile: Profile, out_dir: Path, base_url: str | None = None,
        progress: Callable[[str], None] | None = None, *, ref_url: str | None = None,
        ref_file: str | None = None, record_differential: str | None = None,
        record_baseline: str | None = None,
        baseline_for: str | list[str] | None = None) -> RunReport:
    """Run every check of ``profile`` and write the report folder; never raises for a check.

    ``ref_url`` / ``ref_file``: the differential check's reference (a server, or outputs recorded
    with ``record_differential`` on a run against the reference server). ``record_baseline``: write
    ``baseline_for`` (default this profile; a list for several, ``record_baseline`` then a folder that
    gets ``<profile>.yaml`` of each) with this run's measurements as its baseline.
    """
    say = progress or Progress()
    if base_url is not None:  # a file:// (or any non-http) URL can never answer: refused before anything waits
        check_url(base_url, "--base-url")
    if ref_url:
        check_url(ref_url, "--ref-url (REF_URL)")
    check_dir(out_dir, "--out")  # every output is checked before the server is asked anything
    if record_differential:
        check_file(record_differential, "--record-differential")
    baselines = destinations(record_baseline, baseline_for, profile.path) if record_baseline else []
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("verdict", "verdict.json"):  # a previous run's verdict must not outlive a crash of this one
        (out_dir / stale).unlink(missing_ok=True)
    start = time.monotonic()
    report = RunReport(profile, base_url or "", attached=base_url is not None, out_dir=out_dir,
                       started=datetime.now(UTC).isoformat(timespec="seconds"))
    say(f"profile {profile.name} ({profile.path}); report in {out_dir}")
    server: Server | None = None
    dead = False
    try:
        t0 = time.monotonic()
        try:
            if base_url is not None:
                server = Server.attach(base_url, profile.server)
                say(f"server: attaching to {server.base_url}")
            else:
                server = Server.launch(profile.server, out_dir / "server.log", say)
                report.server_log = str(out_dir / "server.log")
                say(f"server: started {shlex.join(profile.server.command())} (log {report.server_log})")
            report.base_url = server.base_url
            refused = None if server.launched else profile.server.attach_timeout_s
            took = server.wait_ready(profile.server.ready_timeout_s, say, refused_timeout_s=refused)
            server.check_env_read(profile.server.env, profile.path)  # launched: its log says what it ignored
            say(f"server: ready after {took:.1f} s, serving {server.model}")
            report.steps.append(StepResult("server", "pass", f"ready after {took:.1f} s",
                                           time.monotonic() - t0, {"ready_s": round(took, 1)}))
        except ServerDied as exc:
            _record(report, say, StepResult("server", "fail", str(exc), time.monotonic() - t0,
                                            findings=[Finding("server", "regression", str(exc))]))
            dead = True
        except RegressError as exc:
            _record(report, say, StepResult("server", "error", str(exc), time.monotonic() - t0,
                                            findings=[Finding("server", "harness", str(exc))]))
            dead = True
        ctx = StepContext(profile, server, out_dir, say, ref_url=ref_url, ref_file=ref_file,  # type: ignore[arg-type]
                          record_differential=record_differential)
        wanted = [c for c in CHECKS if c.wanted(profile.checks, ctx)]
        if not dead and server is not None:
            for check in wanted:
                if check.prepare:
                    function(check.prepare)(ctx)
        for check in wanted:
            if dead or server is None:
                report.steps.append(StepResult(check.name, "skipped", "the server is not up"))
                continue
            dead = _run_step(check, ctx, report)
    finally:
        if server is not None:
            if server.launched:
                say("server: stopping")
            server.stop()
    failed = failed_checks(report.steps)
    if baselines and failed:
        say(f"record-baseline: {', '.join(failed)} left out: the check failed, its numbers are no baseline")
    for target, dest in baselines:
        try:
            path = write_recorded_profile(target, recorded_values(report.steps), dest,
                                          f"{profile.name} at {report.base_url}")
            left = f" ({', '.join(failed)} left out: failed)" if failed else ""
            report.steps.append(StepResult("record-baseline", "pass", f"wrote {path}{left}"))
            say(f"record-baseline: wrote {path}{left}")
        except RegressError as exc:
            _record(report, say, StepResult("record-baseline", "error", str(exc),
                                            findings=[Finding("record-baseline", "harness", str(exc))]))
    report.verdict, report.exit_code = verdict(report.steps)
    report.seconds = time.monotonic() - start

    paths = write_report(report)
    write_verdict(out_dir, report.exit_code, [_line(f) for s in report.steps for f in s.findings], paths[0])
    say(f"verdict: {report.verdict} (exit {report.exit_code}); report {paths[0]}")
    return report


def _run_step(check: Check, ctx: StepContext, report: RunReport) -> bool:
    """Run one check into the report; return True when the server died during it."""
    name, say = check.name, ctx.say
    t0 = time.monotonic()
    try:
        data, findings = function(check.step)(ctx)
    except ServerDied as exc:
        _record(report, say, StepResult(name, "fail", str(exc), time.monotonic() - t0,
                                        findings=[Finding(name, "regression", f"server died: {exc.detail}")]))
        return True
    except RegressError as exc:
        _record(report, say, StepResult(name, "error", str(exc), time.monotonic() - t0,
                                        findings=[Finding(name, "harness", str(exc))]))
        return False
    except Exception as exc:  # a harness bug: still the harness's failure, and the report is still written
        where = traceback.extract_tb(exc.__traceback__)[-1]
        msg = f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno}; a harness bug)"
        _record(report, say, StepResult(name, "error", msg, time.monotonic() - t0,
                                        findings=[Finding(name, "harness", msg)]))
        return False
    _record(report, say, StepResult(name, step_status(findings), _summary(check, data, findings),
                                    time.monotonic() - t0, data, findings))
    return False


def _line(f: Finding) -> str:
    """A finding as one console line: ``check: kind: message``."""
    return f"{f.check}: {f.kind}: {' '.join(f.message.split())}"


def _record(report: RunReport, say: Callable[[str], None], step: StepResult) -> None:
    """Add a step to the report and print its status and each finding's reason, one line each."""
    report.steps.append(step)
    say(f"{step.name}: {step.status}" + (f" ({len(step.findings)} finding(s))" if step.findings else ""))
    for f in step.findings:
        say(_line(f))
