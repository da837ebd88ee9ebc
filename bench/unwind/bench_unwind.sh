#!/bin/sh
# Unwinder bench: for python3 (W1, PYTHONMALLOC=malloc), sqlite3 (W3) and git,
# the share of allocation stacks that reach main (or a thread start routine),
# why the others stopped, table memory, and the BPF probe's average run time
# with CFI unwinding vs frame pointers only.
#   bench/unwind/bench_unwind.sh [BUILD_DIR]     (root; default build)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
BENCH=$BUILD/tests/unwind/unwind_bench
[ -x "$BENCH" ] || cmake --build "$BUILD" --target unwind_bench -j2 >/dev/null
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
command -v git >/dev/null || { apt-get install -y git >/dev/null; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 "$ROOT/bench/workloads/w3_gen_sql.py" "$TMP/w3.sql" 20000
cat > "$TMP/w1_small.py" <<'PY'
import json
data = [{"id": i, "name": "item%d" % i, "tags": ["a", "b", str(i)], "score": i * 0.5} for i in range(20000)]
s = json.dumps(data)
back = json.loads(s)
assert len(back) == len(data)
PY
export PYTHONMALLOC=malloc
for mode in "" --fp; do
  # sh execs the program in the same pid (the probe and tables follow the
  # exec); its output goes to /dev/null.
  Q='exec "$0" "$@" >/dev/null'
  "$BENCH" $mode -- sh -c "$Q" /usr/bin/python3.11 "$TMP/w1_small.py"
  "$BENCH" $mode -- sh -c "$Q" /usr/bin/sqlite3 :memory: ".read $TMP/w3.sql"
  "$BENCH" $mode -- sh -c "$Q" /usr/bin/git -C "$ROOT" log --stat -n 300 --format=%H%n%an%n%s
done
