#!/bin/sh
# A 2-job C++ build traced system-wide for its whole length (issue 18's and
# 17's target): this project's C++ libraries compiled by make -j2 from a
# fresh build directory (g++/cc1plus, templates, nlohmann-json), untraced
# first, then under `memtrace-bpf` system-wide. Prints the build times, the
# share of allocation stacks captured complete (not cut by the depth limit,
# a missing table or a bad frame), the unwinder's truncations by reason,
# every drop counter that is not zero, table failures, errors and the tool's
# memory.
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
make -C "$TMP/b" -j2 $TARGETS >/dev/null 2>&1
traced=$(echo "$(date +%s.%N) - $start" | bc)
kill -INT $tool
wait $tool || true
python3 - "$TMP/r.json" "$plain" "$traced" "$TMP/tool.err" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s, dr = d["stats"], d["dropped"]
plain, traced = float(sys.argv[2]), float(sys.argv[3])
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
PY
