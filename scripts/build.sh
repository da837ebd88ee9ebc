#!/bin/sh
# Configure and build into build/ (RelWithDebInfo). Used by demo.sh and test.sh.
# MEMTRACE_WERROR=ON in the environment: compiler warnings are errors
# (scripts/test.sh sets it under CI=true); unset, a build without.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$ROOT" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMTRACE_EXTRA_CMAKE= \
  -DMEMTRACE_WERROR="${MEMTRACE_WERROR:-OFF}" >/dev/null
cmake --build "$ROOT/build" -j"$(nproc)"
