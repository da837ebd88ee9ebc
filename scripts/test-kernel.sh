#!/bin/sh
# The integration and fault tests on one of Debian's kernels under qemu (TCG):
#   sudo scripts/test-kernel.sh 6.1|6.12|5.10|linux-image-NAME [--build DIR] [--filter GTEST_FILTER]
# Downloads the kernel package by name (cached in build/kernels), boots it with
# an initramfs of the build's static binaries and test programs, prints one
# result per test. ctest runs it for 6.1, 6.12 and 5.10 (tests/CMakeLists.txt),
# two VMs at a time (scripts/test.sh).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
exec python3 "$ROOT/tests/kernels/kernel_test.py" "$@"
