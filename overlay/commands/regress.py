"""``overlay regress`` (a served build against a profile's checks and baselines) and ``regress-verdicts``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from overlay import numbers
from overlay.commands.common import add_vllm, at_least, port, positive


def configure_parser(sub: argparse._SubParsersAction) -> None:
    from overlay.regress.checks import CHECKS, NAMES  # standard library only; a check loads its code when it runs

    recorded = [c.words for c in CHECKS if c.record]
    text = (f"{', '.join(c.words for c in CHECKS)} of a served build, in that order, against a reference and "
            "a profile's baselines; exit 0 pass, 1 regression, 2 harness failure")
    sp = sub.add_parser("regress", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--profile", default="glm5.2-fp8-tp8-dcp8",
                    help="shipped profile name or YAML path (default %(default)s)")
    sp.add_argument("--base-url", help="attach to this running server instead of starting vllm serve")
    sp.add_argument("--out", default="regress-report", help="report folder (default %(default)s)")
    sp.add_argument("--gsm8k-data", help="local GSM8K folder (train.jsonl, test.jsonl): no hub access")
    sp.add_argument("--gsm8k-limit", type=at_least(1), help="only the first N test questions")
    sp.add_argument("--latency-tool", choices=["vllm-bench", "builtin"], help="override the profile's")
    sp.add_argument("--ready-timeout", type=positive("seconds"), help="seconds to wait for readiness")
    sp.add_argument("--attach-timeout", type=positive("seconds"),
                    help="with --base-url: seconds of refused connections before a harness failure "
                         "(default: the profile's server.attach_timeout_s, or REGRESS_ATTACH_TIMEOUT)")
    sp.add_argument("--skip", help=f"checks to leave out, comma-separated ({','.join(NAMES)})")
    sp.add_argument("--ref-url", help="differential check: the reference server (default: $REF_URL)")
    sp.add_argument("--ref-file", help="differential check: reference outputs recorded with "
                                       "--record-differential (not with --ref-url or REF_URL)")
    sp.add_argument("--record-differential", metavar="FILE",
                    help="this server is the reference: record its differential outputs into FILE "
                         "(judges nothing for that check)")
    sp.add_argument("--record-baseline", metavar="FILE",
                    help="write a profile (--baseline-for, default this one) with this run's "
                         f"{', '.join(recorded)} as its baseline")
    sp.add_argument("--baseline-for", metavar="PROFILE", action="append",
                    help="with --record-baseline: the profile to copy (repeat it for several: "
                         "--record-baseline is then a folder that gets <profile>.yaml of each)")
    sp.add_argument("--port", type=port(), help="start the server on this port (overrides server.port)")
    sp.add_argument("--vllm-bin", help="the vllm command (overrides server.vllm_bin), e.g. "
                                       "'python3 -m vllm.entrypoints.cli.main'")
    sp.set_defaults(handler=cmd_regress)

    text = ("did each of several regress runs reach the verdict it should? ROOT/NAME/verdict.json against "
            "NAME=pass|regression[:server-died|:CHECK]|harness; ROOT/verdicts.md and .json; exit 0 all met, 1 not")
    sp = sub.add_parser("regress-verdicts", help=text, description=text)
    sp.add_argument("root", type=Path, help="the folder holding one folder per run")
    sp.add_argument("expectations", nargs="+", metavar="NAME=EXPECT")
    sp.set_defaults(handler=cmd_regress_verdicts)


def cmd_regress(ns: argparse.Namespace) -> int:
    """The verdict as exit status (0 pass, 1 regression, 2 harness) and in OUT/verdict, for make."""
    from overlay.errors import OverlayError, UsageError
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile
    from overlay.regress.runner import run

    out = Path(ns.out)
    try:
        raw = os.environ.get("REGRESS_ATTACH_TIMEOUT", "").strip()
        try:
            attach_timeout_s = float(raw) if raw else None
        except ValueError:
            raise ProfileError(f"REGRESS_ATTACH_TIMEOUT: expected seconds, got {raw!r}") from None
        wrong = numbers.problem(attach_timeout_s, 0, strict=True) if attach_timeout_s is not None else None
        if wrong:  # checked where it is read, so the line names the variable
            raise ProfileError(f"REGRESS_ATTACH_TIMEOUT: {wrong}")
        if ns.attach_timeout is not None:
            attach_timeout_s = ns.attach_timeout
        ref_url = ns.ref_url or os.environ.get("REF_URL") or None
        if ref_url and ns.ref_file:
            came = "--ref-url" if ns.ref_url else "REF_URL (environment)"
            raise UsageError(f"{came} {ref_url} and --ref-file {ns.ref_file} both name the differential check's "
                             "reference: give one (unset REF_URL to judge against the file)")
        profile = load_profile(ns.profile).with_overrides(
            gsm8k_data=ns.gsm8k_data, gsm8k_limit=ns.gsm8k_limit, latency_tool=ns.latency_tool,
            ready_timeout_s=ns.ready_timeout, attach_timeout_s=attach_timeout_s,
            skip=tuple(c for c in (ns.skip or "").split(",") if c), port=ns.port, vllm_bin=ns.vllm_bin)
        report = run(profile, out, base_url=ns.base_url or None,
                     ref_url=ref_url, ref_file=ns.ref_file,
                     record_differential=ns.record_differential, record_baseline=ns.record_baseline,
                     baseline_for=ns.baseline_for)
    except OverlayError as exc:
        _verdict(out, f"harness: {' '.join(str(exc).split())}")
        raise
    except Exception as exc:
        _verdict(out, f"harness: {type(exc).__name__}: {' '.join(str(exc).split())}")
        raise
    print(report.out_dir / "report.md")
    return report.exit_code  # the verdict: 0 pass, 1 regression, 2 harness failure


def _verdict(out: Path, reason: str) -> None:
    """The harness verdict for make, where ``out`` can take it (an unwritable ``--out`` is the error itself)."""
    from overlay.regress.results import write_verdict

    try:
        write_verdict(out, 2, [reason])
    except OSError:
        pass


def cmd_regress_verdicts(ns: argparse.Namespace) -> int:
    from overlay.regress.verdicts import judge_runs

    return judge_runs(ns.root, ns.expectations)
