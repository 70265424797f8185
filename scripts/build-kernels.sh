#!/usr/bin/env bash
# Kernel stage of `make image`: rebuild only the vLLM extension targets the series touches.
#
#   scripts/build-kernels.sh --vllm 0.28.0 --out /kernels [--src DIR] [--build DIR]
#                            [--patches patches] [--dry-run]
#
# 1. `python -m overlay image --kernel-source DIR`: fetch the pinned sdist (sha256-verified),
#    unpack it, apply the series, print the CMake targets that compile the touched sources.
# 2. Configure vLLM's CMake the way its setup.py does, build only those targets, and install
#    each target's component under OUT (OUT/vllm/<target>.abi3.so, laid out as in the wheel),
#    ready for `python -m overlay build --kernels OUT`.
# --dry-run does step 1 and prints the commands of step 2 instead of running them.
#
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0a), MAX_JOBS (default nproc), NVCC_THREADS,
# PYTHON (default python3), CMAKE_BUILD_TYPE (default Release). ccache is used when installed.
set -euo pipefail

vllm="" out="" src="" build="" patches="patches" dry_run=0
die() { echo "build-kernels: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --vllm) vllm="${2:?--vllm needs a version}"; shift 2 ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --src) src="${2:?--src needs a folder}"; shift 2 ;;
    --build) build="${2:?--build needs a folder}"; shift 2 ;;
    --patches) patches="${2:?--patches needs a folder}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    *) die "unknown argument '$1' (see the header of $0)" ;;
  esac
done
[[ -n "$vllm" ]] || die "--vllm VERSION is required"
[[ -n "$out" ]] || die "--out DIR is required"

py="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/build-kernels.XXXXXX")"
src="${src:-$work/src}"
build="${build:-$work/build}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
jobs="${MAX_JOBS:-$(nproc)}"

targets_file="$work/targets"
"$py" -m overlay --patches "$patches" image --vllm "$vllm" --kernel-source "$src" >"$targets_file"
mapfile -t targets <"$targets_file"
[[ ${#targets[@]} -gt 0 ]] || die "no target to build for vllm $vllm"

configure=(cmake -S "$src" -B "$build" -G Ninja
  "-DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release}"
  -DVLLM_TARGET_DEVICE=cuda
  "-DVLLM_PYTHON_EXECUTABLE=$(command -v "$py")"
  "-DFETCHCONTENT_BASE_DIR=$build/.deps"
  -DCMAKE_JOB_POOL_COMPILE:STRING=compile
  "-DCMAKE_JOB_POOLS:STRING=compile=$jobs")
if [[ -n "${NVCC_THREADS:-}" ]]; then configure+=("-DNVCC_THREADS=$NVCC_THREADS"); fi
if command -v ccache >/dev/null; then
  configure+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
              -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
compile=(cmake --build "$build" -j "$jobs")
for t in "${targets[@]}"; do compile+=(--target "$t"); done

run() {
  if [[ $dry_run -eq 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
echo "build-kernels: vllm $vllm, targets: ${targets[*]}, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$jobs" >&2
run "${configure[@]}"
run "${compile[@]}"
for t in "${targets[@]}"; do
  run cmake --install "$build" --prefix "$out" --component "$t"
done
if [[ $dry_run -eq 0 ]]; then
  for t in "${targets[@]}"; do
    found=$(find "$out" -name "$t.abi3.so" -print -quit)
    [[ -n "$found" ]] || die "target $t installed no $t.abi3.so under $out"
    echo "build-kernels: ${found#"$out"/}" >&2
  done
fi
