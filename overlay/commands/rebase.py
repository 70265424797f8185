"""Carrying the series: ``rebase``, ``rebase-continue``, ``cherry-pick``, and ``patch-tests-matrix``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, root


def configure_parser(sub: argparse._SubParsersAction) -> None:
    for name, text, handler in (
        ("rebase", "carry the series onto release --to: every patch classified in one run; patches/<to>/ with "
                   "REBASE.md, or exit 2 with the report in .work/rebase-<to>/ when some need a person", cmd_rebase),
        ("rebase-continue", "take up a rebase stopped at a conflict after it was resolved with git",
         cmd_rebase_continue),
    ):
        sp = sub.add_parser(name, help=text, description=text)
        add_vllm(sp)
        sp.add_argument("--to", required=name == "rebase", help="target release x.y.z")
        sp.add_argument("--tests", default="tests/patches", help="the patches' own tests (default %(default)s)")
        sp.add_argument("--no-tests", action="store_true", help="skip the upstream-by-behaviour test runs")
        if name == "rebase-continue":
            sp.add_argument("--left-out", action="store_true",
                            help="leave the patch the rebase stopped at out of the series (needs --why)")
            sp.add_argument("--why", default="", help="the person's reason for the resolution (with --left-out: "
                                                      "for leaving the patch out), recorded in REBASE.md and "
                                                      "rebase.json")
        sp.set_defaults(handler=handler)

    text = "add an upstream PR number, commit or patch file to the series; exit 2 at a conflict"
    sp = sub.add_parser("cherry-pick", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("ref", nargs="?", default="",  # make cherry-pick passes REF, empty when unset: "needs REF"
                    help="upstream PR number, commit, or patch file")
    sp.add_argument("--remote", help="vLLM git remote (default $VLLM_REMOTE or GitHub)")
    sp.add_argument("--name", help="patch file name (default: from the subject)")
    sp.add_argument("--after", help="place after this patch (default: at the end)")
    sp.add_argument("--before", help="place before this patch")
    sp.add_argument("--origin", help="Origin: for a patch file that has none")
    sp.add_argument("--continue", dest="continue_", action="store_true",
                    help="finish a cherry-pick stopped at a conflict")
    sp.set_defaults(handler=cmd_cherry_pick)

    text = ("every patch's own tests on every release of --releases, without and with the patch: "
            "one table of patch x release; exit 1 when a cell is red")
    sp = sub.add_parser("patch-tests-matrix", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--releases", nargs="+", metavar="X.Y.Z",
                    help="the releases to run on (default: every release newer than --vllm pinned in patches/ "
                         "or --pins)")
    sp.add_argument("--out", default="patch-tests-matrix", help="report folder (default %(default)s)")
    sp.add_argument("--tests", default="tests/patches", help="the patches' own tests (default %(default)s)")
    sp.add_argument("--pins", default="tests/pins", help="pins of releases without a series "
                                                         "(default %(default)s; others: the index)")
    sp.set_defaults(handler=cmd_patch_tests_matrix)


def _print_outcome(message: str, done: bool) -> int:
    print(message, file=sys.stderr)
    return 0 if done else 2  # 2: stopped at a conflict, a person's turn


def cmd_rebase(ns: argparse.Namespace) -> int:
    from overlay.maintain.rebase import rebase_release

    out = rebase_release(root(ns), ns.vllm, ns.to, tests_dir=Path(ns.tests), run_tests=not ns.no_tests)
    if out.done:
        print(out.out_dir)
    return _print_outcome(out.message, out.done)


def cmd_rebase_continue(ns: argparse.Namespace) -> int:
    from overlay.maintain.rebase import RebaseError, continue_release

    if ns.left_out and not ns.why.strip():
        raise RebaseError("LEFT_OUT=1 (--left-out) needs WHY=\"...\" (--why): the reason the patch is left out, "
                          "recorded in REBASE.md and rebase.json")
    out = continue_release(ns.to or None, tests_dir=Path(ns.tests), run_tests=not ns.no_tests,
                           left_out=ns.why if ns.left_out else None, why="" if ns.left_out else ns.why)
    if out.done:
        print(out.out_dir)
    return _print_outcome(out.message, out.done)


def cmd_cherry_pick(ns: argparse.Namespace) -> int:
    from overlay.maintain.cherry_pick import cherry_pick_continue, cherry_pick_release

    if ns.continue_:
        out = cherry_pick_continue(Path(".work") / f"cherry-pick-{ns.vllm}")
    elif not ns.ref:
        from overlay.errors import OverlayError

        # exit 1, as before: cherry-pick's 2 means "stopped at a conflict"
        raise OverlayError("cherry-pick needs REF (a PR number, a commit or a patch file)")
    else:
        out = cherry_pick_release(root(ns), ns.vllm, ns.ref, remote=ns.remote or None, name=ns.name or None,
                                  after=ns.after or None, before=ns.before or None, origin=ns.origin or None)
    for path in out.left_out:
        print(f"left out (not in the wheel): {path}", file=sys.stderr)
    if out.done:
        print(out.patch)
    return _print_outcome(out.message, out.done)


def cmd_patch_tests_matrix(ns: argparse.Namespace) -> int:
    from overlay.maintain.rebase.matrix import main as matrix_main

    return matrix_main(root(ns), ns.vllm, ns.releases, Path(ns.out), Path(ns.tests), [Path(ns.pins)])
