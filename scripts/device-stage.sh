#!/usr/bin/env bash
# Stage the patched vLLM for the GPU device machine (no vLLM, no network there): a thin wrapper
# over `python -m overlay device-stage` (what `make device-stage` runs; see overlay/device/).
#
#   scripts/device-stage.sh [NAME] [overlay device-stage options ...]
#
# Writes .device/NAME/carry-01 ... (default NAME: engine), each <= 60 MiB, and prints the device
# calls that bring them over; scripts/device-run.sh unpacks them there (see its header).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-engine}; [ $# -gt 0 ] && shift
exec "${PYTHON:-.venv/bin/python}" -m overlay device-stage --name "$NAME" "$@"
