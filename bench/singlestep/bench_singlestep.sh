#!/bin/sh
# Accesses captured per second: memtrace-singlestep (emulated moves, single-
# stepped SSE moves, hardware watchpoints) against seed 000's in-process design
# (bench/singlestep/inproc_tracker.c), 1 and 4 threads. Median of REPS runs.
# Usage: bench_singlestep.sh HELPER BENCH_TARGET [REPS] [ITERS]
set -eu
HELPER=$1 TARGET=$2 REPS=${3:-5} ITERS=${4:-20000}
JSON=$(mktemp)
trap 'rm -f $JSON' EXIT

# prints "rate captured performed" for one run
one() {
  kind=$1; threads=$2; shift 2
  PIN=${PIN:-}
  case $kind in
    inproc) out=$($PIN "$TARGET" --threads "$threads" --iters "$ITERS" --inproc "$@") ;;
    step)   out=$($PIN "$HELPER" --mode step --format json -o "$JSON" --symbol bench_region -- "$TARGET" --threads "$threads" --iters "$ITERS" "$@") ;;
    nosim)  out=$($PIN "$HELPER" --mode step --no-emulate --format json -o "$JSON" --symbol bench_region -- "$TARGET" --threads "$threads" --iters "$ITERS" "$@") ;;
    hw)     out=$($PIN "$HELPER" --mode hw --format json -o "$JSON" --symbol bench_word -- "$TARGET" --threads "$threads" --iters "$ITERS" --word "$@") ;;
  esac
  set -- $out
  performed=$2 secs=$4 captured=$6
  if [ "$kind" != inproc ]; then
    captured=$(python3 -c "import json;print(len(json.load(open('$JSON'))['accesses']))")
  fi
  python3 -c "print('%.0f %s %s' % ($captured/$secs, $captured, $performed))"
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "memtrace-singlestep benchmark: $ITERS accesses per thread, median of $REPS runs"
for pin in "" "taskset -c 1"; do
PIN=$pin
echo "== ${pin:-not pinned (scheduler places helper and tracee)}"
for t in 1 4; do
  a=$(for i in $(seq "$REPS"); do one inproc $t | cut -d' ' -f1; done | median)
  b=$(for i in $(seq "$REPS"); do one step $t | cut -d' ' -f1; done | median)
  c=$(for i in $(seq "$REPS"); do one nosim $t | cut -d' ' -f1; done | median)
  d=$(for i in $(seq "$REPS"); do one step $t --sse | cut -d' ' -f1; done | median)
  e=$(for i in $(seq "$REPS"); do one hw $t | cut -d' ' -f1; done | median)
  ex_in=$(one inproc $t); ex_st=$(one step $t)
  echo "threads=$t"
  printf "  %-40s %10s acc/s  exactness (captured/performed): %s\n" "in-process seed-000 design" "$a" "$(echo $ex_in | awk '{print $2"/"$3}')"
  printf "  %-40s %10s acc/s  ratio %.2fx  exactness: %s\n" "helper, emulated mov" "$b" "$(echo "$b/$a" | bc -l)" "$(echo $ex_st | awk '{print $2"/"$3}')"
  printf "  %-40s %10s acc/s  ratio %.2fx\n" "helper, single-step every access" "$c" "$(echo "$c/$a" | bc -l)"
  printf "  %-40s %10s acc/s  ratio %.2fx\n" "helper, SSE movdqu (single-stepped)" "$d" "$(echo "$d/$a" | bc -l)"
  printf "  %-40s %10s acc/s  ratio %.2fx\n" "helper, hardware watchpoint (8-byte word)" "$e" "$(echo "$e/$a" | bc -l)"
done
done
