"""The kernel path without a kernel build: the sources' pins and placeholders read from vLLM's CMake
files (0.28.0 and 0.33.0), the kernel-sources folder and its verification, the build order and job
bound, and the one-line errors for a missing prerequisite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.pins import load_pin
from overlay.build.sdist import fetch_sdist, read_sources
from overlay.kernels import order, sources, toolchain
from overlay.kernels.targets import is_cmake_source, read_kernel_map, resolve_targets

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "kernel-patch"


def cmake_files(version: str) -> dict[str, str]:
    pin = load_pin(REPO / "patches", version)
    return read_sources(fetch_sdist(pin, f"patches/{version}/pin.toml"), is_cmake_source)


# ------------------------------------------------------------------- what the CMake files say

@pytest.mark.slow
def test_the_sources_and_their_pins_of_0_28_0() -> None:
    ext = sources.read_externals(cmake_files("0.28.0"))
    assert sorted(ext) == ["cutlass", "deepgemm", "flashkda", "flashmla", "fmha_sm100", "qutlass", "tml_fa4",
                           "triton_kernels", "vllm-flash-attn"]
    assert (ext["cutlass"].tag, ext["cutlass"].env) == ("v4.4.2", "VLLM_CUTLASS_SRC_DIR")
    assert ext["cutlass"].repository == "https://github.com/nvidia/cutlass.git"
    # the CUDA branch of triton_kernels.cmake, not the ROCm one
    assert (ext["triton_kernels"].repository, ext["triton_kernels"].tag) == \
        ("https://github.com/triton-lang/triton.git", "v3.5.1")
    assert ext["flashmla"].tag == "a8f794d1251cbfd88a5011445dd5582289c727e4"
    # what configure reads from a source it does not compile: FlashMLA's listed files, its interface
    assert "flash_mla/flash_mla_interface.py" in ext["flashmla"].reads
    assert "csrc/api/api.cpp" in ext["flashmla"].reads
    assert "csrc/python_api.cpp" in ext["deepgemm"].reads


@pytest.mark.slow
@pytest.mark.parametrize("version, cutlass, count", [("0.28.0", "v4.4.2", 9), ("0.34.0", "v4.7.1", 8)])
def test_only_cutlass_is_real_for_c_stable_libtorch(version: str, cutlass: str, count: int) -> None:
    decisions = sources.plan(cmake_files(version), ["_C_stable_libtorch"])
    assert len(decisions) == count
    real = [d.external.name for d in decisions if d.real]
    assert real == ["cutlass"]
    assert next(d for d in decisions if d.real).external.tag == cutlass
    flashmla = sources.plan(cmake_files(version), ["_flashmla_C"])
    assert [d.external.name for d in flashmla if d.real] == ["flashmla"]
    assert all(d.real for d in sources.plan(cmake_files(version)))  # no target named: every source


@pytest.mark.slow
def test_an_unknown_target_is_one_line() -> None:
    with pytest.raises(sources.KernelSourcesError, match=r"target '_nope_C': no define_extension_target"):
        sources.plan(cmake_files("0.28.0"), ["_nope_C"])


@pytest.mark.slow
def test_the_kernel_test_patch_rebuilds_c_stable_libtorch() -> None:
    """The fixture series (not shipped) is a kernel patch of the DCP direct A2A kernel; its pin is the
    shipped one."""
    from overlay.build.series import Series

    series = Series.load(FIXTURE / "0.28.0")
    assert [p.kind for p in series.patches] == ["kernel"]
    assert (FIXTURE / "0.28.0" / "pin.toml").read_text() == (REPO / "patches" / "0.28.0" / "pin.toml").read_text()
    kernels = resolve_targets(series.kernel_touched, read_kernel_map(cmake_files("0.28.0")))
    assert kernels.targets == ("_C_stable_libtorch",)
    assert not (REPO / "patches" / "0.28.0" / "dcp-direct-a2a-capacity-message.patch").exists()


# ------------------------------------------------------------------- the folder

def _git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout.strip()


@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, str]:
    """A repository with a tag v1.0 (the pin) and a later commit on its branch."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git("init", "-q", "-b", "main", cwd=repo)
    (repo / "include").mkdir()
    (repo / "include" / "lib.h").write_text("int v1;\n")
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "v1", cwd=repo)
    _git("tag", "-a", "v1.0", "-m", "v1.0", cwd=repo)
    pinned = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "include" / "lib.h").write_text("int v2;\n")
    _git("commit", "-qam", "v2", cwd=repo)
    return repo, pinned


