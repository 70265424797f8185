"""Checks of the series' form: ``upstream-tests`` (vLLM's own tests) and ``patch-lint`` (vLLM's own ruff)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, at_least, root


def configure_parser(sub: argparse._SubParsersAction) -> None:
    text = ("vLLM's own tests of the touched modules, from the verified sdist, on the patched tree; "
            "exit 0 pass, 1 regression or stale expected failure, 2 harness")
    sp = sub.add_parser("upstream-tests", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--out", default="upstream-tests", help="report folder (default %(default)s)")
    sp.add_argument("--timeout", type=at_least(1), default=300, help="seconds per test (default %(default)s)")
    sp.set_defaults(handler=cmd_upstream_tests)

    text = ("the lines the series adds, through the release's own ruff check and ruff format (its "
            "pyproject.toml and pre-commit ruff version); exit 0 clean, 1 findings")
    sp = sub.add_parser("patch-lint", help=text, description=text)
    add_vllm(sp)
    sp.set_defaults(handler=cmd_patch_lint)


def cmd_upstream_tests(ns: argparse.Namespace) -> int:
    from overlay.build.install import installed_mismatch
    from overlay.maintain.upstream_tests import UpstreamTestsError, run

    why = installed_mismatch(ns.vllm)
    if why is not None:  # vLLM's own tests import the installed vllm: another release's build would be judged
        raise UpstreamTestsError(f"upstream-tests {why}: vLLM's own tests judge the build this environment imports")
    out = Path(ns.out)
    report = run(root(ns), ns.vllm, out, timeout=ns.timeout)
    for row in report.regressions:
        print(f"regression: {row['test']}: {row['message']}", file=sys.stderr)
    for row in report.stale:
        print(f"stale expected failure: {row['test']} ({row['patch']}): {row['why']}", file=sys.stderr)
    c = report.counts
    print(f"verdict: {report.verdict} ({c['passed']} passed, {c['failed']} failed ({len(report.expected_failing)} "
          f"expected, {len(report.base_failures)} on the base too), {c['skipped']} skipped, {report.seconds:.0f} s); "
          f"report {out / 'upstream-tests.md'}", file=sys.stderr)
    return 0 if report.verdict == "pass" else 1


def cmd_patch_lint(ns: argparse.Namespace) -> int:
    from overlay.maintain.patch_lint import main as lint_main

    return lint_main(root(ns), ns.vllm)
