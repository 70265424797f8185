"""The CUDA toolchain a kernel build needs, checked before anything compiles, and assembled from PyPI
where the machine has no CUDA toolkit.

vLLM's configure needs CMake >= 3.26, torch's CMake config files of a *CUDA* build of the pinned
torch (``Torch_DIR``: the Python that runs CMake may keep a CPU torch), and a CUDA root with nvcc
and the libraries torch's config and CUTLASS link against: cublas, curand, cufft, nvrtc, and
``libcuda`` (CUTLASS calls ``cuTensorMapEncodeTiled`` directly, so the link needs the driver or the
toolkit's ``lib64/stubs/libcuda.so``, whose soname ``libcuda.so.1`` the library then records as
``NEEDED``). :func:`preflight` names the first missing piece in one line.

A machine with nvcc but without the libraries (a CPU build machine) gets them from PyPI with
:func:`assemble`: the CUDA wheel of the pinned torch (``pip download --isolated``: a local
find-links folder would offer the ``+cpu`` build), the ``nvidia-*`` wheels its
``cuda-toolkit[...]`` requirement names, and a CUDA root of links over them with a ``libcuda``
stub built from ``cuda.h``. Everything lands under ``<cache>/kernel-toolchain/`` at fixed paths,
so two builds on one machine run the same compile commands (what ccache needs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from overlay.atomic import child_tmpdir, temp_dir
from overlay.build.fetch import cache_dir
from overlay.errors import OverlayError

MIN_CMAKE = (3, 26)
# The CUDA libraries configure or the link of the extension targets look for (lib<name>.so).
CUDA_LIBRARIES = ("cudart", "cublas", "cublasLt", "curand", "cufft", "nvrtc")
# The cuda-toolkit extras the CUDA root is assembled from (the torch wheel pins their versions).
TOOLKIT_EXTRAS = ("cublas", "cudart", "cufft", "curand", "cusolver", "cusparse", "nvjitlink", "nvrtc")


class ToolchainError(OverlayError):
    """A prerequisite of the kernel build is missing or too old."""


@dataclass(frozen=True)
class Toolchain:
    """Where a kernel build finds CMake, nvcc and the CUDA libraries, and torch's CMake config."""

    cmake: str
    cuda_home: Path
    torch_dir: Path  # holds TorchConfig.cmake

    @property
    def torch_lib(self) -> Path:
        return self.torch_dir.parents[2] / "lib"

    def env(self) -> dict[str, str]:
        """The environment variables the build script exports."""
        return {
            "CUDA_HOME": str(self.cuda_home),
            "CUDACXX": str(self.cuda_home / "bin" / "nvcc"),
            "Torch_DIR": str(self.torch_dir),
            "Caffe2_DIR": str(self.torch_dir.parent / "Caffe2"),
        }


def toolchain_root(torch_version: str, cache: Path | None = None) -> Path:
    """``<cache>/kernel-toolchain/torch-<version>``: one fixed place per torch release."""
    return (cache or cache_dir()) / "kernel-toolchain" / f"torch-{torch_version}"


