#!/bin/sh
# make_seeds.sh BUILD_DIR: remakes the seed corpus (tests/loader/fuzz/corpus)
# from real recordings of the test targets (as root: BPF). Each recording is
# kept small: its first records up to about 6 KB, then its end record (the
# checksums are per record, so the result is a valid recording). Not run by
# the tests; the seeds are committed.
set -eu
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tool=$build/src/loader/memtrace-bpf
t=$build/tests/targets
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rec() {  # rec NAME TOOL-ARGS... -- PROGRAM...
  name=$1
  shift
  "$tool" --record "$tmp/$name.mtr" "$@" >/dev/null 2>"$tmp/err" || { echo "$name:" >&2; cat "$tmp/err" >&2; exit 1; }
}
rec nostacks --no-stacks -- "$t/alloc_rounds" --rounds 0
rec stacks -- "$t/alloc_rounds" --rounds 0
rec fork --no-stacks -- "$t/alloc_rounds" --rounds 0 --fork
rec threads --no-stacks -- "$t/alloc_rounds" --rounds 0 --threads 2
rec exec --no-stacks -- /bin/sh -c "exec $t/alloc_rounds --rounds 0"
rec faults --faults --no-stacks -- "$t/alloc_rounds" --rounds 0
mkdir -p "$here/corpus"  # regress-*.mtr there are fuzzer finds, kept
for f in "$tmp"/*.mtr; do
  python3 - "$f" "$here/corpus/$(basename "$f")" <<'EOF'
import struct, sys
d = open(sys.argv[1], 'rb').read()
hl = struct.unpack_from('<I', d, 12)[0]
out, o, end = bytearray(d[:16 + hl]), 16 + hl, None
while o + 12 <= len(d):
    t, n, _ = struct.unpack_from('<III', d, o)
    r = d[o:o + 12 + n]
    if t == 4:
        end = r
    elif len(out) + len(r) <= 6000:
        out += r
    o += 12 + n
open(sys.argv[2], 'wb').write(out + (end or b''))
EOF
done
ls -l "$here/corpus"
