"""``overlay kernel-sources``, ``kernel-toolchain`` and ``kernels``: the kernel build's sources offline,
its toolchain, and the build (``kernels build`` runs ``scripts/build-kernels.sh``, which calls
``kernels prepare`` and ``kernels order`` around CMake, then writes the wheel with the rebuilt targets)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, at_least, root

SOURCES_HELP = ("fill kernel-sources/<version>/ with a checkout of each FetchContent source at its pin "
                "(placeholders for what TARGETS do not compile), from the pinned repositories or a mirror")
TOOLCHAIN_HELP = ("check the kernel build's prerequisites (cmake, a CUDA torch's config, the CUDA "
                  "libraries); --assemble makes them from PyPI where there is no CUDA toolkit")
KERNELS_HELP = ("rebuild the CUDA targets the series' kernel patches touch (scripts/build-kernels.sh), "
                "then the wheel with them; its steps prepare and order")
PREPARE_HELP = "kernel build step: check the toolchain and the sources, stage them at fixed paths, say MAX_JOBS"
ORDER_HELP = "kernel build step: put the targets' costliest compiles first in build.ninja"
SYNC_HELP = ("kernel build step: bring the fixed source tree up to date with a fresh extraction, in place "
             "(unchanged files keep their mtime, generated files stay)")


def _add_sources_dir(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--sources", default="kernel-sources", metavar="DIR",
                    help="the kernel-sources folder (default %(default)s; a release's sources in DIR/<version>/)")
    sp.add_argument("--targets", nargs="*", default=[], metavar="TARGET",
                    help="the extension targets to be built (default: every one: all sources real)")


def configure_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("kernel-sources", help=SOURCES_HELP, description=SOURCES_HELP)
    add_vllm(sp)
    _add_sources_dir(sp)
    sp.add_argument("--mirror", default="", metavar="TEMPLATE",
                    help="fetch from a mirror: a URL or folder with {owner}, {repo}, {name} "
                         "(e.g. https://git.example/{owner}/{repo}.git)")
    sp.add_argument("--remote", action="append", default=[], metavar="NAME=REPO",
                    help="one source's repository (a URL or a git folder), over --mirror")
    sp.add_argument("--exclude", action="append", default=[], metavar="NAME=PATH",
                    help="leave PATH out of NAME's checkout (a partial mirror lacks its blob)")
    sp.add_argument("--check", action="store_true", help="only verify the folder against the pins")
    sp.set_defaults(handler=cmd_kernel_sources)

    sp = sub.add_parser("kernel-toolchain", help=TOOLCHAIN_HELP, description=TOOLCHAIN_HELP)
    sp.add_argument("--assemble", action="store_true",
                    help="download the CUDA torch wheel and the nvidia-* libraries it pins, and make a "
                         "CUDA root of links over them and nvcc (<cache>/kernel-toolchain/)")
    sp.add_argument("--nvcc-root", default="/usr/local/cuda", help="where nvcc is (default %(default)s)")
    sp.set_defaults(handler=cmd_kernel_toolchain)

    kp = sub.add_parser("kernels", help=KERNELS_HELP, description=KERNELS_HELP)
    steps = kp.add_subparsers(dest="step", metavar="STEP", required=True)
    sp = steps.add_parser("build", help=KERNELS_HELP, description=KERNELS_HELP)
    add_vllm(sp)
    sp.add_argument("--out", required=True, help="the rebuilt targets, laid out as in the wheel")
    sp.add_argument("--sources", default="kernel-sources", metavar="DIR", help="the kernel-sources folder")
    sp.add_argument("--dist", default="dist", help="where the wheel is written (default %(default)s)")
    sp.set_defaults(handler=cmd_kernels_build)

    sp = steps.add_parser("prepare", help=PREPARE_HELP, description=PREPARE_HELP)
    _add_sources_dir(sp)
    sp.add_argument("--vllm", required=True)
    sp.add_argument("--src", required=True, help="the patched source tree (its CMake files decide)")
    sp.add_argument("--stage", required=True, metavar="DIR", help="where the sources are staged")
    sp.add_argument("--env-file", required=True, help="write NAME=value lines for the build here")
    sp.add_argument("--max-jobs", type=at_least(1), default=None, help="override the memory bound")
    sp.add_argument("--no-preflight", action="store_true", help="do not check the toolchain (a dry run)")
    sp.set_defaults(handler=cmd_kernel_prepare)

    sp = steps.add_parser("order", help=ORDER_HELP, description=ORDER_HELP)
    sp.add_argument("--build", required=True, help="the configured build folder")
    sp.add_argument("--targets", nargs="+", required=True, metavar="TARGET")
    sp.set_defaults(handler=cmd_kernel_order)

    sp = steps.add_parser("sync", help=SYNC_HELP, description=SYNC_HELP)
    sp.add_argument("--fresh", required=True, help="the new extraction (the sdist with the series applied)")
    sp.add_argument("--tree", required=True, help="the fixed source tree the build reads")
    sp.set_defaults(handler=cmd_kernel_sync)


def _pairs(items: list[str], option: str) -> dict[str, list[str]]:
    from overlay.errors import UsageError

    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"{option} {item!r}: expected NAME=VALUE")
        out.setdefault(name, []).append(value)
    return out


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_kernel_sources(ns: argparse.Namespace) -> int:
    from overlay.build.pins import load_pin, pin_dir
    from overlay.build.sdist import fetch_sdist, read_sources
    from overlay.kernels import sources
    from overlay.kernels.targets import is_cmake_source

    pin = load_pin(root(ns), ns.vllm)
    sdist = fetch_sdist(pin, str(pin_dir(root(ns), ns.vllm) / "pin.toml"))
    decisions = sources.plan(read_sources(sdist, is_cmake_source), ns.targets)
    folder = Path(ns.sources) / pin.version
    if ns.check:
        entries = sources.verify(folder, decisions)
    else:
        remotes = {k: v[-1] for k, v in _pairs(ns.remote, "--remote").items()}
        entries = sources.fill(folder, decisions, mirror=ns.mirror or None, remotes=remotes,
                               exclude=_pairs(ns.exclude, "--exclude"), log=_log)
    for e in entries:
        print(f"{e.name:16} {e.kind:11} {(e.commit or '-')[:12]:12} {e.why}")
    print(f"kernel-sources: {folder}: {sum(e.kind == 'real' for e in entries)} real, "
          f"{sum(e.kind == 'placeholder' for e in entries)} placeholder(s), verified against vllm {pin.version}'s pins")
    return 0


def cmd_kernel_toolchain(ns: argparse.Namespace) -> int:
    from overlay.kernels import toolchain

    if ns.assemble:
        tc = toolchain.assemble(toolchain.pinned_torch(), nvcc_root=Path(ns.nvcc_root))
    else:
        tc = toolchain.found(os.environ.get("CUDA_HOME"), os.environ.get("Torch_DIR"))
    toolchain.preflight(tc)
    for k, v in tc.env().items():
        print(f"{k}={v}")
    return 0


def cmd_kernels_build(ns: argparse.Namespace) -> int:
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "build-kernels.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the venv's cmake, ninja
    proc = subprocess.run(["bash", str(script), "--vllm", ns.vllm, "--patches", str(root(ns)), "--sources",
                           ns.sources, "--out", ns.out], env=env, check=False)
    if proc.returncode != 0:
        return proc.returncode
    from overlay.build.pipeline import build
    from overlay.kernels.targets import collect_kernels

    result = build(root(ns), ns.vllm, Path(ns.dist), kernels=collect_kernels(Path(ns.out)))
    print(f"built {result.wheel} ({result.version}, {result.patches} patch(es), rebuilt "
          f"{', '.join(sorted(collect_kernels(Path(ns.out))))})", file=sys.stderr)
    print(result.wheel)
    return 0


def cmd_kernel_prepare(ns: argparse.Namespace) -> int:
    from overlay.atomic import write_file
    from overlay.kernels import order, sources, toolchain

    tc = toolchain.found(os.environ.get("CUDA_HOME"), os.environ.get("Torch_DIR"))
    if not ns.no_preflight:
        toolchain.preflight(tc)
    folder = Path(ns.sources) / ns.vllm
    source_lines = ["FETCHCONTENT_FULLY_DISCONNECTED=OFF"]
    if folder.is_dir():
        decisions = sources.plan(sources.read_cmake_files(Path(ns.src)), ns.targets)
        entries = sources.verify(folder, decisions)
        staged = sources.stage(entries, Path(ns.stage))
        for e in entries:
            _log(f"build-kernels: source {e.name}: {e.kind}"
                 + (f" at {e.commit[:12]}" if e.commit else "") + f" ({e.why})")
        source_lines = ["FETCHCONTENT_FULLY_DISCONNECTED=ON", *sources.env_lines(decisions, staged)]
    else:
        _log(f"build-kernels: no {folder}: configure fetches the external sources from their pinned "
             "repositories (network); `make kernel-sources` makes the build offline")
    if ns.max_jobs:
        jobs, why = ns.max_jobs, f"MAX_JOBS={ns.max_jobs} (given)"
    else:
        jobs, why = order.job_bound()
    _log(f"build-kernels: {why}")
    lines = [*source_lines, *(f"{k}={v}" for k, v in tc.env().items()),
             f"MAX_JOBS={jobs}", f"CMAKE={tc.cmake}"]
    write_file(Path(ns.env_file), "".join(f"{line}\n" for line in lines))
    return 0


def cmd_kernel_order(ns: argparse.Namespace) -> int:
    from overlay.atomic import write_file
    from overlay.kernels import order

    manifest = Path(ns.build) / "build.ninja"
    durations = order.read_ninja_log(Path(ns.build))
    text, ordered = order.reorder_manifest(manifest.read_text(), tuple(ns.targets), durations)
    if not ordered:
        _log(f"build-kernels: {manifest}: no compile statement of {' '.join(ns.targets)}; order left as it is")
        return 0
    write_file(manifest, text)
    basis = "the last build's .ninja_log" if durations else "the measured table (overlay/kernels/order.py)"
    _log(f"build-kernels: {len(ordered)} compiles, costliest first by {basis}: "
         + ", ".join(Path(s).name for s in ordered[:4]) + ", ...")
    return 0


def cmd_kernel_sync(ns: argparse.Namespace) -> int:
    from overlay.kernels.srctree import sync_tree

    result = sync_tree(Path(ns.fresh), Path(ns.tree))
    _log(f"build-kernels: source tree {ns.tree}: {result.summary()}")
    return 0
