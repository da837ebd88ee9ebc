#!/bin/sh
# Build the Debian package of memtrace-bpf (CPack; the static memtrace-bpf and
# memtrace-singlestep, the track library and its header, --inject's agent
# library in /usr/lib/<arch>/memtrace-bpf/, under /usr):
#   scripts/package.sh [BUILD_DIR]      -> BUILD_DIR/memtrace-bpf_VERSION_amd64.deb
# Then: sudo apt install ./build/memtrace-bpf_*.deb
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
[ -f "$BUILD/CMakeCache.txt" ] || "$ROOT/scripts/build.sh"
cmake --build "$BUILD" -j"$(nproc)" --target memtrace-bpf memtrace-singlestep memtrace_track memtrace_track_shared memtrace_agent
cd "$BUILD"
rm -f memtrace-bpf_*.deb
cpack -G DEB >/dev/null
ls "$BUILD"/memtrace-bpf_*.deb
