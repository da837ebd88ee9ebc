#!/bin/sh
# Unwinding on the largest binaries on this machine (issue 18): clang-14
# (libLLVM + libclang-cpp, ~2M CFI rows), cc1plus (g++'s compiler proper),
# python3 and gdb. Per program (bench/unwind/unwind_bench): the share of
# allocation stacks that reach main or a thread start, truncated stacks,
# table rows and bytes, and N samples of gdb's `bt` at libc malloc compared
# frame for frame with the stacks the BPF unwinder captured; per file: its
# table's rows, bytes and build time. Then memtrace-bpf itself on clang:
# table build/load time and the launch-to-traced time.
#   bench/unwind/big_binaries.sh [BUILD_DIR] [GDB_SAMPLES]     (root)
# Nothing else may trace the machine meanwhile: a uprobe on malloc takes the
# trap before gdb's breakpoint at the same address, and gdb sees no stop.
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
N=${2:-20}
BENCH=$BUILD/tests/unwind/unwind_bench
TOOL=$BUILD/src/loader/memtrace-bpf
[ -x "$BENCH" ] || cmake --build "$BUILD" --target unwind_bench -j2 >/dev/null
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
for p in clang-14 gdb; do command -v $p >/dev/null || apt-get install -y -q $p >/dev/null; done
CC1PLUS=$(g++ -print-prog-name=cc1plus)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A real C++ translation unit: this project's heap model, preprocessed once.
g++ -std=gnu++20 -I"$ROOT/src" -I"$ROOT/bpf" -E "$ROOT/src/heap/heap_model.cpp" -o "$TMP/hm.ii"
cat > "$TMP/f.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
struct node { struct node *next; char name[32]; };
static struct node *push(struct node *h, const char *s) {
  struct node *n = malloc(sizeof *n); strncpy(n->name, s, sizeof n->name - 1); n->next = h; return n; }
int main(int argc, char **argv) { struct node *h = 0; for (int i = 0; i < argc * 100; i++) h = push(h, argv[0]);
  while (h) { struct node *n = h->next; printf("%s\n", h->name); free(h); h = n; } return 0; }
C
cat > "$TMP/w1.py" <<'PY'
import json
data = [{"id": i, "name": "item%d" % i, "tags": ["a", "b", str(i)]} for i in range(20000)]
assert len(json.loads(json.dumps(data))) == len(data)
PY
export PYTHONMALLOC=malloc
echo "== per program (unwind_bench --gdb $N --tables)"
"$BENCH" --gdb "$N" --tables -- clang-14 -O2 -c "$TMP/f.c" -o "$TMP/f.o"
"$BENCH" --gdb "$N" --tables -- "$CC1PLUS" -fpreprocessed -std=gnu++20 -quiet -O2 "$TMP/hm.ii" -o "$TMP/hm.s"
"$BENCH" --gdb "$N" --tables -- /usr/bin/python3.11 "$TMP/w1.py"
"$BENCH" --gdb "$N" --tables -- gdb -nx -batch -ex 'info functions ^main$' /usr/bin/gdb
echo "== memtrace-bpf -- clang-14 -O2 -c f.c (3 runs)"
for i in 1 2 3; do
  "$TOOL" --format json -o "$TMP/r.json" -- clang-14 -O2 -c "$TMP/f.c" -o "$TMP/f.o" >/dev/null 2>"$TMP/err"
  grep -i unwind "$TMP/err" || true
  python3 - "$TMP/r.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
st, dr = s["stats"], s["dropped"]
print(json.dumps({k: st.get(k) for k in ("unwind_stacks", "stack_truncated", "unwind_shards", "unwind_table_peak_bytes",
                                          "unwind_table_build_ms", "unwind_table_load_ms", "launched_traced_us")}
                 | {k: dr.get(k) for k in ("unwind_table_failed", "unwind_table_over_cap")}))
PY
done
