#!/bin/sh
# Interleaved A/B of two memtrace-bpf builds on one workload: the traced
# program's run time (stats.launched_traced_us) and mt_alloc_enter's own
# run time per call (kernel.bpf_stats_enabled, bpftool sampled every 50 ms),
# runs alternating A, B, A, B... (this VM's speed drifts by minutes: only
# interleaved medians compare). Prints each run and the medians.
#   sudo bench/unwind/ab.sh BUILD_A BUILD_B [W1|W2|W3] [REPS] [-- MEMTRACE_OPTS...]
# e.g. build a variant:  cmake -S . -B build-x -DMEMTRACE_BPF_CFLAGS=-DMT_UNWIND_WIN_BYTES=8192
#                        cmake --build build-x --target memtrace-bpf -j2
#      then:             sudo bench/unwind/ab.sh build build-x W3 7
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
A=$1; B=$2; W=${3:-W1}; REPS=${4:-5}
shift 2; [ $# -gt 0 ] && shift; [ $# -gt 0 ] && shift
[ "$1" = "--" ] && shift
OPTS="$*"
TMP=$(mktemp -d)
SAMPLER=
trap '[ -n "$SAMPLER" ] && kill $SAMPLER 2>/dev/null; sysctl -q kernel.bpf_stats_enabled=0; rm -rf "$TMP"' EXIT
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
python3 "$ROOT/bench/workloads/w3_gen_sql.py" "$TMP/w3.sql" >/dev/null
cc -O2 -fno-builtin -o "$TMP/w2" "$ROOT/bench/workloads/w2_malloc_loop.c"
sysctl -q kernel.bpf_stats_enabled=1
one() { # BUILD -> "traced_us ns_per_call"
  b=$1; shift
  rm -f "$TMP/progs.json"
  ( while :; do bpftool prog show -j > "$TMP/p.new" 2>/dev/null && grep -q mt_alloc_enter "$TMP/p.new" &&
      mv "$TMP/p.new" "$TMP/progs.json"; sleep 0.05; done ) &
  SAMPLER=$!
  if [ "$W" = W1 ]; then
    PYTHONMALLOC=malloc "$b/src/loader/memtrace-bpf" $OPTS --format json -o "$TMP/r.json" -- \
      python3 "$ROOT/bench/workloads/w1_json_dicts.py" >/dev/null 2>&1
  elif [ "$W" = W2 ]; then
    "$b/src/loader/memtrace-bpf" $OPTS --format json -o "$TMP/r.json" -- "$TMP/w2" 2000000 >/dev/null 2>&1
  else
    "$b/src/loader/memtrace-bpf" $OPTS --format json -o "$TMP/r.json" -- sqlite3 :memory: ".read $TMP/w3.sql" >/dev/null 2>&1
  fi
  kill $SAMPLER; wait $SAMPLER 2>/dev/null || true; SAMPLER=
  python3 - "$TMP" <<'PY'
import json, sys
t = sys.argv[1]
d = json.load(open(f"{t}/r.json")); p = json.load(open(f"{t}/progs.json"))
e = [x for x in p if x.get("name") == "mt_alloc_enter"][0]
print(d["stats"]["launched_traced_us"], e["run_time_ns"] // max(e["run_cnt"], 1))
PY
}
for r in $(seq "$REPS"); do
  echo "A $(one "$A")"
  echo "B $(one "$B")"
done | tee "$TMP/runs"
python3 - "$TMP/runs" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    k, t, ns = line.split()
    runs.setdefault(k, []).append((int(t), int(ns)))
med = {k: (statistics.median(t for t, _ in v), statistics.median(n for _, n in v)) for k, v in runs.items()}
for k in sorted(med):
    print(f"{k}: traced {med[k][0] / 1e6:.3f} s (median)  mt_alloc_enter {med[k][1]:.0f} ns/call (median)")
print(f"B/A traced {med['B'][0] / med['A'][0]:.3f}  ns/call {med['B'][1] / med['A'][1]:.3f}")
PY
