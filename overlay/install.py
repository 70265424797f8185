"""Install a built wheel into a virtual environment (``.venv`` by default).

On our CPU machines the environment holds the CPU build of torch 2.13.0, vLLM's other
requirements, and the wheel itself. PyPI's torchvision, torchaudio and torchcodec are CUDA
builds that break ``import vllm`` beside CPU torch (DESIGN.md, "Pins"), so they are left
out here; on a GPU machine the wheel installs with a plain ``pip install``.
"""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.metadata import parse_email
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from overlay.errors import OverlayError
from overlay.wheel import dist_info_name

# CUDA-only builds on PyPI that fail to import beside the CPU torch (DESIGN.md, "Pins").
CPU_SKIP = frozenset({"torchvision", "torchaudio", "torchcodec"})
TORCH_CPU = "torch==2.13.0"


class InstallError(OverlayError):
    """pip failed while installing into the environment."""


def _requires_dist(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` whose markers hold on this machine, extras left out."""
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_name(zf.infolist(), wheel)
        metadata = zf.read(f"{dist_info}/METADATA")
    raw, _ = parse_email(metadata)
    env = {**default_environment(), "extra": ""}
    reqs = map(Requirement, raw.get("requires_dist", []))
    return [req for req in reqs if req.marker is None or req.marker.evaluate(env)]


def requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` for this machine, without extras and without :data:`CPU_SKIP`."""
    return [str(req) for req in _requires_dist(wheel) if canonicalize_name(req.name) not in CPU_SKIP]


def cpu_installable(wheel: Path) -> str | None:
    """Why ``wheel`` cannot go into the CPU environment, or None when it can.

    Later releases pin a newer torch (0.33.0: torch 2.14.0, a CUDA build of several GB), which
    would replace the CPU torch 2.13.0 the environment and the tests are built on.
    """
    cpu = TORCH_CPU.split("==", 1)[1]
    for req in _requires_dist(wheel):
        if canonicalize_name(req.name) == "torch" and req.specifier and not req.specifier.contains(cpu):
            return f"it requires torch{req.specifier}, and this environment is built on CPU torch {cpu}"
    return None


def _pip(python: Path, args: list[str]) -> None:
    quiet = [] if sys.stderr.isatty() else ["-q"]
    proc = subprocess.run([str(python), "-m", "pip", *args, *quiet], check=False)
    if proc.returncode != 0:
        raise InstallError(f"pip {' '.join(args[:2])} ... failed ({proc.returncode}) in {python.parent.parent}")


def install(wheel: Path, env_dir: Path, *, with_deps: bool = True) -> Path:
    """Create ``env_dir`` when missing and install ``wheel`` (and its requirements) into it."""
    python = env_dir / "bin" / "python"
    if not python.exists():
        print(f"creating {env_dir} ...", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True).create(env_dir)
    if with_deps:
        print("installing requirements (torch CPU and vLLM's dependencies) ...", file=sys.stderr, flush=True)
        _pip(python, ["install", "--disable-pip-version-check", TORCH_CPU])
        _pip(python, ["install", "--disable-pip-version-check", TORCH_CPU, *requirements(wheel)])
    print(f"installing {wheel.name} ...", file=sys.stderr, flush=True)
    _pip(python, ["install", "--disable-pip-version-check", "--no-deps", "--force-reinstall", str(wheel)])
    return python
