#!/usr/bin/env bash
# On the device machine: run the engine check and bring its report back through $OUT.
#
#   bash scripts/device-run.sh .device/engine -- bash scripts/device-engine-check.sh NAME [CHECK ARGS ...]
#
# Runs `python3 -m overlay engine-check --out /tmp/engine/NAME CHECK ARGS` (outputs stay on the
# machine while it is warm, so a later call can pass `--reuse /tmp/engine/NAME`), then copies
# three files into $OUT (a call brings back at most 8): NAME.md (the report), NAME.json (results)
# and NAME-logs.tar.gz (every case's log and outputs); with --coverage a fourth, NAME-coverage.tar.gz
# (each job's combined coverage data, JOB/coverage/.coverage). Exits with the check's status.
set -uo pipefail
NAME=${1:?NAME}; shift
DIR=/tmp/engine/$NAME
mkdir -p "$DIR"
python3 -m overlay engine-check --out "$DIR" "$@"
rc=$?
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  [ -f "$DIR/REPORT.md" ] && cp "$DIR/REPORT.md" "$OUT/$NAME.md"
  [ -f "$DIR/results.json" ] && cp "$DIR/results.json" "$OUT/$NAME.json"
  (cd "$DIR" && ls ./*.log ./*.json 2>/dev/null | grep -v results.json | tar -czf "$OUT/$NAME-logs.tar.gz" -T -)
  if compgen -G "$DIR/*/coverage/.coverage" >/dev/null; then
    (cd "$DIR" && tar -czf "$OUT/$NAME-coverage.tar.gz" ./*/coverage/.coverage)
  fi
fi
exit $rc
