"""``overlay build``: the patched wheel from the pinned base wheel and the series, installed on request."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from overlay.commands.common import add_vllm, root

HELP = "fetch + verify the base wheel, apply the series, write and install the wheel"


def configure_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("build", help=HELP, description=HELP)
    add_vllm(sp)
    sp.add_argument("--dist", default="dist")
    sp.add_argument("--install", metavar="VENV", help="install the wheel into this environment")
    sp.add_argument("--no-deps", action="store_true", help="install only the wheel")
    sp.add_argument("--base-wheel", help="use this verified base wheel instead of fetching")
    sp.add_argument("--kernels", metavar="DIR", help="rebuilt kernel .so files (make image)")
    sp.set_defaults(handler=cmd_build)


def cmd_build(ns: argparse.Namespace) -> int:
    from overlay.build.install import install, torch_mismatch
    from overlay.build.pipeline import build

    kernels = None
    if ns.kernels:
        from overlay.kernels.targets import collect_kernels

        kernels = collect_kernels(Path(ns.kernels))
    result = build(root(ns), ns.vllm, Path(ns.dist),
                   base_wheel=Path(ns.base_wheel) if ns.base_wheel else None, kernels=kernels)
    print(f"built {result.wheel} ({result.version}, {result.patches} patch(es), {result.seconds:.2f} s)",
          file=sys.stderr)
    why_not = torch_mismatch(result.wheel, Path(ns.install)) if ns.install else None
    if why_not:
        print(f"not installed into {ns.install}: {why_not}; install it into its own environment "
              f"(`make build VLLM=<release>` uses .venv-<release> for a release that is not the default) "
              f"or on a GPU machine with `pip install {result.wheel}`", file=sys.stderr)
    elif ns.install:
        t0 = time.perf_counter()
        done = install(result.wheel, Path(ns.install), with_deps=not ns.no_deps)
        how = {"incremental": f"changed files only, {done.written} written", "pip": "pip",
               "unchanged": "already installed"}[done.how]
        print(f"installed {result.version} into {ns.install} ({how}, {time.perf_counter() - t0:.2f} s)",
              file=sys.stderr)
    print(result.wheel)
    return 0
