"""``make device-stage``: everything vLLM's engine needs on the GPU device machine, in carries.

The device machine (docs/ARCHITECTURE.md, "How the patched vLLM is tested without the real model") has
Python 3.12, torch 2.11, Triton 3.6 and the packages listed in ``scripts/device-packages.txt``,
but no vLLM and no network; one call to it brings at most ``settings.CALL_LIMIT``, repository
included. This module stages, from the patched wheel that ``make build`` wrote:

- vLLM's Python tree with its dist-info (one deterministic ``.tar.xz``, without the members
  ``settings.LEFT_OUT`` leaves home and without the compiled libraries),
- the compiled kernels the device can use, one ``.xz`` each (``settings.KEEP_KERNELS``; every
  other library is listed in the manifest with the reason it was left out), each first judged
  against the device's torch (``torch_abi``: the release's torch pin, the kernels' shim symbols
  against the device torch's export list; a required kernel that cannot load there stops the
  staging with one line naming it, one of ``settings.OPTIONAL_KERNELS`` stays home),
- the Python wheels vLLM needs that the device lacks: vLLM's ``Requires-Dist`` (markers
  evaluated for CPython 3.12 on Linux x86_64, vLLM's extras not requested,
  ``settings.TORCH_FAMILY`` left out: the device's torch 2.11 is used on purpose, and
  ``settings.NOT_NEEDED`` unless ``--full``), resolved transitively by pip for that target with
  every device package pinned to its device version. A pin that makes the resolution impossible
  is dropped (the conflict is the reason, recorded) and the package is staged in the version the
  requirements force; a device package is never staged otherwise.

and packs them into carry folders ``.device/<name>/carry-NN/`` of at most ``settings.CARRY_LIMIT``
each (largest first; a larger file is split into ``.part-NN`` pieces), each with a copy of
``manifest.json`` (sha256 of every piece and file, the resolution log, the staged wheels).
``scripts/device-run.sh`` unpacks them on the device. Same inputs, same carries: sorted
orders, fixed xz settings, a tar with sorted names and fixed owner and mtime.

Device packages are pinned through stub wheels: for each one a metadata-only wheel
``<name>-<version>+device`` with no dependencies, and the constraint ``<name>==<version>+device``.
pip then treats them as present without fetching them (torch alone is 530 MB) or resolving
their own dependencies, which the device already satisfies (its torch needs an NCCL build that
is not on PyPI).

What travels and what stays home, each with why, is listed once, in ``overlay/device/settings.py``
(``tests/test_device_stage.py`` holds this docstring and ``docs/device/README.md`` to pointing there).

The package's rooms, in the order a run uses them: ``settings`` (the device's facts and what a
person may change), ``requirements``, ``resolve`` (pip through stub wheels), ``resolution_cache``,
``files`` (downloads, vLLM's tree and kernels), ``torch_abi`` (the kernels against the device's torch),
``carries`` and ``staging`` (the whole run).
"""

from __future__ import annotations

from overlay.device.carries import Piece, carry_limit, checkout_bytes, device_calls, pack, split_pieces, write_carries
from overlay.device.files import OTHER_LIBRARY, StagedFile, stage_vllm
from overlay.device.requirements import (
    device_requirements,
    is_stub,
    parse_conflict,
    pip_error_tail,
    read_device_packages,
    read_device_requires,
    wheel_requires_dist,
)
from overlay.device.resolution_cache import PIP_ENV_KEYS, load_resolution, resolution_key, save_resolution
from overlay.device.resolve import (
    PipOutcome,
    Resolution,
    ResolvedWheel,
    Resolver,
    find_resolver,
    is_pure_wheel,
    no_such_version,
    pip_runner,
    required_by,
    resolve,
    sdist_builder,
    stub_version,
    wheels_from_report,
    write_stub_wheel,
)
from overlay.device.settings import (
    CALL_LIMIT,
    CARRY_LIMIT,
    DEVICE_ENV,
    HARNESS_REQUIREMENTS,
    KEEP_KERNELS,
    LEFT_OUT,
    MIB,
    NOT_NEEDED,
    OPTIONAL_KERNELS,
    PLATFORMS,
    DeviceStageError,
    with_harness,
)
from overlay.device.staging import StageResult, built_wheel, format_summary, stage

__all__ = [
    "CALL_LIMIT",
    "CARRY_LIMIT",
    "DEVICE_ENV",
    "HARNESS_REQUIREMENTS",
    "KEEP_KERNELS",
    "LEFT_OUT",
    "MIB",
    "NOT_NEEDED",
    "OPTIONAL_KERNELS",
    "OTHER_LIBRARY",
    "PIP_ENV_KEYS",
    "PLATFORMS",
    "DeviceStageError",
    "Piece",
    "PipOutcome",
    "Resolution",
    "ResolvedWheel",
    "Resolver",
    "StageResult",
    "StagedFile",
    "built_wheel",
    "carry_limit",
    "checkout_bytes",
    "device_calls",
    "device_requirements",
    "find_resolver",
    "format_summary",
    "is_pure_wheel",
    "is_stub",
    "load_resolution",
    "no_such_version",
    "pack",
    "parse_conflict",
    "pip_error_tail",
    "pip_runner",
    "read_device_packages",
    "read_device_requires",
    "required_by",
    "resolution_key",
    "resolve",
    "save_resolution",
    "sdist_builder",
    "split_pieces",
    "stage",
    "stage_vllm",
    "stub_version",
    "wheel_requires_dist",
    "wheels_from_report",
    "with_harness",
    "write_carries",
    "write_stub_wheel",
]
