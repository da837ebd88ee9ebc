#!/bin/sh
# A 2-job C++ build traced system-wide for its whole length (issue 18's and
# 17's target): this project's C++ libraries compiled by make -j2 from a
# fresh build directory (g++/cc1plus, templates, nlohmann-json), untraced
# first, then under `memtrace-bpf` system-wide. Prints the build times, the
# share of allocation stacks captured complete (not cut by the depth limit,
# a missing table or a bad frame), the unwinder's truncations by reason,
# every drop counter that is not zero, table failures, errors and the tool's
# memory. A known program (tests/targets/alloc_rounds, --rounds 0 and
# --rounds $KNOWN_ROUNDS) runs once the build is $KNOWN_AFTER s in: its
# counts must be exact and its leak stacks complete through main. KEEP=FILE
# keeps the JSON report.
#   bench/unwind/cxx_build.sh [BUILD_DIR] [TARGETS...]     (root)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
[ $# -gt 0 ] && shift
TARGETS=${*:-memtrace_symbolize memtrace_unwind memtrace_heap memtrace_report memtrace_probes}
TOOL=$BUILD/src/loader/memtrace-bpf
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
build() {  # a fresh tree each time: every file compiled
  rm -rf "$TMP/b"
  cmake -S "$ROOT" -B "$TMP/b" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  start=$(date +%s.%N)
  make -C "$TMP/b" -j2 $TARGETS >/dev/null 2>&1
  echo "$(date +%s.%N) - $start" | bc
}
plain=$(build)
rm -rf "$TMP/b"
cmake -S "$ROOT" -B "$TMP/b" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
"$TOOL" -o "$TMP/r.json" 2>"$TMP/tool.err" &
tool=$!
while ! grep -q tracing "$TMP/tool.err" 2>/dev/null; do sleep 0.1; done
start=$(date +%s.%N)
known() {  # the known program, in the middle of the build
  sleep "${KNOWN_AFTER:-60}"
  for r in 0 "${KNOWN_ROUNDS:-200}"; do
    "$BUILD/tests/targets/alloc_rounds" --rounds "$r" >"$TMP/known.$r" &
    echo $! >"$TMP/known.$r.pid"
    wait $!
  done
}
known &
kpid=$!
make -C "$TMP/b" -j2 $TARGETS >/dev/null 2>&1
traced=$(echo "$(date +%s.%N) - $start" | bc)
wait $kpid
kill -INT $tool
wait $tool || true
[ -n "$KEEP" ] && cp "$TMP/r.json" "$KEEP"
python3 - "$TMP/r.json" "$plain" "$traced" "$TMP/tool.err" "$TMP" "${KNOWN_ROUNDS:-200}" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s, dr = d["stats"], d["dropped"]
plain, traced = float(sys.argv[2]), float(sys.argv[3])
tmp, rounds = sys.argv[5], int(sys.argv[6])
print(f"build: untraced {plain:.1f} s, traced system-wide {traced:.1f} s ({traced / plain:.2f}x)")
n = s.get("unwind_stacks", 0)
cut = {k[len("unwind_trunc_"):]: v for k, v in s.items() if k.startswith("unwind_trunc_") and v}
total_cut = sum(cut.values())
print(f"stacks unwound: {n:,}; complete: {100.0 * (n - total_cut) / max(n, 1):.2f}%; cut: {cut}")
print(f"events: {s.get('events', 0):,}; processes reported: {len(d['processes'])}")
print("dropped (non-zero):", {k: v for k, v in dr.items() if v} or "none")
print("unwind tables: files", s.get("unwind_files"), "shards", s.get("unwind_shards"),
      "peak MiB", round(s.get("unwind_table_peak_bytes", 0) / 2**20, 1), "build ms", s.get("unwind_table_build_ms"))
print(f"tool: RSS {s.get('tool_rss_kb', 0) / 1024:.0f} MiB, anon {s.get('tool_anon_kb', 0) / 1024:.0f} MiB")
print("errors:", len(d.get("errors", [])), d.get("errors", [])[:3])
print("rows found through VMAs (no published mapping yet):", s.get("unwind_rows_from_vma"),
      "; mappings_not_captured:", s.get("mappings_not_captured"),
      "; rebuilt from the kernel's records:", s.get("mappings_from_kernel"),
      "(unresolved", str(s.get("mappings_from_kernel_unresolved")) + ")")
# The known program: counts exact, leak stacks complete through main.
def proc(r):  # the image of alloc_rounds (the pid's first image is the shell's fork)
    pid = int(open(f"{tmp}/known.{r}.pid").read())
    return next((p for p in d["processes"] if p["pid"] == pid and p["comm"] == "alloc_rounds"), None)
per = dict(w.split("=") for w in open(f"{tmp}/known.{rounds}").read().split() if "=" in w)
p0, p1 = proc(0), proc(rounds)
want = {"allocs": rounds * int(per["allocs"]), "frees": rounds * int(per["frees"]),
        "bytes_allocated": rounds * int(per["bytes"])}
got = {k: p1["summary"][k] - p0["summary"][k] for k in want} if p0 and p1 else None
leaks = p1.get("leaks", []) if p1 else []
whole = sum(1 for l in leaks if not l.get("stack_truncated") and any(f.get("function") == "main" for f in l["stack"]))
print(f"known program (alloc_rounds, {rounds} rounds, in the middle): "
      f"{'EXACT' if got == want else 'WRONG'} got {got} want {want}; leak stacks through main {whole} of {len(leaks)}")
PY
