#!/bin/sh
# One command from a fresh machine: install what is missing, build, run every
# test (as root: the integration tests load the real BPF programs).
#   sudo scripts/test.sh            (CI=true: a test that would skip fails)
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
cd "$ROOT/build"
# A failed test is run again, up to three runs, and the log shows each failure:
# the --rearm test races against the scheduler (about 1 run in 10 sees one
# extra first access, or misses a whole sweep; see docs/issue-6-note.md).
# A test that fails three times fails the run.
exec ctest --output-on-failure --timeout 600 --repeat until-pass:3 "$@"
