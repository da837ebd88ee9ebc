#!/bin/sh
# vmlinux/arm64/vmlinux.h, the CO-RE header of the aarch64 BPF objects, from
# the BTF of Debian's arm64 kernel: boots it under qemu-system-aarch64 (TCG)
# with a busybox-static:arm64 initramfs, reads /sys/kernel/btf/vmlinux out over
# the serial console, bpftool btf dump ... format c. Done once; the header is
# committed. Redo it for another kernel with --kernel 6.12 or a package name.
#   scripts/arm64-vmlinux.sh [--kernel 6.1] [--out FILE]
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
exec python3 "$ROOT/tests/kernels/arm64_test.py" vmlinux "$@"
