#!/usr/bin/env bash
# Cluster entry point for the regression (what a batch job on an 8xH100 node calls).
#
#   scripts/regress.sh [PROFILE] [more `overlay regress` options...]
#
# Environment: BASE_URL (attach to a running server instead of starting vllm serve), OUT (report
# folder; default regress-report/<profile>-<UTC time>), GSM8K_DATA (local GSM8K folder with
# train.jsonl + test.jsonl, for nodes without hub access), VENV (default .venv, from `make build`).
# ATTACH_TIMEOUT: seconds an attached server may refuse connections (default: server.attach_timeout_s).
# The exit status is the verdict: 0 pass, 1 regression, 2 the harness itself failed (unlike `make
# regress`, whose own status is 0 or 2); OUT/verdict and OUT/verdict.json hold it too.
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${PROFILE:-glm5.2-fp8-tp8-dcp8}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    profile="$1"
    shift
fi
out="${OUT:-regress-report/${profile##*/}-$(date -u +%Y%m%dT%H%M%SZ)}"
py="${VENV:-.venv}/bin/python"
if [[ ! -x "$py" ]]; then
    echo "error: $py not found; run 'make build' first" >&2
    exit 2
fi

args=(-m overlay regress --profile "$profile" --out "$out")
if [[ -n "${BASE_URL:-}" ]]; then args+=(--base-url "$BASE_URL"); fi
if [[ -n "${GSM8K_DATA:-}" ]]; then args+=(--gsm8k-data "$GSM8K_DATA"); fi
if [[ -n "${ATTACH_TIMEOUT:-}" ]]; then export REGRESS_ATTACH_TIMEOUT="$ATTACH_TIMEOUT"; fi
exec "$py" "${args[@]}" "$@"
