"""One verb per Make target: parse arguments, call one function, map errors to one line.

Library code raises :class:`overlay.errors.OverlayError`; only this module prints it (one
line, ``error: ...``) and picks the exit code. Unexpected exceptions keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from overlay.errors import OverlayError

Handler = Callable[[argparse.Namespace], int]


def _root(ns: argparse.Namespace) -> Path:
    return Path(ns.patches)


def cmd_build(ns: argparse.Namespace) -> int:
    from overlay.build import build
    from overlay.install import cpu_installable, install

    kernels = None
    if ns.kernels:
        from overlay.kernels import collect_kernels

        kernels = collect_kernels(Path(ns.kernels))
    result = build(_root(ns), ns.vllm, Path(ns.dist),
                   base_wheel=Path(ns.base_wheel) if ns.base_wheel else None, kernels=kernels)
    print(f"built {result.wheel} ({result.version}, {result.patches} patch(es), {result.seconds:.2f} s)",
          file=sys.stderr)
    why_not = cpu_installable(result.wheel) if ns.install else None
    if why_not:
        print(f"not installed into {ns.install}: {why_not}; install it on a GPU machine with "
              f"`pip install {result.wheel}`", file=sys.stderr)
    elif ns.install:
        t0 = time.perf_counter()
        done = install(result.wheel, Path(ns.install), with_deps=not ns.no_deps)
        how = {"incremental": f"changed files only, {done.written} written", "pip": "pip",
               "unchanged": "already installed"}[done.how]
        print(f"installed {result.version} into {ns.install} ({how}, {time.perf_counter() - t0:.2f} s)",
              file=sys.stderr)
    print(result.wheel)
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from overlay.status import format_table, series_status

    rows = series_status(_root(ns), ns.vllm)
    if ns.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        sys.stdout.write(format_table(rows, ns.vllm))
    return 0 if all(r.applies for r in rows) else 1


def cmd_workspace(ns: argparse.Namespace) -> int:
    from overlay.workspace import create

    dest = Path(ns.dest or f".work/{ns.vllm}")
    create(_root(ns), ns.vllm, dest)
    print(dest)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from overlay.workspace import export

    src = Path(ns.src or f".work/{ns.vllm}")
    names = export(src, _root(ns), ns.vllm, allow_dirty=ns.allow_dirty)
    print(f"exported {len(names)} patch(es) to {_root(ns) / ns.vllm}", file=sys.stderr)
    return 0


def cmd_bench_build(ns: argparse.Namespace) -> int:
    from overlay.bench.build import run

    return run(_root(ns), ns.vllm, repeat=ns.repeat, json_out=Path(ns.json_out) if ns.json_out else None)


def cmd_bench_merge(ns: argparse.Namespace) -> int:
    from overlay.bench.merge import run

    return run(Path(ns.out), tokens=ns.tokens, replays=ns.replays,
               plot_from=Path(ns.plot) if ns.plot else None, ranks=ns.ranks, bounds=ns.bounds,
               profile_tokens=tuple(ns.profile_eager))


def cmd_image(ns: argparse.Namespace) -> int:
    from overlay.image import build_image, format_plan, plan_image, prepare_kernel_source

    if ns.kernel_source:
        kernels = prepare_kernel_source(_root(ns), ns.vllm, Path(ns.kernel_source))
        for path, targets, why in kernels.reasons:
            print(f"{path} -> {' '.join(targets)} ({why})", file=sys.stderr)
        print("\n".join(kernels.targets))
        return 0
    plan = plan_image(
        _root(ns), ns.vllm, dist=Path(ns.dist), image=ns.image, extra_tags=tuple(ns.tag),
        arch_list=ns.arch, max_jobs=ns.max_jobs, nvcc_threads=ns.nvcc_threads,
        base_digest=ns.base_digest, push=ns.push,
    )
    if ns.dry_run:
        sys.stdout.write(format_plan(plan))
        return 0
    return build_image(plan, _root(ns), Path(ns.dist))


def cmd_regress(ns: argparse.Namespace) -> int:
    """The verdict as exit status (0 pass, 1 regression, 2 harness) and in OUT/verdict, for make."""
    import os

    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile
    from overlay.regress.results import write_verdict
    from overlay.regress.runner import run

    out = Path(ns.out)
    try:
        raw = os.environ.get("REGRESS_ATTACH_TIMEOUT", "").strip()
        try:
            attach_timeout_s = float(raw) if raw else None
        except ValueError:
            raise ProfileError(f"REGRESS_ATTACH_TIMEOUT: expected seconds, got {raw!r}") from None
        if ns.attach_timeout is not None:
            attach_timeout_s = ns.attach_timeout
        profile = load_profile(ns.profile).with_overrides(
            gsm8k_data=ns.gsm8k_data, gsm8k_limit=ns.gsm8k_limit, latency_tool=ns.latency_tool,
            ready_timeout_s=ns.ready_timeout, attach_timeout_s=attach_timeout_s,
            skip=tuple(c for c in (ns.skip or "").split(",") if c), port=ns.port, vllm_bin=ns.vllm_bin)
        report = run(profile, out, base_url=ns.base_url or None,
                     ref_url=ns.ref_url or os.environ.get("REF_URL") or None, ref_file=ns.ref_file,
                     record_differential=ns.record_differential, record_baseline=ns.record_baseline,
                     baseline_for=ns.baseline_for)
    except OverlayError as exc:
        write_verdict(out, 2, [f"harness: {' '.join(str(exc).split())}"])
        raise
    except Exception as exc:
        write_verdict(out, 2, [f"harness: {type(exc).__name__}: {' '.join(str(exc).split())}"])
        raise
    print(report.out_dir / "report.md")
    return report.exit_code  # the verdict: 0 pass, 1 regression, 2 harness failure


def _print_outcome(message: str, done: bool) -> int:
    print(message, file=sys.stderr)
    return 0 if done else 2  # 2: stopped at a conflict, a person's turn


def cmd_patch_lint(ns: argparse.Namespace) -> int:
    from overlay.patch_lint import main as lint_main

    return lint_main(_root(ns), ns.vllm)


def cmd_rebase(ns: argparse.Namespace) -> int:
    from overlay.rebase import rebase_release

    out = rebase_release(_root(ns), ns.vllm, ns.to, tests_dir=Path(ns.tests), run_tests=not ns.no_tests)
    if out.done:
        print(out.out_dir)
    return _print_outcome(out.message, out.done)


def cmd_rebase_continue(ns: argparse.Namespace) -> int:
    from overlay.rebase import continue_release

    out = continue_release(ns.to or None, tests_dir=Path(ns.tests), run_tests=not ns.no_tests)
    if out.done:
        print(out.out_dir)
    return _print_outcome(out.message, out.done)


def cmd_patch_tests_matrix(ns: argparse.Namespace) -> int:
    from overlay.rebase.matrix import main as matrix_main

    return matrix_main(_root(ns), ns.vllm, ns.releases, Path(ns.out), Path(ns.tests), [Path(ns.pins)])


def cmd_cherry_pick(ns: argparse.Namespace) -> int:
    from overlay.cherry_pick import cherry_pick_continue, cherry_pick_release

    if ns.continue_:
        out = cherry_pick_continue(Path(".work") / f"cherry-pick-{ns.vllm}")
    elif not ns.ref:
        print("error: cherry-pick needs REF (a PR number, a commit or a patch file)", file=sys.stderr)
        return 1
    else:
        out = cherry_pick_release(_root(ns), ns.vllm, ns.ref, remote=ns.remote or None, name=ns.name or None,
                                  after=ns.after or None, before=ns.before or None, origin=ns.origin or None)
    for path in out.left_out:
        print(f"left out (not in the wheel): {path}", file=sys.stderr)
    if out.done:
        print(out.patch)
    return _print_outcome(out.message, out.done)


def cmd_workspace_plan(ns: argparse.Namespace) -> int:
    from overlay.workspace_plan import build_config, format_plan, plan

    try:
        config = build_config(
            ns.profile, tp=ns.tp, dcp=ns.dcp, num_heads=ns.num_heads, kv_lora_rank=ns.kv_lora_rank,
            qk_rope_head_dim=ns.rope_dim, max_num_seqs=ns.max_num_seqs,
            speculative_tokens=ns.speculative_tokens, parallel_drafting=ns.parallel_drafting,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            cudagraph_capture_size=ns.cudagraph_capture_size, num_ubatches=ns.num_ubatches,
            query_dtype_bytes=ns.query_dtype_bytes, q_padded_heads=ns.q_padded_heads)
    except ValueError as exc:
        raise OverlayError(str(exc)) from None
    result = plan(config)
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(format_plan(result))
    return 0


def cmd_device_stage(ns: argparse.Namespace) -> int:
    from overlay.device import (
        MIB,
        built_wheel,
        carry_limit,
        device_calls,
        format_summary,
        stage,
        with_harness,
    )

    wheel = Path(ns.wheel) if ns.wheel else built_wheel(_root(ns), ns.vllm, Path(ns.dist))
    dest = Path(ns.dest) / ns.name
    result = stage(wheel, dest, device_packages=Path(ns.device_packages), name=ns.name,
                   limit=carry_limit(Path.cwd(), int(ns.limit_mib * MIB)), resolver_python=ns.resolver_python,
                   full=ns.full, resolution_cache=not ns.no_resolution_cache, extras=with_harness(ns.extra))
    print(format_summary(result.manifest), file=sys.stderr)
    print(device_calls(result.manifest, dest, ns.command))
    return 0


def cmd_upstream_tests(ns: argparse.Namespace) -> int:
    from overlay.upstream_tests import run

    out = Path(ns.out)
    report = run(_root(ns), ns.vllm, out, timeout=ns.timeout)
    for row in report.regressions:
        print(f"regression: {row['test']}: {row['message']}", file=sys.stderr)
    for row in report.stale:
        print(f"stale expected failure: {row['test']} ({row['patch']}): {row['why']}", file=sys.stderr)
    c = report.counts
    print(f"verdict: {report.verdict} ({c['passed']} passed, {c['failed']} failed ({len(report.expected_failing)} "
          f"expected, {len(report.base_failures)} on the base too), {c['skipped']} skipped, {report.seconds:.0f} s); "
          f"report {out / 'upstream-tests.md'}", file=sys.stderr)
    return 0 if report.verdict == "pass" else 1


COMMANDS: dict[str, tuple[str, Handler]] = {
    "build": ("fetch + verify the base wheel, apply the series, write and install the wheel", cmd_build),
    "status": ("each patch: subject, origin, kind, files, applies to the pinned base", cmd_status),
    "workspace": ("git tree of the base with the series as commits, for editing patches", cmd_workspace),
    "export": ("write the workspace's commits back as the series (deterministic)", cmd_export),
    "workspace-plan": ("capacity (tokens) and bytes per GPU of the direct DCP q-gather and A2A workspaces, "
                       "both sizing modes, from flags or a regress profile", cmd_workspace_plan),
    "bench-build": ("time a rebuild from the cached wheel against a plain copy of it, and edit -> installed",
                    cmd_bench_build),
    "bench-merge": ("GPUs: DCP merge + W_UV projection, merge-then-project vs project-then-merge, "
                    "per transport (table, JSON, PNG)", cmd_bench_merge),
    "image": ("Docker image over the official vLLM image; kernels rebuilt only for kernel patches",
              cmd_image),
    "regress": ("GSM8K, long context, acceptance and latency of a served build against a profile's "
                "baselines; exit 0 pass, 1 regression, 2 harness failure", cmd_regress),
    "rebase": ("carry the series onto release --to: every patch classified in one run; patches/<to>/ with "
               "REBASE.md, or exit 2 with the report in .work/rebase-<to>/ when some need a person",
               cmd_rebase),
    "rebase-continue": ("take up a rebase stopped at a conflict after it was resolved with git",
                        cmd_rebase_continue),
    "patch-tests-matrix": ("every patch's own tests on every release of --releases, without and with the patch: "
                           "one table of patch x release; exit 1 when a cell is red", cmd_patch_tests_matrix),
    "cherry-pick": ("add an upstream PR number, commit or patch file to the series; exit 2 at a conflict",
                    cmd_cherry_pick),
    "upstream-tests": ("vLLM's own tests of the touched modules, from the verified sdist, on the patched tree; "
                       "exit 0 pass, 1 regression or stale expected failure, 2 harness", cmd_upstream_tests),
    "patch-lint": ("the lines the series adds, through the release's own ruff check and ruff format (its "
                   "pyproject.toml and pre-commit ruff version); exit 0 clean, 1 findings", cmd_patch_lint),
    "device-stage": ("stage the built wheel's tree and kernels and the wheels vLLM needs for the GPU device "
                     "machine into carries of <= 60 MiB, with the device calls to make", cmd_device_stage),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overlay", description="patched vLLM overlay builds")
    p.add_argument("--patches", default="patches", help="folder holding patches/<version>/")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (help_text, handler) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(handler=handler)
        sp.add_argument("--vllm", help="pinned vLLM release (default: patches/DEFAULT)")
        if name == "build":
            sp.add_argument("--dist", default="dist")
            sp.add_argument("--install", metavar="VENV", help="install the wheel into this environment")
            sp.add_argument("--no-deps", action="store_true", help="install only the wheel")
            sp.add_argument("--base-wheel", help="use this verified base wheel instead of fetching")
            sp.add_argument("--kernels", metavar="DIR", help="rebuilt kernel .so files (make image)")
        elif name == "status":
            sp.add_argument("--json", action="store_true")
        elif name == "workspace":
            sp.add_argument("--dest")
        elif name == "export":
            sp.add_argument("--src")
            sp.add_argument("--allow-dirty", action="store_true",
                            help="export the commits although the workspace has uncommitted changes (they stay out)")
        elif name == "workspace-plan":
            sp.add_argument("--profile", help="regress profile name or YAML: TP, DCP, batching, speculation "
                                              "from its serve arguments (flags override)")
            sp.add_argument("--tp", type=int, help="tensor parallel size (default 8)")
            sp.add_argument("--dcp", type=int, help="decode context parallel size (default 8)")
            sp.add_argument("--num-heads", type=int, help="attention heads of the model (default 64, GLM-5)")
            sp.add_argument("--kv-lora-rank", type=int, help="default 512")
            sp.add_argument("--rope-dim", type=int, help="qk_rope_head_dim (default 64)")
            sp.add_argument("--max-num-seqs", type=int,
                            help="default 128 (the seed's setup; a profile without the flag: vLLM's 1024)")
            sp.add_argument("--speculative-tokens", type=int, help="num_speculative_tokens (default 0)")
            sp.add_argument("--parallel-drafting", action=argparse.BooleanOptionalAction, default=None,
                            help="speculative parallel drafting (2 tokens per draft position)")
            sp.add_argument("--max-num-batched-tokens", type=int, help="default 8192")
            sp.add_argument("--cudagraph-capture-size", type=int,
                            help="max cudagraph capture size (default: vLLM's, min(seqs x (1 + spec) x 2, 512))")
            sp.add_argument("--num-ubatches", type=int, help="DBO micro-batches (default 1)")
            sp.add_argument("--query-dtype-bytes", type=int, help="2 (bf16, default) or 1 (fp8 query)")
            sp.add_argument("--q-padded-heads", type=int, help="query heads the backend pads to (default DCP x H)")
            sp.add_argument("--json", action="store_true")
        elif name == "image":
            sp.add_argument("--dist", default="dist")
            sp.add_argument("--dry-run", action="store_true", help="print the plan, build nothing")
            sp.add_argument("--image", default="vllm-overlay", help="image name (default %(default)s)")
            sp.add_argument("--tag", action="append", default=[], help="another full image tag")
            sp.add_argument("--arch", default="9.0a", help="TORCH_CUDA_ARCH_LIST (default %(default)s)")
            sp.add_argument("--max-jobs", default="", help="MAX_JOBS of the kernel build")
            sp.add_argument("--nvcc-threads", default="", help="NVCC_THREADS of the kernel build")
            sp.add_argument("--base-digest", default="", help="pin the base image: sha256:<64 hex>")
            sp.add_argument("--push", action="store_true", help="push the tags after building")
            sp.add_argument("--kernel-source", metavar="DIR",
                            help="kernel stage: unpack the verified sdist into DIR, apply the series, "
                                 "print the targets to rebuild")
        elif name == "regress":
            sp.add_argument("--profile", default="glm5.2-fp8-tp8-dcp8",
                            help="shipped profile name or YAML path (default %(default)s)")
            sp.add_argument("--base-url", help="attach to this running server instead of starting vllm serve")
            sp.add_argument("--out", default="regress-report", help="report folder (default %(default)s)")
            sp.add_argument("--gsm8k-data", help="local GSM8K folder (train.jsonl, test.jsonl): no hub access")
            sp.add_argument("--gsm8k-limit", type=int, help="only the first N test questions")
            sp.add_argument("--latency-tool", choices=["vllm-bench", "builtin"], help="override the profile's")
            sp.add_argument("--ready-timeout", type=float, help="seconds to wait for readiness")
            sp.add_argument("--attach-timeout", type=float,
                            help="with --base-url: seconds of refused connections before a harness failure "
                                 "(default: the profile's server.attach_timeout_s, or REGRESS_ATTACH_TIMEOUT)")
            sp.add_argument("--skip", help="checks to leave out, comma-separated "
                                           "(differential,long_context,gsm8k,acceptance,latency)")
            sp.add_argument("--ref-url", help="differential check: the reference server (default: $REF_URL)")
            sp.add_argument("--ref-file", help="differential check: reference outputs recorded with "
                                               "--record-differential")
            sp.add_argument("--record-differential", metavar="FILE",
                            help="this server is the reference: record its differential outputs into FILE "
                                 "(judges nothing for that check)")
            sp.add_argument("--record-baseline", metavar="FILE",
                            help="write a profile (--baseline-for, default this one) with this run's GSM8K, "
                                 "acceptance and latency as its baseline")
            sp.add_argument("--baseline-for", metavar="PROFILE", action="append",
                            help="with --record-baseline: the profile to copy (repeat it for several: "
                                 "--record-baseline is then a folder that gets <profile>.yaml of each)")
            sp.add_argument("--port", type=int, help="start the server on this port (overrides server.port)")
            sp.add_argument("--vllm-bin", help="the vllm command (overrides server.vllm_bin), e.g. "
                                               "'python3 -m vllm.entrypoints.cli.main'")
        elif name in ("rebase", "rebase-continue"):
            sp.add_argument("--to", required=name == "rebase", help="target release x.y.z")
            sp.add_argument("--tests", default="tests/patches", help="the patches' own tests (default %(default)s)")
            sp.add_argument("--no-tests", action="store_true", help="skip the upstream-by-behaviour test runs")
        elif name == "patch-tests-matrix":
            sp.add_argument("--releases", nargs="+", required=True, metavar="X.Y.Z", help="the releases to run on")
            sp.add_argument("--out", default="patch-tests-matrix", help="report folder (default %(default)s)")
            sp.add_argument("--tests", default="tests/patches", help="the patches' own tests (default %(default)s)")
            sp.add_argument("--pins", default="tests/pins", help="pins of releases without a series "
                                                                 "(default %(default)s; others: the index)")
        elif name == "cherry-pick":
            sp.add_argument("ref", nargs="?", help="upstream PR number, commit, or patch file")
            sp.add_argument("--remote", help="vLLM git remote (default $VLLM_REMOTE or GitHub)")
            sp.add_argument("--name", help="patch file name (default: from the subject)")
            sp.add_argument("--after", help="place after this patch (default: at the end)")
            sp.add_argument("--before", help="place before this patch")
            sp.add_argument("--origin", help="Origin: for a patch file that has none")
            sp.add_argument("--continue", dest="continue_", action="store_true",
                            help="finish a cherry-pick stopped at a conflict")
        elif name == "device-stage":
            sp.add_argument("--name", default="engine", help="stage folder name (default %(default)s)")
            sp.add_argument("--dest", default=".device", help="root of the stage folders, ignored by git "
                                                              "(default %(default)s)")
            sp.add_argument("--dist", default="dist")
            sp.add_argument("--wheel", help="the patched wheel (default: the one make build writes for the series)")
            sp.add_argument("--device-packages", default="scripts/device-packages.txt",
                            help="the device's pip freeze (default %(default)s)")
            sp.add_argument("--limit-mib", type=float, default=60,
                            help="largest carry in MiB (default 60; less when the checkout and a carry would "
                                 "pass the 64 MiB of a device call)")
            sp.add_argument("--full", action="store_true", help="stage every requirement, also those an engine "
                                                                "run does not import (device.settings.NOT_NEEDED)")
            sp.add_argument("--resolver-python", help="a CPython 3.12 with pip to resolve with "
                                                      "(default: python3.12, then pyenv's)")
            sp.add_argument("--no-resolution-cache", action="store_true",
                            help="resolve again with pip even if the same requirements, device packages and "
                                 "target were resolved before (the new resolution replaces the cached one)")
            sp.add_argument("--extra", action="append", default=[], metavar="REQ",
                            help="a requirement to stage besides vLLM's (repeatable), e.g. 'lm-eval[api]==0.4.13' "
                                 "for the regression harness: resolved with vLLM's requirements into one set, "
                                 "never older than a device package; a pure-Python sdist-only package is built "
                                 "into a wheel")
            sp.add_argument("--command", default="python3 -m pytest -m gpu tests/patches",
                            help="the command shown for the last device call")
        elif name == "upstream-tests":
            sp.add_argument("--out", default="upstream-tests", help="report folder (default %(default)s)")
            sp.add_argument("--timeout", type=int, default=300, help="seconds per test (default %(default)s)")
        elif name == "bench-build":
            sp.add_argument("--repeat", type=int, default=5)
            sp.add_argument("--json-out")
        elif name == "bench-merge":
            sp.add_argument("--out", default="bench-merge", help="folder for merge.json/.txt/.png")
            sp.add_argument("--tokens", type=int, nargs="+", help="token counts (default 1 16 128 768 8192)")
            sp.add_argument("--replays", type=int, default=50, help="timed CUDA-graph replays (>= 50)")
            sp.add_argument("--plot", help="only draw the table and plot from this merge.json")
            sp.add_argument("--ranks", type=int, default=2,
                            help="DCP ranks, one GPU each, 8 heads per rank (2; 4 and 8 need as many GPUs)")
            sp.add_argument("--bounds", choices=["decode", "none"], default="decode",
                            help="sequence bounds handed to the merge: decode (as the engine passes them: one "
                                 "row per sequence, local KV lengths) or none (nothing to mask)")
            sp.add_argument("--profile-eager", type=int, nargs="*", default=[], metavar="T",
                            help="also profile 20 eager calls of each order at these token counts "
                                 "(torch.profiler tables in OUT/profile/, host us per call in merge.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if getattr(ns, "vllm", "") is None:
            from overlay.pins import default_version

            ns.vllm = default_version(_root(ns))
        return ns.handler(ns)
    except OverlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
