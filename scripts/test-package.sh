#!/bin/sh
# The Debian package in a clean Debian 12 chroot: apt install ./memtrace-bpf_*.deb,
# then memtrace-bpf --check and a launch of the chroot's own ls there (also
# with --inject: the agent library found where the package put it).
#   sudo scripts/test-package.sh [BUILD_DIR]
# The debootstrap'd base system is made once (BUILD_DIR/chroot/base) and
# copied afresh for every run.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
DEB=$("$ROOT/scripts/package.sh" "$BUILD" | tail -1)
BASE=$BUILD/chroot/base
if [ ! -f "$BASE/.complete" ]; then
  rm -rf "$BASE"
  mkdir -p "$BUILD/chroot"
  echo "test-package: debootstrap bookworm (once per build directory)" >&2
  debootstrap --variant=minbase bookworm "$BASE" http://deb.debian.org/debian >"$BUILD/chroot/debootstrap.log" 2>&1 ||
    { tail -20 "$BUILD/chroot/debootstrap.log" >&2; exit 1; }
  touch "$BASE/.complete"
fi
T=$BUILD/chroot/test
cleanup() {
  for m in dev sys proc; do umount -R -l "$T/$m" 2>/dev/null || true; done
  rm -rf "$T"
}
cleanup
trap cleanup EXIT INT TERM
cp -a "$BASE" "$T"
cp "$DEB" "$T/tmp/"
mount -t proc proc "$T/proc"
mount --rbind /sys "$T/sys"
mount --rbind /dev "$T/dev"
fail=0
step() {  # step NAME COMMAND...: one PASS/FAIL line per step
  name=$1; shift
  if out=$("$@" 2>&1); then echo "PASS package.$name"; else echo "FAIL package.$name"; echo "$out" | tail -30 | sed 's/^/    /'; fail=1; fi
  LAST=$out
}
step install chroot "$T" apt-get install -y -q "/tmp/$(basename "$DEB")"
step files chroot "$T" sh -c 'test -x /usr/bin/memtrace-bpf && test -x /usr/bin/memtrace-singlestep && test -f /usr/include/memtrace_track.h && ls /usr/lib/*/libmemtrace_track.so* /usr/lib/libmemtrace_track.so* 2>/dev/null | grep -q .'
step check chroot "$T" memtrace-bpf --check
step launch chroot "$T" memtrace-bpf -- /bin/ls /
case $LAST in
  *"HEAP SUMMARY"*"(ls), exit status 0"*"total heap usage: "*) echo "PASS package.launch_report" ;;
  *) echo "FAIL package.launch_report: no heap summary for ls"; echo "$LAST" | tail -20 | sed 's/^/    /'; fail=1 ;;
esac
# --inject finds its agent where the package put it: a launch injected, not
# traced by uprobes instead.
step files_agent chroot "$T" sh -c 'ls /usr/lib/*/memtrace-bpf/libmemtrace_agent.so /usr/lib/memtrace-bpf/libmemtrace_agent.so 2>/dev/null | grep -q .'
step inject chroot "$T" memtrace-bpf --inject -- /bin/ls /
case $LAST in
  *"uprobes instead"*) echo "FAIL package.inject_agent: not injected"; echo "$LAST" | head -5 | sed 's/^/    /'; fail=1 ;;
  *"HEAP SUMMARY"*"(ls), exit status 0"*) echo "PASS package.inject_agent" ;;
  *) echo "FAIL package.inject_agent: no heap summary for ls"; echo "$LAST" | tail -20 | sed 's/^/    /'; fail=1 ;;
esac
step remove chroot "$T" apt-get remove -y -q memtrace-bpf
[ $fail -eq 0 ] && echo "== PASS: the package installs, runs and is removed in a clean Debian 12 chroot" || echo "== FAIL"
exit $fail
