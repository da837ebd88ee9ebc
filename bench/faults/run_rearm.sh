#!/bin/sh
# Cost of one re-armed page access (--rearm): rearm_sweep.c reads 256 pages
# per sweep, 20 sweeps 50 ms apart; the interval (10 ms) is shorter than the
# gap, so every access in a sweep is a first access. Compares the time per
# access: no tracer; memtrace-singlestep --rearm alone (SIGSEGV stop, one
# injected mprotect, resume); memtrace-bpf --faults --rearm (the same plus the
# BPF fault record). Helper and program on the same CPU (as DESIGN.md's
# ptrace figures), runs repeated, medians.
#
#   sudo bench/faults/run_rearm.sh [BUILD_DIR] [RUNS]
set -eu
BUILD=${1:-build}
RUNS=${2:-5}
TOOL=$BUILD/src/loader/memtrace-bpf
HELPER=$BUILD/src/singlestep-helper/memtrace-singlestep
DIR=$(dirname "$0")
PROG=$(mktemp /tmp/rearm_sweep.XXXXXX)
cc -O2 -o "$PROG" "$DIR/rearm_sweep.c"
FIFO=$(mktemp -u /tmp/rearm_fifo.XXXXXX)
trap 'rm -f "$PROG" "$FIFO"' EXIT

run() { # mode: none | helper | tool
  mkfifo "$FIFO"
  taskset -c 1 "$PROG" 256 20 50 < "$FIFO" > /tmp/rearm_out.$$ &
  pp=$!
  exec 3> "$FIFO"
  while ! grep -q range /tmp/rearm_out.$$; do sleep 0.05; done
  r=$(sed -n 's/^range //p' /tmp/rearm_out.$$)
  lo=${r%-*}; hi=${r#*-}
  case $1 in
    helper) taskset -c 1 "$HELPER" -p $pp --rearm 10 --addr $lo --len $(( hi - lo )) -o /dev/null &
            hp=$!; sleep 0.5 ;;
    tool)   taskset -c 1 "$TOOL" --format json -o /dev/null --faults -p $pp --rearm 10 --range $r 2>/tmp/rearm_tool.$$ &
            hp=$!; while ! grep -q tracing /tmp/rearm_tool.$$ 2>/dev/null; do sleep 0.05; done ;;
  esac
  echo go >&3; exec 3>&-
  wait $pp
  [ "$1" = none ] || wait $hp || true
  rm -f "$FIFO" /tmp/rearm_tool.$$
  sed -n 's/ns_per_access=//p' /tmp/rearm_out.$$; rm -f /tmp/rearm_out.$$
}
median() { echo "$@" | tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
A=""; B=""; C=""
for i in $(seq "$RUNS"); do
  a=$(run none); b=$(run helper); c=$(run tool)
  echo "run $i: ns/access none $a, helper --rearm $b, memtrace-bpf --faults --rearm $c"
  A="$A $a"; B="$B $b"; C="$C $c"
done
echo "median ns/access: none $(median $A), helper $(median $B), memtrace-bpf $(median $C)"