def ext(tag: str = "v1.0") -> sources.External:
    return sources.External("lib", "https://example.invalid/owner/lib.git", tag, "LIB_SRC_DIR", "CMakeLists.txt",
                            reads={"src/a.cu"}, dirs={"include"})


def test_fill_checks_out_the_pin_and_verify_accepts_it(tmp_path: Path, upstream: tuple[Path, str]) -> None:
    repo, pinned = upstream
    root = tmp_path / "kernel-sources" / "0.28.0"
    decisions = [sources.Decision(ext(), True, "compiled by _x_C")]
    entries = sources.fill(root, decisions, remotes={"lib": str(repo)}, log=lambda _: None)
    assert [(e.kind, e.commit) for e in entries] == [("real", pinned)]
    assert (root / "lib" / "include" / "lib.h").read_text() == "int v1;\n"
    assert sources.verify(root, decisions)[0].commit == pinned
    # stands alone: copied elsewhere with the upstream gone, it still verifies
    copy = tmp_path / "copy" / "0.28.0"
    shutil.copytree(root, copy, symlinks=True)
    shutil.rmtree(repo)
    assert sources.verify(copy, decisions)[0].commit == pinned
    manifest = (root / sources.MANIFEST).read_text()
    assert '"kind": "real"' in manifest and pinned in manifest


