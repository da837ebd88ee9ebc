#!/bin/sh
# run_fuzz.sh SOURCE_DIR BUILD_DIR CLANGXX SECONDS [LIBFUZZER_ARGS...]
# Builds the libFuzzer target for the recording reader (fuzz_recording.cpp:
# `replay` on the input) with clang -fsanitize=fuzzer,address,undefined in its
# own directory and runs it for SECONDS on the seed corpus
# (tests/loader/fuzz/corpus: small real recordings; with KEEP_CORPUS=1, also
# what earlier runs in BUILD_DIR added to it: longer runs go deeper, but the
# time to replay the corpus first grows). Fails on any finding; the input
# that found it is left in BUILD_DIR/artifacts. SECONDS 0: build only.
# FUZZ_SOURCES: the file CMake wrote with what it links (memtrace_replay's
# sources and its libraries', the generated html_assets.cpp among them;
# cmake/fuzz_sources.cmake): no second list here.
set -eu
src=$1 build=$2 cxx=$3 secs=$4
shift 4
here=$src/tests/loader/fuzz
list=${FUZZ_SOURCES:?the list of sources CMake wrote, BUILD/tests/loader/fuzz-sources.txt}
mkdir -p "$build/corpus" "$build/artifacts" "$build/obj"
# What replay_recording runs, and what it links against.
srcs="$here/fuzz_recording.cpp $(cat "$list")"
for f in $srcs; do
  [ -f "$f" ] || { echo "run_fuzz.sh: $f (listed in $list) is missing: build the project first" >&2; exit 1; }
done
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
  "$cxx" -fsanitize=fuzzer,address,undefined -o "$bin.tmp" $(for f in $srcs; do obj "$f"; done) -lbpf -ldw -lelf -lcapstone -llzma -lz -ldl
  mv "$bin.tmp" "$bin"
fi
[ "$secs" -gt 0 ] || exit 0
[ "${KEEP_CORPUS:-0}" = 1 ] || rm -rf "$build/corpus"
mkdir -p "$build/corpus"
cp -f "$here"/corpus/* "$build/corpus/"
cd "$build"
exec ./fuzz_recording -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -artifact_prefix=artifacts/ -print_final_stats=1 "$@" corpus
