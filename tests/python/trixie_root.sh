#!/bin/sh
# Debian 13 (trixie)'s python3.13 in a root of its own (issue 32): the
# CPython 3.13 the Python-frames tests trace, run there with chroot (it
# needs trixie's glibc; this host is Debian 12).
#
#   trixie_root.sh DIR    DIR/root: the packages' files, unpacked with
#                         dpkg-deb -x (no maintainer scripts run), merged-/usr
#                         links made; DIR/root/.complete once done.
#
# apt-get with a private sources list, state and cache under DIR (the host's
# apt is not touched), from deb.debian.org's trixie. A done root is used as
# it is: the tests call this each time; ~20 s the first time, 0 after.
# Prints the root's path last; non-zero exit with one line on failure.
set -eu
dir=${1:?usage: trixie_root.sh DIR}
root=$dir/root
if [ -e "$root/.complete" ] && [ -x "$root/usr/bin/python3.13" ] && [ -e "$root/usr/lib/x86_64-linux-gnu/libffi.so.8" ] &&
	[ -e "$root/usr/lib/x86_64-linux-gnu/libunwind.so.8" ] && [ -d "$root/dev/shm" ]; then
	echo "$root"
	exit 0
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
root=$dir/root
st=$dir/apt
rm -rf "$root" "$st"
mkdir -p "$st/lists/partial" "$st/cache/archives/partial" "$st/prefs.d" "$dir/debs"
: >"$st/status"
echo "deb [trusted=yes] http://deb.debian.org/debian trixie main" >"$st/sources.list"
apt() {
	"$@" -o Dir::Etc::SourceList="$st/sources.list" -o Dir::Etc::SourceParts=/dev/null \
		-o Dir::State="$st" -o Dir::State::Lists="$st/lists" -o Dir::State::status="$st/status" \
		-o Dir::Cache="$st/cache" -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts="$st/prefs.d" \
		-o APT::Architecture=amd64 -o Acquire::Languages=none -o APT::Sandbox::User=root -qq
}
# trusted=yes: the lists come over plain http without trixie's keyring on a
# Debian 12 host; these files only ever run in the test's chroot.
if ! apt apt-get update >"$dir/apt.log" 2>&1; then
	echo "trixie_root.sh: apt-get update from deb.debian.org trixie failed (see $dir/apt.log)" >&2
	exit 1
fi
# python3.13-minimal's interpreter, its stdlib part (tracemalloc.py) and
# what they link, libffi for ctypes (a foreign call runs with the GIL
# released); the few libraries of libpython3.13-stdlib's other extension
# modules the targets do not import are left out. libunwind8 (and its
# liblzma5) and a /dev/shm: what --inject's agent needs in a chroot.
pkgs="python3.13-minimal libpython3.13-minimal libpython3.13-stdlib libc6 libexpat1 zlib1g libgcc-s1 libffi8 libunwind8 liblzma5"
if ! (cd "$dir/debs" && rm -f ./*.deb && apt apt-get download $pkgs >>"$dir/apt.log" 2>&1); then
	echo "trixie_root.sh: apt-get download of $pkgs failed (see $dir/apt.log)" >&2
	exit 1
fi
mkdir -p "$root/tmp" "$root/dev/shm"
for d in "$dir"/debs/*.deb; do dpkg-deb -x "$d" "$root"; done
for l in bin sbin lib lib64; do
	if [ -d "$root/usr/$l" ] && [ ! -e "$root/$l" ]; then ln -s "usr/$l" "$root/$l"; fi
done
if ! chroot "$root" /usr/bin/python3.13 -c 'import tracemalloc, ctypes' >>"$dir/apt.log" 2>&1; then
	echo "trixie_root.sh: python3.13 does not run in $root (see $dir/apt.log)" >&2
	exit 1
fi
touch "$root/.complete"
echo "$root"
