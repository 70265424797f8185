#!/usr/bin/env bash
# CI's image smoke: `make image-smoke`, then each negative case, which must fail for its own reason:
#   version  a wrong OVERLAY_VERSION: the image build's smoke step stops it
#   patch    the series without its last patch: the lines it adds are reported missing
# Extra make arguments (e.g. TORCH=...) go to every run. Exit 0 only when all of that held.
set -euo pipefail
cd "$(dirname "$0")/.."
make image-smoke "$@"
declare -A want=(
  [version]="image build failed \(exit [0-9]+\): its smoke step says smoke: vllm.__version__ is '[^']+', expected '[^']*\+ovl0000000000'"
  [patch]="[A-Za-z0-9._-]+\.patch: [0-9]+ of [0-9]+ added line\(s\) missing"
)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for case in version patch; do
  echo "image-smoke-ci: negative case $case: the smoke must fail" >&2
  if make image-smoke NEGATIVE="$case" "$@" 2>&1 | tee "$log"; then
    echo "image-smoke-ci: negative case $case passed: the smoke cannot tell a wrong image" >&2
    exit 1
  fi
  if ! grep -Eq "^error: .*${want[$case]}" "$log"; then
    echo "image-smoke-ci: negative case $case failed, but not for its reason (${want[$case]}); see above" >&2
    exit 1
  fi
  echo "image-smoke-ci: negative case $case failed as it must: $(grep -E '^error: ' "$log" | tail -n 1)" >&2
done
echo "image-smoke-ci: the smoke passed; both negative cases failed for their reason"
echo "image-smoke-ci: 3 passed, 0 failed"
