#!/bin/sh
# One traced W1 run in one mode, with the allocator probe's own cost:
# launched_traced_us and mt_alloc_enter run_time_ns/run_cnt (bpf_stats,
# bpftool sampled every 50 ms, last sample before exit), plus the unwind
# counters. For quick A/B of BPF unwinder variants (one mode, ~10 s).
#   bench/unwind/enter_ns.sh [BUILD_DIR] [MODE_OPTS...]   e.g. build --unwind cfi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}; shift || true
[ $# -gt 0 ] || set -- --unwind cfi
TMP=$(mktemp -d)
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
sysctl -q kernel.bpf_stats_enabled=1
( while :; do bpftool prog show -j > "$TMP/p.new" 2>/dev/null && grep -q mt_alloc_enter "$TMP/p.new" &&
    mv "$TMP/p.new" "$TMP/progs.json"; sleep 0.05; done ) &
S=$!
trap 'kill $S 2>/dev/null; rm -rf "$TMP"' EXIT
PYTHONMALLOC=malloc "$BUILD/src/loader/memtrace-bpf" "$@" --format json -o "$TMP/r.json" -- \
  /usr/bin/python3 "$ROOT/bench/workloads/w1_json_dicts.py" >/dev/null 2>"$TMP/err" || cat "$TMP/err" >&2
kill $S; wait $S 2>/dev/null
sysctl -q kernel.bpf_stats_enabled=0
python3 - "$TMP" <<'PY'
import json, sys
t = sys.argv[1]
d = json.load(open(f"{t}/r.json")); p = json.load(open(f"{t}/progs.json"))
e = [x for x in p if x.get("name") == "mt_alloc_enter"][0]
print("traced_us", d["stats"]["launched_traced_us"], "mt_alloc_enter ns/call", e["run_time_ns"] // e["run_cnt"])
print({k: v for k, v in d["stats"].items() if k.startswith("unwind_") and v})
PY
