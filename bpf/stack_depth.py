#!/usr/bin/env python3
"""The BPF stack of each program's deepest call chain, counted as the
kernel's verifier counts it (check_max_stack_depth): each frame's depth
rounded up to 32 bytes, a bpf_loop/bpf_find_vma callback counted as a call
from the function that names it, the sum held to 512 bytes. 6.12's verifier
let a chain of 544 bytes through that 6.1's refused (mt_fexit_mmap: the
probe's frame, the frame walk, its step, a row miss, a binary search): a
build-time check catches it on any kernel, before a guest of each version.

    stack_depth.py OBJDUMP STAMP OBJ...

A frame's depth is the deepest r10 offset its instructions use; calls are
BPF-to-BPF calls (R_BPF_64_32 to a symbol) and callback references
(ld_imm64 with an R_BPF_64_64 into .text). Prints every chain over the
limit and exits 1; else touches STAMP."""
import re
import subprocess
import sys

LIMIT = 512


def functions(objdump, obj):
    dis = subprocess.run([objdump, "-dr", "--no-show-raw-insn", obj], check=True, capture_output=True,
                         text=True).stdout
    funcs, text_at = {}, {}
    sec = fn = None
    ld_off = None
    for line in dis.splitlines():
        m = re.match(r"^Disassembly of section (\S+):", line)
        if m:
            sec, fn = m.group(1), None
            continue
        m = re.match(r"^([0-9a-f]+) <([^>]+)>:", line)
        if m:
            if m.group(2).startswith("LBB"):  # a branch target inside a function
                continue
            fn = m.group(2)
            funcs[fn] = {"depth": 0, "refs": set(), "sec": sec}
            if sec == ".text":
                text_at[int(m.group(1), 16)] = fn
            continue
        if fn is None:
            continue
        f = funcs[fn]
        for off in re.findall(r"\(r10 - (0x[0-9a-f]+|\d+)\)", line):
            f["depth"] = max(f["depth"], int(off, 0))
        m = re.search(r"r\d+ = (\d+) ll$", line)
        if m:
            ld_off = int(m.group(1))
            continue
        m = re.search(r"R_BPF_64_64\s+\.text$", line)
        if m and ld_off is not None:
            f["refs"].add(("text", ld_off))
        m = re.search(r"R_BPF_64_32\s+(\S+)$", line)
        if m:
            f["refs"].add(("sym", m.group(1)))
        ld_off = None
    for f in funcs.values():
        calls = {text_at.get(v) if kind == "text" else v for kind, v in f["refs"]}
        f["calls"] = {c for c in calls if c in funcs}
    return funcs


def deepest(funcs, name, on_path=()):
    own = -(-max(funcs[name]["depth"], 1) // 32) * 32
    best, path = 0, []
    for c in funcs[name]["calls"]:
        if c not in on_path:
            d, p = deepest(funcs, c, on_path + (name,))
            if d > best:
                best, path = d, p
    return own + best, [(name, funcs[name]["depth"])] + path


def main():
    objdump, stamp, objs = sys.argv[1], sys.argv[2], sys.argv[3:]
    bad = 0
    for obj in objs:
        funcs = functions(objdump, obj)
        for name, f in sorted(funcs.items()):
            if f["sec"] == ".text":
                continue
            d, path = deepest(funcs, name)
            if d > LIMIT:
                bad += 1
                print(f"{obj}: program {name}: a call chain of {d} bytes of BPF stack (the verifier allows "
                      f"{LIMIT}): " + " -> ".join(f"{n} ({s})" for n, s in path), file=sys.stderr)
    if bad:
        sys.exit(1)
    open(stamp, "w").close()


main()
