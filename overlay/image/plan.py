"""``make image``: plan and build the Docker image over the official vLLM image.

The plan follows the patch kinds. A series of ``python`` patches only needs the wheel that
``make build`` writes: the runtime stage installs it over the base image's vLLM. A series with
``kernel`` patches adds the kernel stage: the pinned source distribution (sha256-verified), the
series applied, and only the CMake extension targets that compile the touched sources rebuilt;
the overlay build then writes those ``.so`` files into the wheel.

Which targets a touched source belongs to is read from the release's own CMake files
(:mod:`overlay.kernels.targets`). The plan and its build arguments are the same for every container
engine; :mod:`overlay.image.containers` picks the engine and turns the plan into its commands.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from overlay.build.pins import Pin, load_pin, pin_dir
from overlay.build.series import Series
from overlay.errors import OverlayError
from overlay.image.containers import Engine, describe
from overlay.kernels.targets import KernelTargets, is_cmake_source, read_kernel_map, resolve_targets

DOCKERFILE = "docker/Dockerfile"
BASE_IMAGE = "docker.io/vllm/vllm-openai"
DEFAULT_IMAGE = "vllm-overlay"
DEFAULT_ARCH = "9.0a"  # H100 / H200
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ARCH = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")
_IMAGE = re.compile(r"^[a-z0-9]+(?:[._/:-][a-z0-9]+)*$")


class ImageError(OverlayError):
    """The image cannot be planned or built (no engine, bad argument, unknown target)."""


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    """Everything ``docker build`` is given, computed from the pin and the series."""

    version: str
    tag: str
    overlay_version: str
    wheel: str  # path of the wheel the runtime stage installs, relative to the context
    kernel_patches: tuple[str, ...]
    kernels: KernelTargets | None
    arch_list: str
    max_jobs: str
    nvcc_threads: str
    base_digest: str
    image_tags: tuple[str, ...]
    push: bool
    patches: tuple[str, ...] = ()  # the series, in order (the image's vllm-overlay.patches label)
    base_image: str = BASE_IMAGE  # the base's repository (make image-smoke: its CPU stand-in)

    @property
    def stages(self) -> tuple[str, ...]:
        if self.kernel_patches:
            return ("base", "kernel-build", "wheel-kernels", "runtime")
        return ("base", "wheel-dist", "runtime")

    @property
    def base_ref(self) -> str:
        ref = f"{self.base_image}:v{self.version}"
        return f"{ref}@{self.base_digest}" if self.base_digest else ref

    def build_args(self) -> dict[str, str]:
        args = {
            "BASE_IMAGE": self.base_image,
            "VLLM_VERSION": self.version,
            "BASE_DIGEST": self.base_digest,
            "OVERLAY_VERSION": self.overlay_version,
            "SERIES_TAG": self.tag,
            "WHEEL_SOURCE": "kernels" if self.kernel_patches else "dist",
            "WHEEL": self.wheel,
            "PATCHES": " ".join(self.patches),
        }
        if self.kernel_patches:
            args.update(TORCH_CUDA_ARCH_LIST=self.arch_list, MAX_JOBS=self.max_jobs,
                        NVCC_THREADS=self.nvcc_threads)
        return args

    def commands(self, engine: Engine) -> list[list[str]]:
        """The engine's build command, then its pushes (if any)."""
        build = engine.build_command(dockerfile=DOCKERFILE, context=".", target="runtime",
                                     build_args=self.build_args(), tags=self.image_tags, push=self.push,
                                     ignorefile=f"{DOCKERFILE}.dockerignore")
        return [build, *(engine.push_commands(self.image_tags) if self.push else [])]


def plan_image(
    patches_root: Path,
    version: str,
    *,
    dist: Path = Path("dist"),
    image: str = DEFAULT_IMAGE,
    extra_tags: tuple[str, ...] = (),
    arch_list: str = DEFAULT_ARCH,
    max_jobs: str = "",
    nvcc_threads: str = "",
    base_digest: str = "",
    push: bool = False,
    base_image: str = BASE_IMAGE,
    cmake_files: Callable[[Pin, str], Mapping[str, str]] | None = None,
) -> Plan:
    """Compute the image plan. ``cmake_files(pin, source)`` supplies the release's CMake files
    (default: read from the verified sdist) and is only called for a series with kernel patches."""
    from overlay.build.pipeline import series_wheel

    problems: list[str] = []
    if base_digest and not _DIGEST.match(base_digest):
        problems.append(f"BASE_DIGEST {base_digest!r} is not 'sha256:' and 64 lowercase hex digits")
    archs = arch_list.replace(";", " ").split()
    if not archs or not all(_ARCH.match(a) for a in archs):
        problems.append(f"TORCH_CUDA_ARCH_LIST {arch_list!r} is not a list like '9.0a' or '9.0a 10.0a'")
    for name, value in (("MAX_JOBS", max_jobs), ("NVCC_THREADS", nvcc_threads)):
        if value and not (value.isdigit() and int(value) > 0):
            problems.append(f"{name} {value!r} is not a positive integer")
    if not _IMAGE.match(image):
        problems.append(f"IMAGE {image!r} is not a valid image name")
    if not _IMAGE.match(base_image):
        problems.append(f"BASE_IMAGE {base_image!r} is not a valid image name")
    if problems:
        raise ImageError("; ".join(problems))

    target = series_wheel(patches_root, version)
    pin, series, tag, overlay_version = target.pin, target.series, target.tag, target.version
    kernel_patches = tuple(p.name for p in series.kernel_patches)
    kernels = None
    if kernel_patches:
        source = str(pin_dir(patches_root, version) / "pin.toml")
        files = (cmake_files or sdist_cmake_files)(pin, source)
        kernels = resolve_targets(series.kernel_touched, read_kernel_map(files))
        wheel = "dist/" + target.filename  # written inside the kernel stage
    else:
        wheel = (dist / target.filename).as_posix()
    ref = f"{image}:{overlay_version.replace('+', '-')}"
    return Plan(
        version=pin.version, tag=tag, overlay_version=overlay_version, wheel=wheel,
        kernel_patches=kernel_patches, kernels=kernels, arch_list=" ".join(archs),
        max_jobs=max_jobs, nvcc_threads=nvcc_threads, base_digest=base_digest,
        image_tags=(ref, *extra_tags), push=push, patches=tuple(p.name for p in series.patches),
        base_image=base_image,
    )


