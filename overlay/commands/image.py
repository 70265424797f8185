"""``overlay image``: the production Docker image over the official vLLM image, and its kernel stage."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, root

HELP = "Docker image over the official vLLM image; kernels rebuilt only for kernel patches"


def configure_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("image", help=HELP, description=HELP)
    add_vllm(sp)
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
    sp.set_defaults(handler=cmd_image)


def cmd_image(ns: argparse.Namespace) -> int:
    from overlay.image import build_image, format_plan, plan_image, prepare_kernel_source

    if ns.kernel_source:
        kernels = prepare_kernel_source(root(ns), ns.vllm, Path(ns.kernel_source))
        for path, targets, why in kernels.reasons:
            print(f"{path} -> {' '.join(targets)} ({why})", file=sys.stderr)
        print("\n".join(kernels.targets))
        return 0
    plan = plan_image(
        root(ns), ns.vllm, dist=Path(ns.dist), image=ns.image, extra_tags=tuple(ns.tag),
        arch_list=ns.arch, max_jobs=ns.max_jobs, nvcc_threads=ns.nvcc_threads,
        base_digest=ns.base_digest, push=ns.push,
    )
    if ns.dry_run:
        sys.stdout.write(format_plan(plan))
        return 0
    return build_image(plan, root(ns), Path(ns.dist))
