#!/usr/bin/env bash
# Kernel stage of `make image` (and `make kernels`): rebuild only the vLLM extension targets the
# series touches, offline, from the pinned sdist and a kernel-sources folder.
#
#   scripts/build-kernels.sh --vllm 0.28.0 --out DIR [--sources kernel-sources] [--work DIR]
#                            [--patches patches] [--dry-run]
#
# 1. `overlay image --kernel-source WORK/src.new`: fetch the pinned sdist (sha256-verified), unpack
#    it, apply the series, print the CMake targets that compile the touched sources; `overlay kernels
#    sync` brings WORK/src up to date with it in place (what changed gets a new mtime, nothing else).
# 2. `overlay kernels prepare`: check the toolchain (cmake >= 3.26, a CUDA torch's CMake config, nvcc
#    and the CUDA libraries) and, when SOURCES/<version>/ exists, the sources (each one the targets
#    compile from a clean checkout at the pin in the release's CMake files; placeholders for the
#    rest, see `make kernel-sources`), copy them to WORK/sources/, and bound MAX_JOBS by memory. One
#    line for the first fault, before anything compiles.
# 3. Configure vLLM's CMake as its setup.py does: with SOURCES/<version>/, offline
#    (FETCHCONTENT_FULLY_DISCONNECTED=ON, every external a local tree); without it, configure
#    fetches the externals from their pinned repositories as vLLM's own build does. `overlay kernels
#    order` puts the costliest compiles first; ninja builds
#    the targets (its progress shown); each target's component is installed under OUT
#    (OUT/vllm/<target>.abi3.so, laid out as in the wheel) for `overlay build --kernels OUT`.
#
# WORK (default <cache>/kernel-build/<version>) is a fixed place: the same source, build and source
# paths on every run, so ccache (used when installed) hits from any checkout; its statistics for
# this build are printed at the end. --dry-run does steps 1-2 (without the toolchain check) and
# prints the commands of step 3.
#
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0a), MAX_JOBS (default: the memory bound),
# NVCC_THREADS, PYTHON (default python3), CMAKE_BUILD_TYPE (default Release), CUDA_HOME and
# Torch_DIR (default: the toolchain `make kernel-toolchain` assembled), VLLM_OVERLAY_CACHE.
set -euo pipefail

vllm="" out="" work="" sources="kernel-sources" patches="patches" dry_run=0
die() { echo "build-kernels: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --vllm) vllm="${2:?--vllm needs a version}"; shift 2 ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --work) work="${2:?--work needs a folder}"; shift 2 ;;
    --sources) sources="${2:?--sources needs a folder}"; shift 2 ;;
    --patches) patches="${2:?--patches needs a folder}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    *) die "unknown argument '$1' (see the header of $0)" ;;
  esac