def test_fill_into_a_relative_folder_from_a_local_mirror(tmp_path: Path, upstream: tuple[Path, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`make kernel-sources` passes kernel-sources/<version> relative to the checkout; packing the local
    mirror's objects ran git with -C and that relative path, which failed (pack: No such file)."""
    repo, pinned = upstream
    monkeypatch.chdir(tmp_path)
    decisions = [sources.Decision(ext(), True, "compiled by _x_C")]
    entries = sources.fill(Path("kernel-sources/0.28.0"), decisions, remotes={"lib": str(repo)}, log=lambda _: None)
    assert [(e.kind, e.commit) for e in entries] == [("real", pinned)]
    assert not (tmp_path / "kernel-sources/0.28.0/lib/.git/objects/info/alternates").exists()
    shutil.rmtree(repo)
    assert sources.verify(Path("kernel-sources/0.28.0"), decisions)[0].commit == pinned


def test_fill_by_commit_over_a_url_remote(tmp_path: Path, upstream: tuple[Path, str]) -> None:
    """A pin that is a commit, fetched from a URL (``file://``): a depth-1 fetch of that commit."""
    repo, pinned = upstream
    _git("config", "uploadpack.allowReachableSHA1InWant", "true", cwd=repo)
    root = tmp_path / "ks"
    entries = sources.fill(root, [sources.Decision(ext(pinned), True, "x")], remotes={"lib": f"file://{repo}"},
                           log=lambda _: None)
    assert entries[0].commit == pinned


def test_verify_refuses_a_wrong_commit_a_local_change_and_a_plain_folder(tmp_path: Path,
                                                                       upstream: tuple[Path, str]) -> None:
    repo, _ = upstream
    root = tmp_path / "ks"
    decisions = [sources.Decision(ext(), True, "x")]
    sources.fill(root, decisions, remotes={"lib": str(repo)}, log=lambda _: None)
    (root / "lib" / "include" / "lib.h").write_text("int tampered;\n")
    with pytest.raises(sources.KernelSourcesError, match=r"lib: has local changes \(M include/lib.h\)"):
        sources.verify(root, decisions)
    _git("checkout", "-q", "--", "include/lib.h", cwd=root / "lib")
    with pytest.raises(sources.KernelSourcesError, match=r"HEAD is [0-9a-f]{12}, but CMakeLists.txt pins lib to "):
        sources.verify(root, [sources.Decision(ext("0" * 40), True, "x")])
    shutil.rmtree(root / "lib" / ".git")
    with pytest.raises(sources.KernelSourcesError, match="not a git checkout"):
        sources.verify(root, decisions)
    shutil.rmtree(root / "lib")
    with pytest.raises(sources.KernelSourcesError, match=r"lib: missing \(lib is pinned to v1.0 in CMakeLists.txt\)"):
        sources.verify(root, decisions)


def test_a_placeholder_holds_what_configure_reads_and_is_refused_where_a_checkout_is_needed(tmp_path: Path) -> None:
    root = tmp_path / "ks"
    sources.fill(root, [sources.Decision(ext(), False, "read by configure only")], log=lambda _: None)
    assert (root / "lib" / "src" / "a.cu").is_file() and (root / "lib" / "include").is_dir()
    assert "placeholder for lib" in (root / "lib" / sources.PLACEHOLDER).read_text()
    assert sources.verify(root, [sources.Decision(ext(), False, "x")])[0].kind == "placeholder"
    with pytest.raises(sources.KernelSourcesError, match="is a placeholder, but the targets compile from lib"):
        sources.verify(root, [sources.Decision(ext(), True, "x")])


def test_a_remote_that_reads_as_an_option_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sources.KernelSourcesError, match="would be read as a git option"):
        sources.fetch_checkout(tmp_path / "x", ext(), "--upload-pack=touch /tmp/pwned")


def test_the_mirror_template() -> None:
    assert sources.remote_for(ext(), "/srv/git/{owner}+{repo}") == "/srv/git/owner+lib"
    assert sources.remote_for(ext(), None) == "https://example.invalid/owner/lib.git"


def test_stage_copies_to_a_fixed_path_without_git_and_only_when_changed(tmp_path: Path,
                                                                        upstream: tuple[Path, str]) -> None:
    repo, _ = upstream
    root = tmp_path / "ks"
    entries = sources.fill(root, [sources.Decision(ext(), True, "x")], remotes={"lib": str(repo)}, log=lambda _: None)
    staged = sources.stage(entries, tmp_path / "stage")
    assert (staged["lib"] / "include" / "lib.h").is_file() and not (staged["lib"] / ".git").exists()
    before = (staged["lib"] / "include" / "lib.h").stat().st_mtime_ns
    sources.stage(entries, tmp_path / "stage")
    assert (staged["lib"] / "include" / "lib.h").stat().st_mtime_ns == before  # not copied again
    assert sources.env_lines([sources.Decision(ext(), True, "x")], staged) == [f"LIB_SRC_DIR={staged['lib']}"]


# ------------------------------------------------------------------- order and width

MANIFEST = """ninja_required_version = 1.5
include CMakeFiles/rules.ninja
build cmake_object_order_depends_target__C: phony || gen
build CMakeFiles/_C.dir/csrc/layernorm_kernels.cu.o: CUDA_COMPILER__C csrc/layernorm_kernels.cu
  FLAGS = -O3
build CMakeFiles/_C.dir/csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu.o: CUDA_COMPILER__C x.cu
  FLAGS = -O3
build CMakeFiles/_C.dir/csrc/quantization/marlin/sm80_kernel_a.cu.o: CUDA_COMPILER__C y.cu
build _C.abi3.so: CUDA_SHARED_LIBRARY_LINKER__C CMakeFiles/_C.dir/csrc/layernorm_kernels.cu.o
build CMakeFiles/other.dir/a.cu.o: CUDA_COMPILER__other a.cu
"""


def test_the_costliest_compile_goes_first_and_nothing_else_moves() -> None:
    text, ordered = order.reorder_manifest(MANIFEST, ("_C",), {})
    assert ordered == ["csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu", "csrc/quantization/marlin/sm80_kernel_a.cu",
                       "csrc/layernorm_kernels.cu"]
    assert sorted(text.splitlines()) == sorted(MANIFEST.splitlines())  # the same statements
    lines = text.splitlines()
    assert lines[:2] == MANIFEST.splitlines()[:2]  # the header keeps its place
    assert lines[2].startswith("build CMakeFiles/_C.dir/csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu.o")
    assert lines[3] == "  FLAGS = -O3"  # a statement's variables go with it
    link = next(i for i, line in enumerate(lines) if line.startswith("build _C.abi3.so:"))
    assert link < lines.index("build CMakeFiles/other.dir/a.cu.o: CUDA_COMPILER__other a.cu")


def test_the_last_builds_durations_decide_over_the_table(tmp_path: Path) -> None:
    (tmp_path / ".ninja_log").write_text(
        "# ninja log v5\n0\t3000000\t0\tCMakeFiles/_C.dir/csrc/layernorm_kernels.cu.o\tab\n")
    _, ordered = order.reorder_manifest(MANIFEST, ("_C",), order.read_ninja_log(tmp_path))
    assert ordered[0] == "csrc/layernorm_kernels.cu"


@pytest.mark.parametrize("cpus, gib, jobs", [(16, 128, 12), (2, 24, 2), (2, 6, 1), (64, 64, 6)])
def test_max_jobs_is_bound_by_memory(cpus: int, gib: int, jobs: int) -> None:
    got, why = order.job_bound(cpus, gib * order.GIB)
    assert got == jobs and f"MAX_JOBS={jobs}" in why and "10 GiB per heavy CUTLASS unit" in why


def test_ninja_orders_by_manifest_among_equals(tmp_path: Path) -> None:
    """The premise of the reorder: among ready jobs of equal weight, ninja starts the first declared."""
    ninja = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    if ninja is None:
        pytest.skip("no ninja")
    names = ["a", "b", "c", "d"]
    rules = "rule w\n  command = echo $out >> order.txt && touch $out\n"
    (tmp_path / "build.ninja").write_text(rules + "".join(f"build {n}.o: w\n" for n in reversed(names))
                                          + "build all: phony " + " ".join(f"{n}.o" for n in names) + "\n")
    subprocess.run([ninja, "-j1", "all"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "order.txt").read_text().split() == [f"{n}.o" for n in reversed(names)]


# ------------------------------------------------------------------- prerequisites, one line each

def _fake_cmake(tmp_path: Path, version: str) -> str:
    script = tmp_path / "cmake"
    script.write_text(f"#!/bin/sh\necho 'cmake version {version}'\n")
    script.chmod(0o755)
    return str(script)


def _cuda_root(tmp_path: Path, libs: tuple[str, ...], *, nvcc: bool = True, libcuda: bool = True) -> Path:
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    (root / "lib64" / "stubs").mkdir(parents=True)
    if nvcc:
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
    for lib in libs:
        (root / "lib64" / f"lib{lib}.so").touch()
    if libcuda:
        (root / "lib64" / "stubs" / "libcuda.so").touch()
    return root


def _torch(tmp_path: Path, *, cuda: bool = True) -> Path:
    tdir = tmp_path / "torch" / "share" / "cmake" / "Torch"
    tdir.mkdir(parents=True)
    (tdir / "TorchConfig.cmake").touch()
    (tmp_path / "torch" / "lib").mkdir()
    if cuda:
        (tmp_path / "torch" / "lib" / "libtorch_cuda.so").touch()
    return tdir


def test_a_complete_toolchain_passes(tmp_path: Path) -> None:
    tc = toolchain.Toolchain(_fake_cmake(tmp_path, "3.31.6"), _cuda_root(tmp_path, toolchain.CUDA_LIBRARIES),
                             _torch(tmp_path))
    toolchain.preflight(tc)
    assert tc.env()["Caffe2_DIR"].endswith("share/cmake/Caffe2")


@pytest.mark.parametrize("fault, message", [
    ("cmake", r"is cmake 3.25.1; vLLM's configure needs >= 3.26"),
    ("torch-config", r"no TorchConfig.cmake"),
    ("torch-cpu", r"torch there is not a CUDA build"),
    ("nvcc", r"no nvcc at"),
    ("cublas", r"no libcublas.so in lib64/"),
    ("libcuda", r"neither libcuda.so nor lib64/stubs/libcuda.so"),
])
def test_each_missing_prerequisite_is_one_line(tmp_path: Path, fault: str, message: str) -> None:
    libs = tuple(lib for lib in toolchain.CUDA_LIBRARIES if not (fault == "cublas" and lib == "cublas"))
    tdir = _torch(tmp_path, cuda=fault != "torch-cpu")
    if fault == "torch-config":
        (tdir / "TorchConfig.cmake").unlink()
    tc = toolchain.Toolchain(_fake_cmake(tmp_path, "3.25.1" if fault == "cmake" else "4.4.5"),
                             _cuda_root(tmp_path, libs, nvcc=fault != "nvcc", libcuda=fault != "libcuda"), tdir)
    with pytest.raises(toolchain.ToolchainError, match=message) as err:
        toolchain.preflight(tc)
    assert "\n" not in str(err.value)


def test_the_libcuda_stub_declares_the_driver_entry_points() -> None:
    src = toolchain.libcuda_stub_source("CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *m);\n"
                                        "#define cuMemAlloc cuMemAlloc_v2\n")
    assert "void cuTensorMapEncodeTiled(void) {}" in src and "void cuMemAlloc_v2(void) {}" in src


def test_the_toolkit_requirement_comes_from_the_torch_wheel(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("torch-2.13.0.dist-info/METADATA",
                    "Requires-Dist: cuda-toolkit[cublas,cudart]==13.0.3; platform_system == \"Linux\"\n")
    assert toolchain.toolkit_requirement(wheel).endswith("]==13.0.3")
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("torch-2.13.0.dist-info/METADATA", "Requires-Dist: filelock\n")
    with pytest.raises(toolchain.ToolchainError, match="not a CUDA build of torch"):
        toolchain.toolkit_requirement(wheel)


@pytest.mark.slow
def test_build_kernels_stops_before_configure_without_nvcc(tmp_path: Path) -> None:
    """The script's toolchain check runs before anything compiles: one line, non-zero exit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    Path(_fake_cmake(bin_dir, "4.4.5"))
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "no-cuda"), "Torch_DIR": str(_torch(tmp_path)),
           "PYTHON": sys.executable, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "build-kernels.sh"), "--vllm", "0.28.0", "--patches",
                           str(FIXTURE), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: CUDA_HOME={tmp_path / 'no-cuda'}: no nvcc at " \
        f"{tmp_path / 'no-cuda' / 'bin' / 'nvcc'}"
    assert not (tmp_path / "work" / "build").exists()


def test_a_ccache_hit_in_the_log_does_not_order_the_next_build(tmp_path: Path) -> None:
    """After a cached rebuild every logged duration is a 0.3 s hit: the measured table orders instead."""
    (tmp_path / ".ninja_log").write_text(
        "# ninja log v5\n0\t300\t0\tCMakeFiles/_C.dir/csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu.o\tab\n"
        "0\t400\t0\tCMakeFiles/_C.dir/csrc/layernorm_kernels.cu.o\tcd\n")
    _, ordered = order.reorder_manifest(MANIFEST, ("_C",), order.read_ninja_log(tmp_path))
    assert ordered[0] == "csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu"
