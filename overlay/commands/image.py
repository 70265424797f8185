"""``overlay image`` (the production image over the official vLLM image, and its kernel stage) and ``image-smoke``."""

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
    _engine_options(sp)
    sp.set_defaults(handler=cmd_image)

    text = ("build our image on a CPU stand-in of the official base (Debian + PyPI), run it, check "
            "version, dist-info, every patch's lines, the CLI, the entrypoint and labels")
    sp = sub.add_parser("image-smoke", help=text, description=text)
    add_vllm(sp)
    _engine_options(sp)
    sp.add_argument("--dist", default="dist")
    sp.add_argument("--negative", default="", choices=["", "version", "patch"],
                    help="build a wrong image on purpose (a wrong version, the series less its last "
                         "patch): the smoke must fail")
    sp.add_argument("--keep", action="store_true", help="keep the smoke image (default: removed)")
    sp.add_argument("--torch", default="", metavar="WHEEL",
                    help="the stand-in's torch wheel file (default: what pip resolves for vLLM's pin)")
    sp.add_argument("--preflight", action="store_true",
                    help="only say whether the smoke can run here (an engine, mmdebstrap): exit 0 or 1")
    sp.set_defaults(handler=cmd_image_smoke)


def _engine_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--engine", default="", choices=["", "docker", "podman", "buildah"],
                    help="container engine (default: the first usable of docker, podman, buildah)")
    sp.add_argument("--sandbox", default="auto", choices=["auto", "1", "0"],
                    help="podman/buildah flags for a machine without systemd (auto: when it is not running)")


def cmd_image(ns: argparse.Namespace) -> int:
    from overlay.image.containers import Engine, sandbox_wanted, select_engine
    from overlay.image.plan import build_image, format_plan, plan_image, prepare_kernel_source

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
    if ns.dry_run:  # probes no engine: the command of ENGINE (default docker)
        name = ns.engine or "docker"
        sys.stdout.write(format_plan(plan, Engine(name, name, sandbox=sandbox_wanted(ns.sandbox))))
        return 0
    engine = select_engine(ns.engine, sandbox=ns.sandbox)
    return build_image(plan, root(ns), Path(ns.dist), engine).returncode


def cmd_image_smoke(ns: argparse.Namespace) -> int:
    from overlay.image.containers import select_engine, smoke_store
    from overlay.image.smoke import preflight, smoke

    engine = select_engine(ns.engine, sandbox=ns.sandbox, store=smoke_store())
    if ns.preflight:
        print(preflight(engine))
        return 0
    for line in smoke(root(ns), ns.vllm, engine=engine, repo=Path.cwd(), dist=Path(ns.dist),
                      negative=ns.negative, keep=ns.keep, torch=ns.torch):
        print(line)
    return 0
