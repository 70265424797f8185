#!/usr/bin/env bash
# On the device machine: run `make bench-engine`'s A/B and bring its results back through $OUT.
#
#   bash scripts/device-run.sh .device/engine -- bash scripts/device-bench-engine.sh [BENCH ARGS ...]
#
# Runs `python3 -m overlay.bench.engine --out /tmp/bench-engine BENCH ARGS` (`vllm serve` of the
# tiny GLM-5 checkpoint, VLLM_DCP_PROJECT_BEFORE_MERGE=1 and =0 and A's twin, on the machine's two GPUs), then copies
# into $OUT: engine.json (settings, every run, medians, ratios), engine.md (the table), engine.png when
# matplotlib drew it, and server-logs.tar.gz (server-A.log, server-B.log, server-C.log). A call may run 600 s: without
# --budget in BENCH ARGS the bench gets `--budget ${BENCH_ENGINE_BUDGET:-480}` (no cell is started that
# would not end by then; start-up of the servers counts), and it is stopped with SIGTERM after
# ${BENCH_ENGINE_TIMEOUT:-560} s, on which it writes what it measured and stops the servers, so the
# copy below still happens. Exits with the bench's status (0 done, 1 a server died, 130 stopped).
set -uo pipefail
DIR=${BENCH_ENGINE_DIR:-/tmp/bench-engine}
mkdir -p "$DIR"
args=("$@")
case " $* " in
  *" --budget"*) ;;
  *) args+=(--budget "${BENCH_ENGINE_BUDGET:-480}") ;;
esac
timeout -k 30 "${BENCH_ENGINE_TIMEOUT:-560}" python3 -m overlay.bench.engine --out "$DIR" "${args[@]}"
rc=$?
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  for f in engine.json engine.md engine.png; do
    [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/$f"
  done
  (cd "$DIR" && ls ./server-*.log 2>/dev/null | tar -czf "$OUT/server-logs.tar.gz" -T -)
fi
exit $rc
