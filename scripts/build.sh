#!/bin/sh
# Configure and build into build/ (RelWithDebInfo). Used by demo.sh and test.sh.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$ROOT" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMTRACE_EXTRA_CMAKE= >/dev/null
cmake --build "$ROOT/build" -j"$(nproc)"
