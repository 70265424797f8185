"""``overlay device-stage``: the built wheel's tree, kernels and missing wheels as carries for the GPU device."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, between, folder_name, root

HELP = ("stage the built wheel's tree and kernels and the wheels vLLM needs for the GPU device "
        "machine into carries of <= 60 MiB, with the device calls to make")


def configure_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("device-stage", help=HELP, description=HELP)
    add_vllm(sp)
    sp.add_argument("--name", default="engine", type=folder_name("--dest"),
                    help="stage folder name, one folder inside --dest (default %(default)s)")
    sp.add_argument("--dest", default=".device", help="root of the stage folders, ignored by git "
                                                      "(default %(default)s)")
    sp.add_argument("--dist", default="dist")
    sp.add_argument("--wheel", help="the patched wheel (default: the one make build writes for the series)")
    sp.add_argument("--device-packages", default="scripts/device-packages.txt",
                    help="the device's pip freeze (default %(default)s)")
    sp.add_argument("--device-requires", default="scripts/device-requires.json",
                    help="what each device package requires, recorded on the device by scripts/device-requires.py "
                         "(default %(default)s)")
    sp.add_argument("--no-device-requires", action="store_true",
                    help="stub the device packages as versions only (for a --device-packages of another machine)")
    sp.add_argument("--limit-mib", type=between(1, 64, "MiB"), default=60,
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
    sp.set_defaults(handler=cmd_device_stage)


def cmd_device_stage(ns: argparse.Namespace) -> int:
    from overlay.build.pipeline import series_wheel
    from overlay.device import MIB, built_wheel, carry_limit, device_calls, format_summary, stage, with_harness
    from overlay.engine.liveness_lines import staged_lines

    release = series_wheel(root(ns), ns.vllm)  # the release, loaded once and handed down
    wheel = Path(ns.wheel) if ns.wheel else built_wheel(release, Path(ns.dist))
    dest = Path(ns.dest) / ns.name
    result = stage(wheel, dest, device_packages=Path(ns.device_packages), name=ns.name,
                   limit=carry_limit(Path.cwd(), int(ns.limit_mib * MIB)), resolver_python=ns.resolver_python,
                   full=ns.full, resolution_cache=not ns.no_resolution_cache, extras=with_harness(ns.extra),
                   beside=staged_lines(release, wheel) if wheel.is_file() else None,
                   device_requires=None if ns.no_device_requires else Path(ns.device_requires))
    print(format_summary(result.manifest), file=sys.stderr)
    print(device_calls(result.manifest, dest, ns.command))
    return 0
