#!/usr/bin/env bash
# Stage a patched vLLM for the GPU device machine (no vLLM, no network there).
#
#   scripts/device-stage.sh DEST TREE [WHEEL]
#
# DEST   an ignored folder of this checkout, e.g. .device/p3 (".device/" is in .gitignore)
# TREE   the patched vLLM text tree, e.g. .work/p3 (a `python -m overlay workspace` tree);
#        its files overwrite the base wheel's
# WHEEL  the base wheel (default: the overlay cache's vllm-0.28.0 wheel)
#
# Writes two carry folders, each under the 64 MiB a call may carry:
#   DEST/stage1/  _C_stable_libtorch.abi3.so.xz                      (~57 MB)
#   DEST/stage2/  vllm-tree.tar.gz (Python tree + vllm-0.28.0.dist-info, without vllm-rs and
#                 third_party/fmha_sm100), the FlashMLA kernels, _vllm_fa3_C.abi3.so.xz,
#                 whl/ (the wheels vLLM needs on the device's torch 2.11 / Python 3.12)
# Then on the device, scripts/device-run.sh unpacks them into /tmp/site (see its header).
set -euo pipefail
DEST=${1:?DEST}; TREE=${2:?TREE}
WHEEL=${3:-$HOME/.cache/vllm-overlay/wheels/vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST/stage1" "$DEST/stage2/whl"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

unzip -q -o "$WHEEL" -d "$work/site" \
  'vllm/*' 'vllm-0.28.0.dist-info/*' -x 'vllm/vllm-rs' 'vllm/third_party/fmha_sm100/*'
if [ ! -s "$DEST/stage1/_C_stable_libtorch.abi3.so.xz" ]; then
  xz -T0 -6 -c "$work/site/vllm/_C_stable_libtorch.abi3.so" >"$DEST/stage1/_C_stable_libtorch.abi3.so.xz"
fi
cp "$work/site/vllm/_flashmla_C.abi3.so" "$work/site/vllm/_flashmla_extension_C.abi3.so" "$DEST/stage2/"
if [ ! -s "$DEST/stage2/_vllm_fa3_C.abi3.so.xz" ]; then
  xz -T0 -6 -c "$work/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" >"$DEST/stage2/_vllm_fa3_C.abi3.so.xz"
fi
# Python tree: drop every compiled library (they travel separately), overlay the patched files.
find "$work/site/vllm" -name '*.so' -delete
cp -a "$TREE/vllm/." "$work/site/vllm/"
tar -C "$work/site" -czf "$DEST/stage2/vllm-tree.tar.gz" vllm vllm-0.28.0.dist-info

# Wheels missing on the device image (DESIGN.md), pinned to this venv's versions.
WHEELS="cbor2 pyzmq openai-harmony openai sniffio distro msgspec pybase64 cachetools llguidance
xgrammar apache-tvm-ffi fastapi starlette pydantic pydantic-core annotated-types typing-inspection
typing-extensions httpx2 httpcore2 truststore jiter h11"
for name in $WHEELS; do
  if ls "$DEST/stage2/whl" | grep -qi "^$(echo "$name" | tr - _)-"; then continue; fi
  ver=$($PY -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
  spec=$name${ver:+==$ver}
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any -d "$DEST/stage2/whl" "$spec"
done
du -sh "$DEST/stage1" "$DEST/stage2"
