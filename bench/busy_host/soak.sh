#!/bin/sh
# Soak (issue 17): memtrace-bpf system-wide for SECONDS while two gcc loops
# compile and an allocation storm runs at a fixed rate; the tool's RSS and
# anonymous memory sampled every STEP seconds (the curve), then the final
# report's drops and what the heap model holds (model_* STATS).
#   bench/busy_host/soak.sh [BUILD_DIR] [SECONDS] [STEP]      (root)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
SECS=${2:-600}
STEP=${3:-30}
TOOL=$BUILD/src/loader/memtrace-bpf
STORM=$BUILD/tests/targets/alloc_storm
TMP=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$TMP"' EXIT
printf '#include <stdio.h>\n#include <stdlib.h>\nint main(void){char*p=malloc(64);puts(p?"ok":"no");free(p);return 0;}\n' > "$TMP/f.c"
"$TOOL" --duration "$SECS" -o "$TMP/r.json" 2>"$TMP/tool.err" &
tool=$!
while ! grep -q tracing "$TMP/tool.err" 2>/dev/null; do sleep 0.1; done
end=$(( $(date +%s) + SECS ))
for j in 1 2; do ( while [ "$(date +%s)" -lt $end ]; do gcc -O2 -c "$TMP/f.c" -o "$TMP/f$j.o"; done ) & done
"$STORM" --seconds "$SECS" --rate 100000 >/dev/null &
echo "seconds rss_mib anon_mib"
t=0
while kill -0 $tool 2>/dev/null && [ $t -le "$SECS" ]; do
  rss=$(awk '/^VmRSS/ {print int($2/1024)}' /proc/$tool/status 2>/dev/null || echo -)
  anon=$(awk '/^RssAnon/ {print int($2/1024)}' /proc/$tool/status 2>/dev/null || echo -)
  echo "$t $rss $anon"
  sleep "$STEP"; t=$((t + STEP))
done
wait $tool || true
python3 - "$TMP/r.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["stats"]
print("dropped (non-zero):", {k: v for k, v in d["dropped"].items() if v} or "none")
print("events:", s.get("events"), "images reported:", len(d["processes"]))
print({k: v for k, v in s.items() if k.startswith("model_") or k.startswith("tool_")})
PY
