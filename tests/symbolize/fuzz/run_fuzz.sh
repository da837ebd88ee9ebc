#!/bin/sh
# run_fuzz.sh SOURCE_DIR BUILD_DIR CLANGXX SECONDS [FIXTURE_DIR]
# (FUZZ_SOURCES: the file of sources CMake wrote for it)
# Builds the libFuzzer target with clang -fsanitize=fuzzer,address in its own
# directory and runs it for SECONDS on a seed corpus of real ELF files
# (fixtures of this test suite, small system binaries). Fails on any finding.
set -eu
src=$1 build=$2 cxx=$3 secs=$4 fx=${5:-}
mkdir -p "$build/corpus" "$build/artifacts"
# Rebuild only when a source changed.
stamp=$build/fuzz_symbolize
# What the library is made of, as CMake wrote it (memtrace_symbolize's
# sources and its libraries'; cmake/fuzz_sources.cmake).
list=${FUZZ_SOURCES:?the list of sources CMake wrote, BUILD/tests/symbolize/fuzz-sources.txt}
libsrcs=$(cat "$list")
flags="-std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I$src/src"
# shellcheck disable=SC2046
if [ ! -x "$stamp" ] || [ "$list" -nt "$stamp" ] ||
   [ -n "$(find $(for f in $libsrcs; do dirname "$f"; done | sort -u) "$src/src/common" "$src/tests/symbolize/fuzz" \
           -newer "$stamp" -name '*.[ch]*' | head -1)" ]; then
  # The library's objects as the recording fuzzer built them (same flags,
  # tests/loader/fuzz/run_fuzz.sh, run first as a fixture) when they are
  # all there: ~30 s of compiling less in CI. Else compiled here.
  objs=""
  if [ -n "${FUZZ_OBJ_DIR:-}" ]; then
    for f in $libsrcs; do
      o="$FUZZ_OBJ_DIR/$(echo "$f" | tr / _).o"
      [ -f "$o" ] && [ "$o" -nt "$f" ] || { objs=""; break; }
      objs="$objs $o"
    done
  fi
  # shellcheck disable=SC2086
  if [ -n "$objs" ]; then
    "$cxx" $flags -o "$stamp.tmp" "$src/tests/symbolize/fuzz/fuzz_symbolize.cpp" $objs -ldw -lelf -llzma -lz -ldl
  else
    "$cxx" $flags -o "$stamp.tmp" "$src/tests/symbolize/fuzz/fuzz_symbolize.cpp" $libsrcs -ldw -lelf -llzma -lz -ldl
  fi
  mv "$stamp.tmp" "$stamp"
fi
# Seeds: small real ELF files (executables, a shared object, debug-only files).
# A shared object with MiniDebugInfo (.gnu_debugdata), made as Fedora does.
[ -f "$fx/libfxlib.so" ] && "$src/tests/symbolize/fixtures/make_minidebuginfo.sh" "$fx/libfxlib.so" \
  "$build/libfxlib.mini.so" || true
for f in /usr/bin/true /usr/lib/x86_64-linux-gnu/libdl.so.2 "$fx/libfxlib.so" "$fx/fx_O0_pie" \
         "$fx/fx_bid" "$fx/.debug/fx_dl.debug" "$build/libfxlib.mini.so"; do
  [ -f "$f" ] && cp -f "$f" "$build/corpus/seed_$(basename "$f")" || true
done
cd "$build"
exec ./fuzz_symbolize -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=300000 \
  -artifact_prefix=artifacts/ -print_final_stats=1 corpus
