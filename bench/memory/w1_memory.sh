#!/bin/sh
# The tool's memory against the number of events (issue 19: "memory of the
# tool does not grow with the number of events, only with live blocks and
# distinct stacks"). W1 (PYTHONMALLOC=malloc python3, dicts round-tripped
# through json: bench/workloads/w1_json_dicts.py) traced with every output on
# (-o r.json -o r.html -o r.pb.gz -o r.folded), two ways:
#   dicts  N = 1x, 4x, 16x 50,000 dicts, one round trip: events and live
#          blocks both grow with N;
#   rounds 50,000 dicts, the round trip 1, 4, 16 times, each round's objects
#          freed before the next: events grow, the live blocks stay.
# The tool runs with -c on a name of its own (a symlink to python3 called
# w1py), so the traced program is not its child: /usr/bin/time's maximum
# RSS is the tool's own, report writing included. Per run: events, the
# program's peak in use, what the heap model holds at the end (model_* STATS),
# the tool's peak RSS and its peak anonymous memory (sampled every 0.1 s;
# RSS also counts the rings, tool_rings_kb, mapped by libbpf). Configurations
# are interleaved, REPS times; the table gives medians.
#   sudo bench/memory/w1_memory.sh [BUILD_DIR] [REPS] [SCALES]     (root)
#   SCALES: default "1 4 16"
# CURVE=DICTS:ROUNDS adds one run whose curve is printed every STEP seconds
# (default 2): events applied, the tool's RSS and anonymous memory, the
# program's bytes in use (--metrics, scraped on 127.0.0.1).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
REPS=${2:-3}
SCALES=${3:-1 4 16}
TOOL=$BUILD/src/loader/memtrace-bpf
W1=$ROOT/bench/workloads/w1_json_dicts.py
PY=$(readlink -f /usr/bin/python3)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
ln -s "$PY" "$TMP/w1py"   # comm "w1py": only this program is traced
unset DEBUGINFOD_URLS      # no helper process, no download

# run KIND N ROUNDS REP: one traced run, one result line on stdout.
run() {
  kind=$1 n=$2 rounds=$3 rep=$4
  d=$TMP/run
  rm -rf "$d" && mkdir -p "$d"
  /usr/bin/time -f %M -o "$d/maxrss" "$TOOL" -c w1py -o "$d/r.json" -o "$d/r.html" -o "$d/r.pb.gz" \
    -o "$d/r.folded" 2>"$d/tool.err" &
  tp=$!
  while ! grep -q "tracing" "$d/tool.err" 2>/dev/null; do sleep 0.1; done
  tool=$(pgrep -P $tp -x memtrace-bpf)
  # The tool's anonymous memory, sampled until it exits.
  ( max=0
    while a=$(awk '/^RssAnon/ {print $2}' /proc/$tool/status 2>/dev/null) && [ -n "$a" ]; do
      [ "$a" -gt "$max" ] && max=$a && echo $max > "$d/anon"
      sleep 0.1
    done ) &
  sampler=$!
  t0=$(date +%s.%N)
  PYTHONMALLOC=malloc "$TMP/w1py" "$W1" "$n" "$rounds"
  t1=$(date +%s.%N)
  kill -INT "$tool"
  wait $tp || true
  wait $sampler || true
  python3 - "$d" "$kind" "$n" "$rounds" "$rep" "$t0" "$t1" <<'PY'
import json, sys
d, kind, n, rounds, rep, t0, t1 = sys.argv[1:]
j = json.load(open(d + "/r.json"))
s = j["stats"]
ps = [p for p in j["processes"] if p["comm"] == "w1py"]
assert len(ps) == 1, [p["comm"] for p in j["processes"]]
sm = ps[0]["summary"]
lost = sum(v for v in j["dropped"].values())
print("\t".join(str(x) for x in [
    kind, n, rounds, rep, "%.1f" % (float(t1) - float(t0)), s["events"], sm["allocs"],
    sm["peak_in_use_bytes"] // (1 << 20), s["model_live_blocks"], s["model_stacks"], s["model_stack_entries"],
    int(open(d + "/maxrss").read().split()[-1]) // 1024, int(open(d + "/anon").read()) // 1024,
    s["tool_rings_kb"] // 1024, lost]))
PY
}

# curve DICTS ROUNDS: the tool's memory against the events over one run.
curve() {
  n=$1 rounds=$2
  d=$TMP/curve
  rm -rf "$d" && mkdir -p "$d"
  "$TOOL" -c w1py --metrics 127.0.0.1:0 -o "$d/r.json" -o "$d/r.html" -o "$d/r.pb.gz" -o "$d/r.folded" \
    2>"$d/tool.err" &
  tool=$!
  while ! grep -q "tracing" "$d/tool.err" 2>/dev/null; do sleep 0.1; done
  url=$(sed -n 's/.*metrics at \(http[^ ]*\).*/\1/p' "$d/tool.err")
  PYTHONMALLOC=malloc "$TMP/w1py" "$W1" "$n" "$rounds" &
  prog=$!
  echo "# curve: $n dicts x $rounds rounds, every ${STEP:-2} s"
  printf "seconds\tevents\ttool_rss_mib\ttool_anon_mib\tprogram_in_use_mib\n"
  t0=$(date +%s.%N)
  while kill -0 $prog 2>/dev/null; do
    anon=$(awk '/^RssAnon/ {print int($2 / 1024)}' /proc/$tool/status)
    curl -s "$url" | awk -v t="$(echo "$(date +%s.%N) - $t0" | bc)" -v anon="$anon" '
      /^memtrace_events_total / {ev = $2}
      /^memtrace_tool_resident_bytes / {rss = $2}
      /^memtrace_heap_in_use_bytes.*comm="w1py"/ {use = $2}
      END {printf "%.0f\t%d\t%d\t%d\t%d\n", t, ev, rss / 1048576, anon, use / 1048576}'
    sleep "${STEP:-2}"
  done
  wait $prog || true
  kill -INT $tool
  wait $tool || true
}

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(uname -r) $(nproc) vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
HDR="kind\tdicts\trounds\trep\tseconds\tevents\tallocs\tpeak_in_use_mib\tmodel_live_blocks\tmodel_stacks\tmodel_stack_entries\ttool_peak_rss_mib\ttool_peak_anon_mib\trings_mib\tdropped"
printf "$HDR\n" | tee "$TMP/all.tsv"
rep=1
while [ $rep -le "$REPS" ]; do
  for s in $SCALES; do
    run dicts $((50000 * s)) 1 $rep | tee -a "$TMP/all.tsv"
    [ "$s" = 1 ] || run rounds 50000 "$s" $rep | tee -a "$TMP/all.tsv"
  done
  rep=$((rep + 1))
done
if [ -n "${CURVE:-}" ]; then
  echo
  curve "${CURVE%%:*}" "${CURVE##*:}"
fi
echo
echo "# medians over $REPS runs (rounds x1 is dicts x1)"
python3 - "$TMP/all.tsv" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
head, rows = rows[0], rows[1:]
groups = {}
for r in rows:
    groups.setdefault((r[0], int(r[1]), int(r[2])), []).append(r)
cols = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
print("\t".join(["kind", "dicts", "rounds"] + [head[c] for c in cols]))
for k in sorted(groups, key=lambda k: (k[0], k[1] * k[2])):
    g = groups[k]
    med = [statistics.median(float(r[c]) for r in g) for c in cols]
    print("\t".join([k[0], str(k[1]), str(k[2])] + ["%.1f" % med[0]] + ["%d" % v for v in med[1:]]))
PY
