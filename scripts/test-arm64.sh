#!/bin/sh
# The aarch64 build (scripts/build-arm64.sh, build-arm64/) on Debian's arm64
# kernel under qemu-system-aarch64 -M virt -cpu max (TCG): --check, launch
# traces with exact counts, stacks, page faults (--trace-faults and --faults
# on tests/faults/fault_target: every page of its buffer charged once), and
# the parts not written for arm64 yet, which must say so in one line. One
# PASS/FAIL line per test; exit 1 on any failure. Not in CI (docs/arm64.md:
# how long it takes).
#   sudo scripts/test-arm64.sh [--kernel 6.1|6.12|5.10|linux-image-...-arm64] [--build DIR]
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
exec python3 "$ROOT/tests/kernels/arm64_test.py" test "$@"