done
[[ -n "$vllm" ]] || die "--vllm VERSION is required"
[[ "$vllm" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--vllm '$vllm': expected a release like 0.28.0"
[[ -n "$out" ]] || die "--out DIR is required"

py="$(command -v "${PYTHON:-python3}")" || die "${PYTHON:-python3}: not found"
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, links kept (a venv's python)
cache="${VLLM_OVERLAY_CACHE:-$HOME/.cache/vllm-overlay}"
work="${work:-$cache/kernel-build/$vllm}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
src="$work/src" build="$work/build"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
start=$SECONDS

# 1. the patched source tree, unpacked afresh (an edit of a kernel patch is always seen), then
#    synced into the fixed tree in place: unchanged files keep their mtime (ninja leaves what they
#    build), files configure generated there stay (see overlay/kernels/srctree.py)
rm -rf "$src.new"
"$py" -m overlay --patches "$patches" image --vllm "$vllm" --kernel-source "$src.new" >"$work/targets"
"$py" -m overlay kernels sync --fresh "$src.new" --tree "$src"
rm -rf "$src.new"
mapfile -t targets <"$work/targets"
[[ ${#targets[@]} -gt 0 ]] || die "no target to build for vllm $vllm"

# 2. toolchain and sources checked, sources staged, the job bound
"$py" -m overlay kernels prepare --vllm "$vllm" --src "$src" --sources "$sources" --targets "${targets[@]}" \
  --stage "$work/sources" --env-file "$work/build.env" ${MAX_JOBS:+--max-jobs "$MAX_JOBS"} \
  $([[ $dry_run -eq 1 ]] && echo --no-preflight)
set -a
# shellcheck disable=SC1091
source "$work/build.env"
set +a
export PATH="$CUDA_HOME/bin:$PATH"
cmake="$CMAKE" jobs="$MAX_JOBS"
ninja="$(command -v ninja || true)"
if [[ -z "$ninja" ]]; then
  [[ $dry_run -eq 1 ]] || die "ninja not found (pip install ninja)"
  ninja=ninja
fi

configure=("$cmake" -S "$src" -B "$build" -G Ninja
  "-DCMAKE_MAKE_PROGRAM=$ninja"
  "-DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release}"
  -DVLLM_TARGET_DEVICE=cuda
  "-DVLLM_PYTHON_EXECUTABLE=$py"
  "-DFETCHCONTENT_BASE_DIR=$build/.deps"
  "-DFETCHCONTENT_FULLY_DISCONNECTED=$FETCHCONTENT_FULLY_DISCONNECTED"
  "-DTorch_DIR=$Torch_DIR" "-DCaffe2_DIR=$Caffe2_DIR"
  -DCMAKE_JOB_POOL_COMPILE:STRING=compile
  "-DCMAKE_JOB_POOLS:STRING=compile=$jobs")
if [[ -n "${NVCC_THREADS:-}" ]]; then configure+=("-DNVCC_THREADS=$NVCC_THREADS"); fi
use_ccache=0
if command -v ccache >/dev/null; then
  use_ccache=1
  configure+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
              -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
compile=("$ninja" -C "$build" -j "$jobs" "${targets[@]}")

# ccache's counters of this build: the difference of two `ccache --print-stats` (key<TAB>value) reads.
ccache_delta() {
  awk -F'\t' 'NR == FNR { before[$1] = $2; next } { d[$1] = $2 - before[$1] }
    END { printf "build-kernels: ccache: %d hits (%d direct, %d preprocessed), %d misses\n",
          d["direct_cache_hit"] + d["preprocessed_cache_hit"], d["direct_cache_hit"],
          d["preprocessed_cache_hit"], d["cache_miss"] }' <(printf '%s\n' "$1") <(printf '%s\n' "$2") >&2
}

run() {
  if [[ $dry_run -eq 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
echo "build-kernels: vllm $vllm, targets: ${targets[*]}, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$jobs, work $work" >&2
if [[ $use_ccache -eq 1 && $dry_run -eq 0 ]]; then
  stats_before="$(ccache --print-stats 2>/dev/null || true)"
fi
run "${configure[@]}"
run "$py" -m overlay kernels order --build "$build" --targets "${targets[@]}"
compile_start=$SECONDS
run "${compile[@]}"
echo "build-kernels: compile and link: $((SECONDS - compile_start)) s" >&2
[[ $dry_run -eq 1 ]] || { rm -rf "$out.tmp" && mkdir -p "$out.tmp"; }
for t in "${targets[@]}"; do
  run "$cmake" --install "$build" --prefix "$out.tmp" --component "$t"
done
if [[ $dry_run -eq 0 ]]; then
  for t in "${targets[@]}"; do
    found=$(find "$out.tmp" -name "$t.abi3.so" -print -quit)
    [[ -n "$found" ]] || die "target $t installed no $t.abi3.so under $out.tmp"
    echo "build-kernels: ${found#"$out.tmp"/} ($(du -h "$found" | cut -f1))" >&2
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
  if [[ $use_ccache -eq 1 ]]; then ccache_delta "$stats_before" "$(ccache --print-stats 2>/dev/null || true)"; fi
fi
echo "build-kernels: done in $((SECONDS - start)) s" >&2
