#!/bin/sh
# Cross-build memtrace-bpf for aarch64 into build-arm64/ (RelWithDebInfo, static
# like the x86-64 build): Debian's cross toolchain and the arm64 multiarch -dev
# packages (scripts/deps-arm64.txt, installed when missing, arm64 added to
# dpkg), cmake/aarch64-linux-gnu.cmake, the BPF objects for __TARGET_ARCH_arm64
# against vmlinux/arm64/vmlinux.h (scripts/arm64-vmlinux.sh made it).
#   scripts/build-arm64.sh [-jN] [cmake --build arguments...]
# (MEMTRACE_BUILD_ARM64=DIR: another build directory)
# Test it under qemu with scripts/test-arm64.sh; docs/arm64.md says what works.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${MEMTRACE_BUILD_ARM64:-$ROOT/build-arm64}
sh "$ROOT/scripts/setup.sh" "$ROOT/scripts/deps-arm64.txt"
[ -f "$ROOT/vmlinux/arm64/vmlinux.h" ] || { echo "build-arm64: vmlinux/arm64/vmlinux.h missing: scripts/arm64-vmlinux.sh makes it" >&2; exit 1; }
cmake -S "$ROOT" -B "$B" -DCMAKE_TOOLCHAIN_FILE="$ROOT/cmake/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMTRACE_EXTRA_CMAKE= >/dev/null
jobs="-j$(nproc)"
case "${1:-}" in -j*) jobs=$1; shift ;; esac
cmake --build "$B" "$jobs" "$@"
# What came out: aarch64, and the two shipped programs static.
for f in "$B/src/loader/memtrace-bpf" "$B/src/singlestep-helper/memtrace-singlestep"; do
  readelf -hW "$f" | grep -q AArch64 || { echo "build-arm64: $f is not an aarch64 program" >&2; exit 1; }
  if readelf -lW "$f" | grep -q INTERP; then echo "build-arm64: $f is not static" >&2; exit 1; fi
done
echo "build-arm64: $B/src/loader/memtrace-bpf (aarch64, static)"