def cmake_version(cmake: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        raise ToolchainError(f"cmake not found ({cmake}): install cmake>=3.26 (pip install cmake)") from None
    m = re.search(r"cmake version (\d+)\.(\d+)(?:\.(\d+))?", out)
    if not m:
        raise ToolchainError(f"{cmake} --version printed no version: {out.strip()[:80]!r}")
    return tuple(int(x) for x in m.groups(default="0"))


def _has_library(cuda_home: Path, name: str) -> bool:
    return any((cuda_home / d / f"lib{name}.so").exists() for d in ("lib64", "lib", "targets/x86_64-linux/lib"))


def preflight(tc: Toolchain) -> None:
    """One line naming the first prerequisite the kernel build lacks; nothing when all are there."""
    version = cmake_version(tc.cmake)
    if version[:2] < MIN_CMAKE:
        raise ToolchainError(
            f"{tc.cmake} is cmake {'.'.join(map(str, version))}; vLLM's configure needs >= "
            f"{'.'.join(map(str, MIN_CMAKE))} (pip install 'cmake>=3.26')")
    config = tc.torch_dir / "TorchConfig.cmake"
    if not config.is_file():
        raise ToolchainError(f"Torch_DIR={tc.torch_dir}: no TorchConfig.cmake (point it at a torch wheel's "
                             "share/cmake/Torch, or run `make kernel-toolchain`)")
    if not (tc.torch_lib / "libtorch_cuda.so").exists():
        raise ToolchainError(f"Torch_DIR={tc.torch_dir}: torch there is not a CUDA build (no "
                             f"{tc.torch_lib / 'libtorch_cuda.so'}); the kernels need a CUDA torch's config")
    nvcc = tc.cuda_home / "bin" / "nvcc"
    if not os.access(nvcc, os.X_OK):
        raise ToolchainError(f"CUDA_HOME={tc.cuda_home}: no nvcc at {nvcc}")
    for lib in CUDA_LIBRARIES:
        if not _has_library(tc.cuda_home, lib):
            raise ToolchainError(f"CUDA_HOME={tc.cuda_home}: no lib{lib}.so in lib64/ (a CUDA library the "
                                 "kernels link against; `make kernel-toolchain` assembles them from PyPI)")
    if not (_has_library(tc.cuda_home, "cuda") or (tc.cuda_home / "lib64" / "stubs" / "libcuda.so").exists()):
        raise ToolchainError(f"CUDA_HOME={tc.cuda_home}: neither libcuda.so nor lib64/stubs/libcuda.so "
                             "(CUTLASS calls the driver API directly; the link needs one of them)")


def found(cuda_home: str | None, torch_dir: str | None, cmake: str | None = None) -> Toolchain:
    """The toolchain the environment names (``CUDA_HOME``, ``Torch_DIR``); else the one
    :func:`assemble` made for the pinned torch, when it is there; else this environment's torch
    (when it is a CUDA build) and ``/usr/local/cuda`` (a CUDA image)."""
    assembled = toolchain_root(pinned_torch())
    if not cuda_home:
        cuda_home = str(assembled / "cuda") if (assembled / "COMPLETE").exists() else "/usr/local/cuda"
    if not torch_dir:
        installed = _installed_torch_dir()
        if (assembled / "COMPLETE").exists() or installed is None:
            torch_dir = str(assembled / "torch" / "share" / "cmake" / "Torch")
        else:
            torch_dir = str(installed)
    return Toolchain(cmake=cmake or shutil.which("cmake") or "cmake", cuda_home=Path(cuda_home),
                     torch_dir=Path(torch_dir))


def _installed_torch_dir() -> Path | None:
    """``share/cmake/Torch`` of this environment's torch when it is a CUDA build (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent
    return root / "share" / "cmake" / "Torch" if (root / "lib" / "libtorch_cuda.so").exists() else None


def pinned_torch() -> str:
    """The torch release of the running environment (the one vLLM's pin needs), without importing it."""
    from importlib import metadata

    try:
        return metadata.version("torch").split("+", 1)[0]
    except metadata.PackageNotFoundError:
        raise ToolchainError("torch is not installed in this environment; the kernel toolchain follows "
                             "its release (make's .venv has it)") from None


# ----------------------------------------------------------------------------- assemble from PyPI

def _pip_download(requirements: list[str], dest: Path, *, deps: bool) -> None:
    # --isolated: no config file, so no local find-links folder offering torch's +cpu build and no cap.
    cmd = [sys.executable, "-m", "pip", "download", "--isolated", "--only-binary=:all:",
           "--index-url", os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"), "-d", str(dest)]
    if not deps:
        cmd.append("--no-deps")
    print(f"kernel-toolchain: pip download {' '.join(requirements)} ...", file=sys.stderr, flush=True)
    with child_tmpdir() as env:
        proc = subprocess.run([*cmd, *requirements], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, check=False, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
        raise ToolchainError(f"pip download {' '.join(requirements)} failed: {lines[0] if lines else proc.returncode}")


def toolkit_requirement(torch_wheel: Path) -> str:
    """The ``cuda-toolkit==X`` version the CUDA torch wheel requires, with our extras."""
    with zipfile.ZipFile(torch_wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    m = re.search(r"^Requires-Dist: cuda-toolkit\[[^\]]*\]\s*==\s*([\w.]+)", text, re.M)
    if not m:
        raise ToolchainError(f"{torch_wheel.name}: requires no cuda-toolkit (not a CUDA build of torch)")
    return f"cuda-toolkit[{','.join(TOOLKIT_EXTRAS)}]=={m[1]}"


def _unzip(wheel: Path, dest: Path, prefixes: tuple[str, ...]) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(prefixes) and not name.endswith("/"):
                zf.extract(name, dest)


def libcuda_stub_source(cuda_h: str) -> str:
    """C source of a ``libcuda.so`` stub: every driver entry point ``cuda.h`` declares, empty."""
    names = set(re.findall(r"CUDAAPI\s+(cu[A-Za-z0-9_]+)\s*\(", cuda_h))
    for a, b in re.findall(r"#define\s+(cu[A-Za-z0-9_]+)\s+(cu[A-Za-z0-9_]+)\b", cuda_h):
        names |= {a, b}
    return "".join(f"void {n}(void) {{}}\n" for n in sorted(names))


def make_cuda_root(dest: Path, nvcc_root: Path, site: Path) -> None:
    """A CUDA root of links: ``nvcc_root`` (nvcc, cudart, cccl) and the wheels' ``nvidia/cu*/``."""
    (dest / "lib64" / "stubs").mkdir(parents=True)
    (dest / "include").mkdir()
    for d in ("bin", "nvvm"):
        (dest / d).symlink_to(nvcc_root / d)
    libdirs = [nvcc_root / "lib64", *sorted(site.glob("nvidia/cu*/lib"))]
    incdirs = [nvcc_root / "include", *sorted(site.glob("nvidia/cu*/include"))]
    for src_dir, out in [(d, dest / "include") for d in incdirs] + [(d, dest / "lib64") for d in libdirs]:
        for f in sorted(src_dir.iterdir()):
            if not (out / f.name).exists():  # relative inside the toolchain, which is moved into place
                real = f.resolve()
                inside = real.is_relative_to(dest.parent.resolve())
                (out / f.name).symlink_to(os.path.relpath(real, out.resolve()) if inside else real)
    for f in sorted((dest / "lib64").glob("*.so.*")):  # the wheels ship only lib<x>.so.N
        plain = dest / "lib64" / (f.name.split(".so.", 1)[0] + ".so")
        if not plain.exists():
            plain.symlink_to(f.name)
    stub_c = dest / "lib64" / "stubs" / "cuda_stub.c"
    stub_c.write_text(libcuda_stub_source((nvcc_root / "include" / "cuda.h").read_text(errors="replace")))
    subprocess.run(["gcc", "-shared", "-fPIC", "-w", str(stub_c), "-Wl,-soname,libcuda.so.1",
                    "-o", str(dest / "lib64" / "stubs" / "libcuda.so")], check=True)
    (dest / "lib").symlink_to("lib64")
    target = dest / "targets" / "x86_64-linux"
    target.mkdir(parents=True)
    (target / "include").symlink_to("../../include")
    (target / "lib").symlink_to("../../lib64")


def assemble(torch_version: str, *, nvcc_root: Path = Path("/usr/local/cuda"), cache: Path | None = None,
             wheels: Path | None = None) -> Toolchain:
    """Make ``<cache>/kernel-toolchain/torch-<version>/`` (torch/, nvidia/, cuda/) once; the toolchain."""
    root = toolchain_root(torch_version, cache)
    tc = Toolchain(cmake=shutil.which("cmake") or "cmake", cuda_home=root / "cuda",
                   torch_dir=root / "torch" / "share" / "cmake" / "Torch")
    if (root / "COMPLETE").exists():
        return tc
    if not os.access(nvcc_root / "bin" / "nvcc", os.X_OK):
        raise ToolchainError(f"{nvcc_root}: no bin/nvcc (install the CUDA compiler, or set CUDA_HOME to a toolkit)")
    wheels = wheels or (cache or cache_dir()) / "kernel-toolchain" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    torch_wheel = next(iter(sorted(wheels.glob(f"torch-{torch_version}-*.whl"))), None)
    if torch_wheel is None:
        _pip_download([f"torch=={torch_version}"], wheels, deps=False)
        torch_wheel = next(iter(sorted(wheels.glob(f"torch-{torch_version}-*.whl"))))
    requirement = toolkit_requirement(torch_wheel)
    _pip_download([requirement], wheels, deps=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(root.parent, ".unpack-", legacy=(f".{root.name}-",)) as work:  # a killed run's: swept
        print(f"kernel-toolchain: unpacking {torch_wheel.name} (include, share, lib) ...", file=sys.stderr, flush=True)
        _unzip(torch_wheel, work, ("torch/include/", "torch/share/", "torch/lib/"))
        for w in sorted(wheels.glob("nvidia_*.whl")):
            _unzip(w, work, ("nvidia/",))  # work/nvidia/cu13/{include,lib}, as in site-packages
        make_cuda_root(work / "cuda", nvcc_root, work)
        (work / "COMPLETE").write_text(f"{torch_wheel.name}\n{requirement}\n")
        if root.exists():
            shutil.rmtree(root)
        work.rename(root)
    print(f"kernel-toolchain: {root}", file=sys.stderr)
    return tc
