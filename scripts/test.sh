#!/bin/sh
# One command from a fresh machine: install what is missing, build, run every
# test (as root: the integration tests load the real BPF programs).
#   sudo scripts/test.sh            (CI=true: a test that would skip fails)
# Arguments go to both ctest runs (e.g. -R NAME).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
cd "$ROOT/build"
# A failed test is run again, up to three runs, and the log shows each
# failure (a safety net for timing on a loaded machine; no test is known to
# be flaky: the --rearm and guardian races were found and fixed, see
# docs/issue-6-note.md). A test that fails three times fails the run.
set -- --output-on-failure --timeout 600 --repeat until-pass:3 "$@"
# Debian's kernels under qemu and the package in a chroot first, two at a
# time: each VM is single-threaded TCG, one host core (serially they took
# 500 of CI's 1,190 s of tests). Then everything else, one test at a time
# (integration tests trace system-wide; gdb comparisons must run alone).
rc=0
ctest -L '^(kernel|package)$' -j2 "$@" || rc=$?
ctest -LE '^(kernel|package)$' "$@" || rc=$?
exit $rc
