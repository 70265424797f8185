#!/usr/bin/env bash
# On the device machine: run `make bench-engine`'s A/B and bring its results back through $OUT.
#
#   bash scripts/device-run.sh .device/engine -- bash scripts/device-bench-engine.sh [BENCH ARGS ...]
#
# Runs `python3 -m overlay bench-engine --out /tmp/bench-engine BENCH ARGS` (`vllm serve` of the
# tiny GLM-5 checkpoint, projection before the DCP merge on and off and A's twin, on the machine's two GPUs), then copies
# into $OUT: engine.json (settings, every run, medians, ratios), engine.md (the table), engine.png when
# matplotlib drew it, and server-logs.tar.gz (server-A.log, server-B.log, server-C.log). A call may run 600 s: without
# --budget in BENCH ARGS the bench gets `--budget ${BENCH_ENGINE_BUDGET:-480}` (no cell is started that
# would not end by then; start-up of the servers counts), and it is stopped with SIGTERM after
# ${BENCH_ENGINE_TIMEOUT:-560} s, on which it writes what it measured and stops the servers, so the
# copy below still happens. Exits with the bench's status (0 done, 1 a server died, 130 stopped).
#
# `--b-tree-variant NAME` lays `make engine-variants`' NAME.tar.gz (from ${VARIANTS:-.device/variants})
# over the staged vLLM as a tree and gives it to the bench as `--b-tree` (B runs it; e.g.
# mtp-as-prefills for the MTP graph-mode A/B).
set -uo pipefail
DIR=${BENCH_ENGINE_DIR:-/tmp/bench-engine}
mkdir -p "$DIR"
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--b-tree-variant" ]; then
    name=${2:?--b-tree-variant NAME}
    tree=$(python3 -c 'import sys; from pathlib import Path; from overlay.engine.check import lay_variant
print(lay_variant(Path(sys.argv[1]), Path(sys.argv[2])))' "${VARIANTS:-.device/variants}/$name.tar.gz" "/tmp/variants/$name") \
      || { echo "device-bench-engine: cannot lay variant $name" >&2; exit 2; }
    args+=(--b-tree "$tree" --b-label "$name")
    shift 2
  else
    args+=("$1")
    shift
  fi
done
case " ${args[*]} " in
  *" --budget"*) ;;
  *) args+=(--budget "${BENCH_ENGINE_BUDGET:-480}") ;;
esac
timeout -k 30 "${BENCH_ENGINE_TIMEOUT:-560}" python3 -m overlay bench-engine --out "$DIR" "${args[@]}"
rc=$?
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  for f in engine.json engine.md engine.png; do
    [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/$f"
  done
  (cd "$DIR" && ls ./server-*.log 2>/dev/null | tar -czf "$OUT/server-logs.tar.gz" -T -)
fi
exit $rc
