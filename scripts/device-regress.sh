#!/usr/bin/env bash
# On the device machine: `make regress` against real `vllm serve` servers of the tiny GLM-5 checkpoint.
#
#   bash scripts/device-run.sh .device/engine -- bash scripts/device-regress.sh reference
#   bash scripts/device-run.sh .device/engine -- bash scripts/device-regress.sh verdicts [VARIANTS]
#
# reference: the DCP 1 server (profile tiny-glm5-tp2-dcp1-mtp5) records the differential reference
#   (/tmp/regress/ref-differential.json) and the baselines of the DCP 2 profiles
#   (/tmp/regress/profiles/<profile>.yaml: --record-baseline with --baseline-for each).
# verdicts: three `make regress` runs at once, each starting its own server on the two GPUs, judged
#   against that reference and those baselines; the expected verdicts (issue 14):
#     series              tiny-glm5-tp2-dcp2-mtp5       pass
#     minus-forced-mqa    tiny-glm5-tp2-dcp2-agrs-mtp5  regression (the differential check names it)
#     minus-a2a-fallback  tiny-glm5-tp2-dcp2-mtp5       regression: server died on the long prompt
#   The two variants are the seed-bug trees of `make engine-variants` (VARIANTS, default
#   .device/variants), laid over the staged vLLM and put first on the server's PYTHONPATH.
#   Writes /tmp/regress/verdicts.md and .json; exits 0 when every run reached its expected verdict.
#
# Outputs stay in /tmp/regress while the machine is warm (the verdicts stage needs the reference
# stage's files: run the two calls back to back); the reports come back through $OUT.
# REGRESS_VLLM (the vllm command), REGRESS_PORT_BASE (8100) and REGRESS_ROOT (/tmp/regress) let the
# CPU test run this script against the stand-in.
# `make regress` runs with VENV pointing at a folder whose python is the device's python3 (the
# staged vLLM is on PYTHONPATH; there is no .venv on the device), so the Makefile's own recipe,
# exit status and OUT/verdict are what is exercised.
set -uo pipefail
STAGE=${1:?usage: device-regress.sh reference|verdicts [VARIANTS]}
VARIANTS=${2:-.device/variants}
ROOT=${REGRESS_ROOT:-/tmp/regress}
VLLM_CMD=${REGRESS_VLLM:-python3 -m vllm.entrypoints.cli.main}
PORT_BASE=${REGRESS_PORT_BASE:-8100}
GSM8K=tests/regress/fixtures/gsm8k
mkdir -p "$ROOT"
# The DSA indexer needs DeepGEMM, which vLLM's wheel does not ship: the test-only stand-in
# (tests/engine/standin/deep_gemm, torch) goes on the servers' PYTHONPATH, as engine-check does.
export PYTHONPATH=$PWD/tests/engine/standin${PYTHONPATH:+:$PYTHONPATH}

say() { echo "[device-regress] $*" >&2; }

# make regress with the device's python3 as the "venv" python (the tool stamp is fresh).
VENV=$ROOT/venv
mkdir -p "$VENV/bin"
# a wrapper, not a symlink: a venv's python symlinked elsewhere would lose its venv
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$VENV/bin/python"
chmod +x "$VENV/bin/python"
touch "$VENV/.overlay-tool"

