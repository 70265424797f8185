"""The order and width of a kernel build: the longest translation units first, as many jobs as memory
allows.

Ninja starts, among the jobs that are ready, the one with the longest chain of jobs after it, and
among equals the one declared first in ``build.ninja``. Every object of an extension target has the
same chain (itself, then the link), so a fresh build starts the objects in CMake's source order: on
vLLM 0.28.0's ``_C_stable_libtorch`` the costliest unit (``scaled_mm_c2x.cu``, about 1,500 CPU-s of
11,400) starts 78th of 86 and the build waits on it at the end. :func:`reorder_manifest` moves the
target's compile statements to the front of ``build.ninja``, longest first, which changes only the
order (ninja resolves names after reading the whole file).

How long a unit takes comes from the build folder's ``.ninja_log`` when an earlier build ran there
(the real durations), else from :data:`MEASURED`: CPU seconds of vLLM 0.28.0's units measured one at a
time at ``TORCH_CUDA_ARCH_LIST=9.0a`` on a 2-vCPU x86_64 machine (nvcc 13.0), by source pattern.

:func:`job_bound`: the heavy CUTLASS sm90 units take up to 9.6 GB each, and longest-first runs them
side by side, so ``MAX_JOBS`` defaults to ``min(cpus, (available memory - 2 GiB) // 10 GiB)``, at
least 1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# (pattern on the source path, CPU seconds, peak resident GB): first match wins.
MEASURED: tuple[tuple[str, float, float], ...] = (
    (r"w8a8/cutlass/scaled_mm_c2x\.cu$", 1527.0, 5.6),
    (r"machete/generated/machete_mm_impl_part\d+\.cu$", 255.0, 9.6),
    (r"w8a8/cutlass/c3x/.*\.cu$", 298.0, 8.8),
    (r"cutlass/moe/grouped_mm_c3x_sm90\.cu$", 212.0, 7.7),
    (r"w4a8/.*\.cu$", 250.0, 9.0),
    (r"mamba/selective_scan_fwd\.cu$", 167.0, 0.8),
    (r"marlin/.*sm80_kernel_.*\.cu$", 148.0, 0.6),
    (r"(machete_prepack|q_gemm|hadacore).*\.cu$", 160.0, 1.0),
    (r"layernorm_kernels\.cu$", 47.0, 0.8),
    (r"cache_kernels\.cu$", 43.0, 0.5),
    (r"machete_mm_dispatch\.cu$", 40.0, 1.3),
    (r"\.cu$", 40.0, 1.0),
    (r"\.cpp$", 14.0, 0.4),
)
GIB = 1 << 30
RESERVE = 2 * GIB
PER_HEAVY_JOB = 10 * GIB


def measured_cost(source: str) -> float:
    for pattern, seconds, _gb in MEASURED:
        if re.search(pattern, source):
            return seconds
    return 10.0


CACHE_HIT_MAX_S = 5.0
"""A logged duration below this is a ccache hit (or a trivial unit): the measured table orders it."""


def read_ninja_log(build: Path) -> dict[str, float]:
    """``output -> seconds`` of the last run of each output in ``build/.ninja_log`` (v5/v6/v7)."""
    log = build / ".ninja_log"
    out: dict[str, float] = {}
    if not log.is_file():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit():
            out[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    return out


@dataclass
class _Block:
    lines: list[str]
    outputs: tuple[str, ...]


_BUILD = re.compile(r"^build (.+?)(?<!\$):")


def _blocks(text: str) -> list[_Block]:
    blocks: list[_Block] = []
    for line in text.splitlines(keepends=True):
        m = _BUILD.match(line)
        if m:
            outs = tuple(o.replace("$:", ":").replace("$ ", " ") for o in re.split(r"(?<!\$) ", m[1].split(" | ")[0]))
            blocks.append(_Block([line], outs))
        elif line.startswith((" ", "\t")) and blocks and blocks[-1].outputs:
            blocks[-1].lines.append(line)
        else:
            blocks.append(_Block([line], ()))
    return blocks


def object_source(output: str, target: str) -> str | None:
    """``csrc/x.cu`` for ``CMakeFiles/<target>.dir/csrc/x.cu.o``; ``None`` for other outputs."""
    prefix = f"CMakeFiles/{target}.dir/"
    if output.startswith(prefix) and output.endswith(".o"):
        return output[len(prefix):-2]
    return None


def reorder_manifest(text: str, targets: tuple[str, ...], durations: Mapping[str, float]) -> tuple[str, list[str]]:
    """``build.ninja`` with the targets' compile statements first, costliest first; and that order."""
    blocks = _blocks(text)
    objects: list[tuple[float, int, _Block, str]] = []
    rest: list[_Block] = []
    for i, b in enumerate(blocks):
        src = next((s for t in targets for s in [object_source(b.outputs[0], t)] if s), None) if b.outputs else None
        if src is None:
            rest.append(b)
            continue
        logged = durations.get(b.outputs[0], 0.0)
        # a ccache hit (0.3 s) says nothing about what the unit costs to compile
        cost = logged if logged >= CACHE_HIT_MAX_S else measured_cost(src)
        objects.append((-cost, i, b, src))
    if not objects:
        return text, []
    objects.sort(key=lambda x: (x[0], x[1]))
    # Before the first build statement: the header (rules include, variables) keeps its place.
    first = next((i for i, b in enumerate(rest) if b.outputs), len(rest))
    ordered = rest[:first] + [o[2] for o in objects] + rest[first:]
    return "".join(line for b in ordered for line in b.lines), [o[3] for o in objects]


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (or the machine's pages when it is not there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def job_bound(cpus: int | None = None, memory: int | None = None) -> tuple[int, str]:
    """The default ``MAX_JOBS`` and a line saying how it was chosen."""
    cpus = cpus or len(os.sched_getaffinity(0))
    memory = available_memory() if memory is None else memory
    by_memory = max(1, (memory - RESERVE) // PER_HEAVY_JOB)
    jobs = max(1, min(cpus, by_memory))
    return jobs, (f"MAX_JOBS={jobs}: min({cpus} CPUs, ({memory / GIB:.1f} GiB available - 2 GiB) / 10 GiB per "
                  f"heavy CUTLASS unit = {by_memory})")
