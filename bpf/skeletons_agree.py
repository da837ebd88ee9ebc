#!/usr/bin/env python3
"""The loader opens either BPF object (full, or -DMT_COMPAT) through the full
object's skeleton: every map and program that skeleton names must exist in
the compat object, and the read-only and .bss variables must have the same
layout.

    skeletons_agree.py FULL.skel.h COMPAT.skel.h STAMP
"""
import re
import sys


def parts(path, name):
    s = open(path).read()
    m = re.search(r"struct %s__rodata \{(.*?)\} \*rodata;" % name, s, re.S)
    rodata = re.sub(r"\s+", " ", m.group(1)).strip() if m else ""
    m = re.search(r"struct %s__bss \{(.*?)\} \*bss;" % name, s, re.S)
    bss = re.sub(r"\s+", " ", m.group(1)).strip() if m else ""
    maps = re.findall(r's->maps\[\d+\]\.name = "([^"]+)";', s)
    progs = re.findall(r's->progs\[\d+\]\.name = "([^"]+)";', s)
    other = re.findall(r"struct %s__(data|kconfig) \{" % name, s)
    return rodata, maps, progs, other, bss


full_h, compat_h, stamp = sys.argv[1:4]
f = parts(full_h, "memtrace_bpf")
c = parts(compat_h, "memtrace_bpf_compat")
errors = []
if f[0] != c[0]:
    errors.append(f"read-only variables differ:\n  full:   {f[0]}\n  compat: {c[0]}")
missing = [m for m in f[1] if m not in c[1]]
if missing:
    errors.append(f"maps of the full object missing in compat: {missing}")
missing = [p for p in f[2] if p not in c[2]]
if missing:
    errors.append(f"programs of the full object missing in compat: {missing}")
if f[3] or c[3]:
    errors.append(f"writable globals (.data/kconfig) are not shared safely: {f[3]} {c[3]}")
if f[4] != c[4]:
    errors.append(f".bss variables differ:\n  full:   {f[4]}\n  compat: {c[4]}")
if errors:
    sys.exit("skeletons_agree: " + "\n".join(errors))
open(stamp, "w").write("ok\n")