def sdist_cmake_files(pin: Pin, source: str) -> dict[str, str]:
    """The release's CMake files, read from its verified sdist (fetched into the cache if needed)."""
    from overlay.build.sdist import fetch_sdist, read_sources

    return read_sources(fetch_sdist(pin, source), is_cmake_source)


def format_plan(plan: Plan, engine: Engine) -> str:
    """The plan for a person, one fact a line, with ``engine``'s commands."""
    lines = [
        f"image plan for vllm {plan.version} + series {plan.tag} ({plan.overlay_version})",
        f"  base:     {plan.base_ref}",
        f"  stages:   {' -> '.join(plan.stages)}",
        f"  wheel:    {plan.wheel}"
        + (" (written in the kernel stage)" if plan.kernel_patches else " (from `make build`)"),
    ]
    if plan.kernels is None:
        lines.append("  kernels:  none (python patches only: the base image's kernels are kept)")
    else:
        lines.append(f"  kernels:  rebuilt for {len(plan.kernel_patches)} kernel patch(es): "
                     + ", ".join(plan.kernel_patches))
        lines.append(f"  targets:  {' '.join(plan.kernels.targets)}")
        for path, ts, why in plan.kernels.reasons:
            lines.append(f"            {path} -> {' '.join(ts)} ({why})")
        lines.append(f"  arch:     TORCH_CUDA_ARCH_LIST={plan.arch_list!r}")
        lines.append(f"  jobs:     MAX_JOBS={plan.max_jobs or '(nproc)'} "
                     f"NVCC_THREADS={plan.nvcc_threads or '(default)'}")
    lines.append(f"  tags:     {' '.join(plan.image_tags)}" + (" (pushed)" if plan.push else ""))
    lines.append(f"  engine:   {describe(engine)}")
    lines += ["  command:  " + " ".join(_quote(a) for a in cmd) for cmd in plan.commands(engine)]
    return "\n".join(lines) + "\n"


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[A-Za-z0-9_./:=+@-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------- running it

def build_image(plan: Plan, patches_root: Path, dist: Path, engine: Engine) -> subprocess.CompletedProcess[str]:
    """Build ``plan`` with ``engine`` (writing the dist wheel first for a python-only series), then
    push. The engine's output is shown as it comes and returned, with the first failing exit status."""
    if not plan.kernel_patches:
        from overlay.build.pipeline import build

        build(patches_root, plan.version, dist)
    print(format_plan(plan, engine), end="", file=sys.stderr, flush=True)
    proc = subprocess.CompletedProcess([], 0, "", None)
    for cmd in plan.commands(engine):
        proc = engine.call(cmd, tee=True)
        if proc.returncode != 0:
            break
    return proc


# --------------------------------------------------------------------------- the kernel stage

def prepare_kernel_source(patches_root: Path, version: str, dest: Path) -> KernelTargets:
    """Fetch + verify the sdist, unpack it into ``dest``, apply the whole series, and return the
    targets to rebuild (read from the patched tree's CMake files)."""
    from overlay.build.apply import apply_series
    from overlay.build.sdist import extract, fetch_sdist

    pin = load_pin(patches_root, version)
    series = Series.load(pin_dir(patches_root, version))
    if not series.kernel_patches:
        raise ImageError(f"{series.series_file}: has no kernel patch; the kernel stage has nothing to build")
    sdist = fetch_sdist(pin, str(pin_dir(patches_root, version) / "pin.toml"))
    extract(sdist, dest)

    def read(path: str) -> bytes | None:
        p = dest / path
        return p.read_bytes() if p.is_file() else None

    applied = apply_series(series.patches, read, label=f"vllm {pin.version} sdist")
    for path, data in applied.changed.items():
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    for path in applied.deleted:
        (dest / path).unlink(missing_ok=True)
    # Only CMakeLists.txt and cmake/**/*.cmake (is_cmake_source): no walk of the whole source tree.
    candidates = [dest / "CMakeLists.txt", *(dest / "cmake").rglob("*.cmake")]
    files = {
        rel: (dest / rel).read_text(errors="replace")
        for rel in (p.relative_to(dest).as_posix() for p in candidates if p.is_file())
        if is_cmake_source(rel)
    }
    return resolve_targets(series.kernel_touched, read_kernel_map(files))

