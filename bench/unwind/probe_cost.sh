#!/bin/sh
# Per-allocation cost of stacks in memtrace-bpf: CFI vs frame pointers vs no
# stacks, from stats.launched_traced_us (traced run time of the launched
# program), median of REPS runs per mode (modes interleaved, the VM is noisy).
# With --bpftool, also the BPF programs' own run time per call
# (kernel.bpf_stats_enabled; bpftool prog show, sampled just before exit).
#   bench/unwind/probe_cost.sh [BUILD_DIR] [REPS] [--bpftool] -- CMD...
# e.g. bench/unwind/probe_cost.sh build 15 -- /usr/bin/python3 -c 'print(1)'
#      PYTHONMALLOC=malloc bench/unwind/probe_cost.sh build 5 --bpftool -- \
#          /usr/bin/python3 bench/workloads/w1_json_dicts.py
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}; shift || true
REPS=${1:-11}; shift || true
BPFTOOL=0
[ "$1" = "--bpftool" ] && { BPFTOOL=1; shift; }
[ "$1" = "--" ] && shift
TOOL=$BUILD/src/loader/memtrace-bpf
TMP=$(mktemp -d)
SAMPLER=
trap '[ -n "$SAMPLER" ] && kill $SAMPLER 2>/dev/null; rm -rf "$TMP"' EXIT
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
[ $BPFTOOL = 1 ] && sysctl -q kernel.bpf_stats_enabled=1
for r in $(seq "$REPS"); do
  for mode in cfi fp none; do
    case $mode in
      cfi) opt="--unwind cfi" ;; fp) opt="--unwind fp" ;; none) opt="--no-stacks" ;;
    esac
    if [ $BPFTOOL = 1 ]; then
      ( while :; do bpftool prog show -j > "$TMP/p.new" 2>/dev/null &&
          grep -q mt_alloc_enter "$TMP/p.new" && mv "$TMP/p.new" "$TMP/progs.$mode.$r"; sleep 0.05; done ) &
      SAMPLER=$!
    fi
    "$TOOL" $opt --format json -o "$TMP/r.$mode.$r.json" -- "$@" >/dev/null 2>"$TMP/err" ||
      { echo "run $r $mode failed: $(tail -1 "$TMP/err")" >&2; rm -f "$TMP/r.$mode.$r.json"; }
    if [ $BPFTOOL = 1 ]; then kill $SAMPLER; wait $SAMPLER 2>/dev/null || true; fi
  done
done
[ $BPFTOOL = 1 ] && sysctl -q kernel.bpf_stats_enabled=0
python3 - "$TMP" "$REPS" <<'PY'
import json, sys, glob, statistics as st
tmp, reps = sys.argv[1], int(sys.argv[2])
res = {}
for mode in ("cfi", "fp", "none"):
    us, allocs, prog = [], [], {}
    for r in range(1, reps + 1):
        try:
            d = json.load(open(f"{tmp}/r.{mode}.{r}.json"))
        except OSError:
            continue
        us.append(d["stats"]["launched_traced_us"])
        allocs.append(sum(p["summary"]["allocs"] for p in d["processes"]))
        try:
            for p in json.load(open(f"{tmp}/progs.{mode}.{r}")):
                if p.get("name") in ("mt_alloc_enter", "mt_alloc_exit") and p.get("run_cnt"):
                    a = prog.setdefault(p["name"], [0, 0])
                    a[0] += p["run_time_ns"]; a[1] += p["run_cnt"]
        except (OSError, ValueError):
            pass
    res[mode] = (st.median(us), st.median(allocs), prog)
    line = f"{mode:5s} traced_us median {st.median(us):9.0f} (min {min(us)}, max {max(us)}) allocs {st.median(allocs):.0f}"
    for n, (t, c) in sorted(prog.items()):
        line += f"  {n} {t / c:.0f} ns/call ({c // reps} calls)"
    print(line)
n = res["none"][1]
for mode in ("cfi", "fp"):
    print(f"{mode} over no-stacks: {(res[mode][0] - res['none'][0]) / n:.2f} us/alloc")
print(f"cfi over fp: {(res['cfi'][0] - res['fp'][0]) / n:.2f} us/alloc")
PY
