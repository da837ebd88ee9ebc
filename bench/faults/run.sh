#!/bin/sh
# Cost of --faults for a process that is NOT traced (issue 6): an unrelated
# page-fault loop (bench/faults/fault_loop.c, 64 MiB x 20 rounds = 327,680
# faults) timed untraced, with `memtrace-bpf --faults -c nosuchcomm` running,
# and with `memtrace-bpf -c nosuchcomm` (no --faults). Runs interleaved,
# prints every ns/fault and the medians and ratios.
#
#   sudo bench/faults/run.sh [BUILD_DIR] [RUNS]
set -eu
BUILD=${1:-build}
RUNS=${2:-7}
TOOL=$BUILD/src/loader/memtrace-bpf
DIR=$(dirname "$0")
LOOP=$(mktemp /tmp/fault_loop.XXXXXX)
cc -O2 -o "$LOOP" "$DIR/fault_loop.c"
trap 'rm -f "$LOOP"' EXIT

one() { taskset -c 1 "$LOOP" 64 20 | sed 's/.*ns_per_fault=//'; }

with_tool() { # args: tool options
  "$TOOL" --format json -o /dev/null "$@" -c nosuchcomm 2>/tmp/fault_bench_tool.err &
  tp=$!
  # wait until it traces (programs loaded and attached)
  for _ in $(seq 100); do grep -q tracing /tmp/fault_bench_tool.err 2>/dev/null && break; sleep 0.1; done
  v=$(one)
  kill -INT $tp; wait $tp || true
  echo "$v"
}

base=""; faults=""; nofaults=""
for i in $(seq "$RUNS"); do
  b=$(one); f=$(with_tool --faults); n=$(with_tool)
  echo "run $i: untraced $b ns/fault, --faults -c other $f, -c other (no --faults) $n"
  base="$base $b"; faults="$faults $f"; nofaults="$nofaults $n"
done
median() { echo "$@" | tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
mb=$(median $base); mf=$(median $faults); mn=$(median $nofaults)
echo "median ns/fault: untraced $mb, --faults -c other $mf, -c other $mn"
awk -v b="$mb" -v f="$mf" -v n="$mn" 'BEGIN {printf "ratio --faults/untraced %.3f, no-faults/untraced %.3f\n", f/b, n/b}'
