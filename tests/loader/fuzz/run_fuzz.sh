#!/bin/sh
# run_fuzz.sh SOURCE_DIR BUILD_DIR CLANGXX SECONDS [LIBFUZZER_ARGS...]
# Builds the libFuzzer target for the recording reader (fuzz_recording.cpp:
# `replay` on the input) with clang -fsanitize=fuzzer,address,undefined in its
# own directory and runs it for SECONDS on the seed corpus
# (tests/loader/fuzz/corpus: small real recordings; with KEEP_CORPUS=1, also
# what earlier runs in BUILD_DIR added to it: longer runs go deeper, but the
# time to replay the corpus first grows). Fails on any finding; the input
# that found it is left in BUILD_DIR/artifacts. SECONDS 0: build only.
# MEMTRACE_HTML_ASSETS: the build's generated src/report/html/html_assets.cpp.
set -eu
src=$1 build=$2 cxx=$3 secs=$4
shift 4
here=$src/tests/loader/fuzz
mkdir -p "$build/corpus" "$build/artifacts" "$build/obj"
# What replay_recording runs, and what it links against.
srcs="$here/fuzz_recording.cpp
$src/src/loader/replay.cpp $src/src/loader/recording.cpp $src/src/loader/features.cpp
$src/src/loader/resolver.cpp $src/src/loader/procfs.cpp $src/src/loader/output_file.cpp
$src/src/heap/heap_model.cpp $src/src/heap/analyses.cpp $src/src/heap/ended.cpp $src/src/report/report.cpp $src/src/report/outputs.cpp $src/src/report/folded.cpp
$src/src/report/pprof.cpp $src/src/report/diff.cpp $src/src/report/html.cpp ${MEMTRACE_HTML_ASSETS:?the page of the HTML report, html_assets.cpp of the build} $src/src/elf/elf_file.cpp
$src/src/elf/image.cpp $src/src/symbolize/symbolize.cpp $src/src/procfs/proc_maps.cpp $src/src/symbolize/symbol_table.cpp
$src/src/symbolize/dwarf_index.cpp $src/src/symbolize/debug_finder.cpp $src/src/symbolize/module.cpp
$src/src/symbolize/minidebuginfo.cpp $src/src/symbolize/debuginfod.cpp $src/src/symbolize/call_site.cpp"
obj() { echo "$build/obj/$(echo "$1" | tr / _).o"; }
# An object is stale when its source, or any header, is newer (2 compiles at a time).
stale=""
for f in $srcs; do
  o=$(obj "$f")
  if [ ! -f "$o" ] || [ "$f" -nt "$o" ] ||
     [ -n "$(find "$src/src" "$src/bpf/memtrace.h" -name '*.h' -newer "$o" | head -1)" ]; then
    stale="$stale $f"
  fi
done
bin=$build/fuzz_recording
if [ -n "$stale" ] || [ ! -x "$bin" ]; then
  export cxx build
  export flags="-std=c++20 -g -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                -I$src/src -I$src/bpf"
  # shellcheck disable=SC2016
  [ -z "$stale" ] || echo "$stale" | xargs -P 2 -n 1 sh -c \
    'o="$build/obj/$(echo "$1" | tr / _).o"; $cxx $flags -c "$1" -o "$o.tmp" && mv "$o.tmp" "$o"' sh
  # shellcheck disable=SC2046
  "$cxx" -fsanitize=fuzzer,address,undefined -o "$bin.tmp" $(for f in $srcs; do obj "$f"; done) -ldw -lelf -llzma -lz -ldl
  mv "$bin.tmp" "$bin"
fi
[ "$secs" -gt 0 ] || exit 0
[ "${KEEP_CORPUS:-0}" = 1 ] || rm -rf "$build/corpus"
mkdir -p "$build/corpus"
cp -f "$here"/corpus/* "$build/corpus/"
cd "$build"
exec ./fuzz_recording -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -artifact_prefix=artifacts/ -print_final_stats=1 "$@" corpus
