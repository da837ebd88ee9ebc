#!/bin/sh
# One command from a fresh machine: install what is missing, build, and trace
# the demo program (leak report with call stacks).   sudo scripts/demo.sh
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo
echo "\$ sudo memtrace-bpf -- build/examples/memtrace-demo 1000"
exec $SUDO "$ROOT/build/src/loader/memtrace-bpf" -- "$ROOT/build/examples/memtrace-demo" 1000
