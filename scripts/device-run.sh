#!/usr/bin/env bash
# On the device machine: unpack what scripts/device-stage.sh staged, then run a command.
#
#   bash scripts/device-run.sh DEST [-- COMMAND ...]
#
# Unpacks whichever of DEST/stage1 and DEST/stage2 the call carried into /tmp/site (files
# outside the repository survive between calls while the machine stays warm, 30 s), installs
# the wheels there, and runs COMMAND with PYTHONPATH=/tmp/site and NVLink multicast kept off.
# Typical use, two `run` calls back to back (kind nvidia-h200-x2):
#   1. carry [".device/p3/stage1"], command: bash scripts/device-run.sh .device/p3
#   2. carry [".device/p3/stage2"], command:
#      bash scripts/device-run.sh .device/p3 -- python3 -m pytest -m gpu tests/patches/...
set -euo pipefail
DEST=${1:?DEST}; shift
[ "${1:-}" = "--" ] && shift
SITE=/tmp/site
mkdir -p "$SITE/vllm/vllm_flash_attn"
if [ -s "$DEST/stage1/_C_stable_libtorch.abi3.so.xz" ]; then
  xz -dc "$DEST/stage1/_C_stable_libtorch.abi3.so.xz" >"$SITE/vllm/_C_stable_libtorch.abi3.so"
fi
if [ -d "$DEST/stage2" ]; then
  tar -C "$SITE" -xzf "$DEST/stage2/vllm-tree.tar.gz"
  cp "$DEST"/stage2/_flashmla*_C.abi3.so "$SITE/vllm/"
  xz -dc "$DEST/stage2/_vllm_fa3_C.abi3.so.xz" >"$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$DEST"/stage2/whl/*.whl
fi
[ -s "$SITE/vllm/_C_stable_libtorch.abi3.so" ] || echo "warning: $SITE lacks _C_stable_libtorch (stage1 not carried on this machine)" >&2
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ $# -gt 0 ] && exec "$@"
echo "staged into $SITE"
