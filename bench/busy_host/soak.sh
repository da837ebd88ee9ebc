#!/bin/sh
# Soak (issue 17): memtrace-bpf system-wide for SECONDS over a host's worst
# churn, its RSS sampled every second:
#   - two gcc loops (gcc, cc1, as, collect2, ld: thousands of short images);
#   - a fork storm (fork_storm: children that allocate and exit; the pids
#     wrap around pid_max, so pids are reused while the tool runs);
#   - an exec storm (sh -c 'exec /bin/true': processes that are gone before
#     or while the tool reads them);
#   - wrapper chains (sh -> env -> sh -> alloc_rounds, as pyenv shims and
#     npm scripts do: one image per exec);
#   - a 4-thread allocator stress with frees on other threads, and a paced
#     single-thread storm.
# In the middle a known program (alloc_rounds, copied as known_rounds so
# that no other image shares its name) runs twice, --rounds 0 and --rounds
# ROUNDS: the difference of its two reports must be exactly ROUNDS x its
# per-round counts, however busy the host.
#   bench/busy_host/soak.sh [BUILD_DIR] [SECONDS] [ROUNDS] [RSS_TSV]   (root)
# Prints the RSS curve (every 30 s; every second in RSS_TSV), the drops,
# the model's size at the end and the known program's check.
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
SECS=${2:-600}
ROUNDS=${3:-200}
TOOL=$BUILD/src/loader/memtrace-bpf
T=$BUILD/tests/targets
TMP=$(mktemp -d)
TSV=${4:-$TMP/rss.tsv}
rc=1
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$TMP"; exit $rc' EXIT
printf '#include <stdio.h>\n#include <stdlib.h>\nint main(void){char*p=malloc(64);puts(p?"ok":"no");free(p);return 0;}\n' > "$TMP/f.c"
cp "$T/alloc_rounds" "$TMP/known_rounds"
"$TOOL" --duration "$SECS" -o "$TMP/r.json" 2>"$TMP/tool.err" &
tool=$!
while ! grep -q tracing "$TMP/tool.err" 2>/dev/null; do
  kill -0 $tool 2>/dev/null || { cat "$TMP/tool.err"; exit 1; }
  sleep 0.1
done
end=$(( $(date +%s) + SECS - 2 ))
loop() { ( while [ "$(date +%s)" -lt $end ]; do "$@" >/dev/null 2>&1 || true; done ) & }
loop gcc -O2 -c "$TMP/f.c" -o "$TMP/f1.o"
loop gcc -O2 -c "$TMP/f.c" -o "$TMP/f2.o"
loop "$T/fork_storm" 500
loop sh -c 'exec /bin/true'
loop sh -c "exec env sh -c 'exec $T/alloc_rounds --rounds 5'"
"$T/alloc_storm" --seconds $((SECS - 2)) --threads 4 --rate 40000 >/dev/null &
"$T/alloc_storm" --seconds $((SECS - 2)) --rate 50000 >/dev/null &
( sleep $((SECS / 2))
  "$TMP/known_rounds" --rounds 0 > "$TMP/k0.out" & echo $! > "$TMP/k0.pid"; wait
  "$TMP/known_rounds" --rounds "$ROUNDS" > "$TMP/k1.out" & echo $! > "$TMP/k1.pid"; wait ) &
echo "seconds rss_mib anon_mib" > "$TSV"
echo "seconds rss_mib anon_mib (every 30 s; every second in $TSV)"
start=$(date +%s)
shown=-30
while kill -0 $tool 2>/dev/null; do
  t=$(( $(date +%s) - start ))
  line=$(awk -v t=$t '/^VmRSS/ {r=int($2/1024)} /^RssAnon/ {a=int($2/1024)} END {print t, r, a}' /proc/$tool/status 2>/dev/null) || break
  [ -n "$line" ] && echo "$line" >> "$TSV"
  [ $t -ge $((shown + 30)) ] && { echo "$line"; shown=$t; }
  cpu=$(awk '{print ($14 + $15) / 100}' /proc/$tool/stat 2>/dev/null || echo "$cpu")
  sleep 1
done
wait $tool || true
echo "tool CPU: ${cpu} s (user+system, last sample)"
[ -n "$KEEP" ] && cp "$TMP/r.json" "$KEEP"
python3 - "$TMP" "$ROUNDS" "$TSV" <<'PY' && rc=0
import json, os, sys
tmp, rounds, tsv = sys.argv[1], int(sys.argv[2]), sys.argv[3]
d = json.load(open(os.path.join(tmp, "r.json")))
s = d["stats"]
rss = [int(l.split()[1]) for l in open(tsv).read().splitlines()[1:] if len(l.split()) == 3]
if rss:
    warm = rss[min(60, len(rss) - 1)]
    print(f"RSS MiB: max {max(rss)}, at 60 s {warm}, at the end {rss[-1]}")
print("dropped (non-zero):", {k: v for k, v in d["dropped"].items() if v} or "none")
print("events:", s.get("events"), "| entries reported:", len(d["processes"]),
      "| ended images merged:", s.get("model_merged_images"))
print({k: v for k, v in s.items() if k.startswith(("model_", "tool_", "resolver_", "mappings_"))})
per = {}
for tok in open(os.path.join(tmp, "k1.out")).read().split():
    if "=" in tok:
        k, v = tok.split("=")
        per[k] = int(v)
pids = [int(open(os.path.join(tmp, f)).read()) for f in ("k0.pid", "k1.pid")]
got = {}
for p in d["processes"]:
    if p["pid"] in pids and p["comm"] == "known_rounds" and p["ended"] != "merged":
        got[p["pid"]] = p["summary"]
if len(got) != 2:
    print(f"known program: FAIL, {len(got)} of its 2 runs reported (pids {pids})")
    sys.exit(1)
a, b = got[pids[0]], got[pids[1]]
want = {"allocs": per["allocs"], "frees": per["frees"], "bytes_allocated": per["bytes"],
        "in_use_blocks": per["leaked_blocks"], "in_use_bytes": per["leaked_bytes"]}
bad = {k: (b[k] - a[k], rounds * v) for k, v in want.items() if b[k] - a[k] != rounds * v}
print("known program:", "exact" if not bad else f"FAIL {bad}",
      f"({rounds} rounds: {b['allocs'] - a['allocs']} allocs, {b['in_use_bytes'] - a['in_use_bytes']} bytes leaked)")
sys.exit(1 if bad else 0)
PY
