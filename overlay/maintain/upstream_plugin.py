"""pytest plugin for ``make upstream-tests``: one JSON line per test phase report.

Loaded with ``-p overlay.maintain.upstream_plugin`` into vLLM's own test run; writes to the file named by
``$OVERLAY_UPSTREAM_RESULTS`` (node id, phase, outcome, the first line of why), which
``overlay.maintain.upstream_tests`` reads instead of parsing pytest's terminal output.
"""

from __future__ import annotations

import json
import os

import pytest


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return (text.strip().splitlines() or [""])[0][:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("OVERLAY_UPSTREAM_RESULTS")
    if not path:
        return
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "message": "" if report.passed else _message(report)}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A file that cannot be imported is a failure of every test it would hold: record it."""
    path = os.environ.get("OVERLAY_UPSTREAM_RESULTS")
    if not path or not report.failed:
        return
    rec = {"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": _message(report)}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Opt every test out of vLLM's global cleanup (its ``skip_global_cleanup`` marker).

    ``cleanup_dist_env_and_memory`` touches the accelerator after each test; with no GPU it raises
    and every test that ran would fail at teardown. Tests that need CUDA skip themselves anyway.
    """
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
