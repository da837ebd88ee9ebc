#!/bin/sh
# Install the Debian packages in scripts/deps.txt (or the list given, e.g.
# scripts/deps-arm64.txt) that are not installed yet. Names with :arm64 add
# that architecture to dpkg first. Runs as root (the tool needs root anyway);
# uses sudo when it is not root.
#   scripts/setup.sh [DEPS_FILE]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
deps=${1:-$here/deps.txt}
# A line "PACKAGE COMMAND" is also satisfied by COMMAND on the PATH (npm:
# NodeSource's nodejs carries its own npm and conflicts with Debian's).
pkgs=$(grep -v '^#' "$deps" | grep -v '^$' | while read -r p c; do
  if [ -n "${c:-}" ] && command -v "$c" >/dev/null 2>&1; then continue; fi
  echo "$p"
done)
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "setup: all packages installed"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "setup: installing$missing"
export DEBIAN_FRONTEND=noninteractive
for a in $(echo "$missing" | tr ' ' '\n' | sed -n 's/.*:\([a-z0-9]*\)$/\1/p' | sort -u); do
  dpkg --print-foreign-architectures | grep -qx "$a" || $SUDO dpkg --add-architecture "$a"
done
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