# The checkpoint the profiles name (generated once per machine, atomically; byte-identical everywhere).
model=$(python3 -c 'from overlay.regress.profiles import load_profile
print(load_profile("tiny-glm5-tp2-dcp1-mtp5").server.model_path)')
if [ ! -d "$model" ]; then
  python3 -m overlay.engine.checkpoint >&2 || { say "checkpoint generation failed"; exit 2; }
  [ -d "$model" ] || { say "the generated checkpoint is not the profiles' server.model $model"; exit 2; }
fi

gsm8k_args=()
if python3 -c 'import lm_eval' 2>/dev/null; then
  gsm8k_args=(--gsm8k-data "$GSM8K")
else
  gsm8k_args=(--skip gsm8k)
  say "lm-eval is not importable here: GSM8K skipped"
fi

# regress NAME SLOT PROFILE [extra overlay-regress args...]: one `make regress` run, its own port,
# torch.compile cache and VLLM_PORT range; TREE=dir puts a variant tree first on PYTHONPATH.
regress() {
  local name=$1 slot=$2 profile=$3
  shift 3
  local out=$ROOT/$name
  rm -rf "$out"
  mkdir -p "$out"
  (
    export VLLM_CACHE_ROOT=$ROOT/cache-$name VLLM_PORT=$((29000 + 100 * slot))
    [ -n "${TREE:-}" ] && export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH}
    make --no-print-directory regress VENV="$VENV" PROFILE="$profile" OUT="$out" \
      ARGS="--port $((PORT_BASE + slot)) --vllm-bin '$VLLM_CMD' ${gsm8k_args[*]} $*"
  ) >"$out/console.log" 2>&1
  local rc=$?
  say "$name: make regress exit $rc, verdict $(cat "$out/verdict" 2>/dev/null || echo none)"
  return $rc
}

bring_back() {  # copy the reports (not the server logs' bulk) to $OUT
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  (cd "$ROOT" && tar -czf "$OUT/regress-$STAGE.tar.gz" --exclude='cache-*' --exclude=venv --exclude='trees' \
    --exclude='*.safetensors' ./*/ ./*.json ./*.md 2>/dev/null)
  [ -f "$ROOT/verdicts.md" ] && cp "$ROOT/verdicts.md" "$OUT/"
  return 0
}

case $STAGE in
  reference)
    regress ref 0 tiny-glm5-tp2-dcp1-mtp5 --record-differential "$ROOT/ref-differential.json" \
      --record-baseline "$ROOT/profiles" --baseline-for tiny-glm5-tp2-dcp2-mtp5 \
      --baseline-for tiny-glm5-tp2-dcp2-agrs-mtp5
    rc=$?
    tail -n 30 "$ROOT/ref/console.log" >&2
    bring_back
    exit $rc
    ;;
  verdicts)
    for f in "$ROOT/ref-differential.json" "$ROOT/profiles/tiny-glm5-tp2-dcp2-mtp5.yaml" \
             "$ROOT/profiles/tiny-glm5-tp2-dcp2-agrs-mtp5.yaml"; do
      [ -f "$f" ] || { say "missing $f: run the reference stage first (same warm machine)"; exit 2; }
    done
    trees=$ROOT/trees
    python3 - "$VARIANTS" "$trees" <<'PYEOF' || { say "laying the variant trees failed"; exit 2; }
import json
import sys
from pathlib import Path

from overlay.engine.check import lay_variant

variants, trees = map(Path, sys.argv[1:3])
manifest = json.loads((variants / "variants.json").read_text())["variants"]
for name, variant in (("minus-forced-mqa", "minus-dcp-forced-mqa-prefill-rows"),
                      ("minus-a2a-fallback", "minus-dcp-direct-a2a-fallback")):
    if variant not in manifest:
        sys.exit(f"error: {variants / 'variants.json'}: no variant {variant} (make engine-variants)")
    tree = lay_variant(variants / f"{variant}.tar.gz", trees / name)
    print(f"[device-regress] {name}: {manifest[variant]['what']} -> {tree}", file=sys.stderr)
PYEOF
    ref=(--ref-file "$ROOT/ref-differential.json")
    regress series 1 "$ROOT/profiles/tiny-glm5-tp2-dcp2-mtp5.yaml" "${ref[@]}" &
    TREE=$trees/minus-forced-mqa regress minus-forced-mqa 2 "$ROOT/profiles/tiny-glm5-tp2-dcp2-agrs-mtp5.yaml" \
      "${ref[@]}" &
    TREE=$trees/minus-a2a-fallback regress minus-a2a-fallback 3 "$ROOT/profiles/tiny-glm5-tp2-dcp2-mtp5.yaml" \
      "${ref[@]}" &
    wait
    python3 -m overlay.regress.verdicts "$ROOT" \
      series=pass minus-forced-mqa=regression:differential minus-a2a-fallback=regression:server-died
    rc=$?
    bring_back
    exit $rc
    ;;
  *)
    say "unknown stage $STAGE (reference or verdicts)"
    exit 2
    ;;
esac
