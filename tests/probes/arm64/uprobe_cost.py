#!/usr/bin/env python3
"""What the arm64 kernel does with a uprobe per instruction class, measured:
uprobe_classes.S has one function per class (cbz, adrp, stp, mov, nop, bti c,
paciasp, autiasp, ldr literal, ldxr); in Debian's arm64 kernel under qemu
(TCG) a tracefs uprobe goes on each in turn, the driver calls the function N
times, and the result is the probe's hits (0: the kernel refused it) and the
time per call with and without it. TCG timings are only indicative: what
counts is simulated vs stepped out of line vs refused, and their ratio.

    sudo tests/probes/arm64/uprobe_cost.py [--kernel 6.1|6.12] [--build /tmp/b-arm64] [-n 20000]
"""
import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "kernels"))
import arm64_test as at  # noqa: E402
import kernel_test as kt  # noqa: E402

CLASSES = ["cbz", "adrp", "stp", "mov", "nop", "bti", "paciasp", "autiasp", "ldrlit", "ldxr"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="6.1")
    ap.add_argument("--build", default=os.path.join(kt.ROOT, "build-arm64"))
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    cache = os.path.join(build, "kernels")
    os.makedirs(cache, exist_ok=True)
    pkg, image = kt.kernel_image(a.kernel, cache, at.PATTERNS)
    work = os.path.join(build, "arm64-uprobe-cost", a.kernel)
    os.makedirs(work, exist_ok=True)
    prog = os.path.join(work, "uprobe_classes")
    kt.run(["aarch64-linux-gnu-gcc", "-O2", "-static", "-o", prog, os.path.join(HERE, "uprobe_classes.c"),
            os.path.join(HERE, "uprobe_classes.S")])
    nm = subprocess.run(["aarch64-linux-gnu-nm", prog], capture_output=True, text=True, check=True).stdout
    sym = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]+) T u_(\w+)$", nm, re.M)}
    ph = subprocess.run(["readelf", "-lW", prog], capture_output=True, text=True, check=True).stdout
    segs = [(int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
            for m in re.finditer(r"LOAD\s+0x([0-9a-f]+) 0x([0-9a-f]+) 0x[0-9a-f]+ 0x([0-9a-f]+) .*E", ph)]
    def file_off(v):
        for off, vaddr, sz in segs:
            if vaddr <= v < vaddr + sz:
                return v - vaddr + off
        sys.exit(f"no executable segment holds {v:#x}")
    stage = at.stage_base(work, cache)
    kt.copy_to(stage, prog, "/uprobe_classes")
    body = "T=/sys/kernel/tracing\n"
    for c in CLASSES:
        off = file_off(sym[c])
        body += f"""echo "@@BEGIN {c}"
/uprobe_classes {c} {a.n}
echo 'p:u_{c} /uprobe_classes:{off:#x}' >> $T/uprobe_events
echo 1 > $T/events/uprobes/u_{c}/enable
/uprobe_classes {c} {a.n}
echo "hits $(grep u_{c} $T/uprobe_profile)"
echo 0 > $T/events/uprobes/u_{c}/enable
echo '-:u_{c}' >> $T/uprobe_events
echo "@@END {c} 0"
"""
    with open(os.path.join(stage, "init"), "w") as f:
        f.write(at.INIT_HEAD + body + at.INIT_TAIL)
    os.chmod(os.path.join(stage, "init"), 0o755)
    img = kt.pack_initramfs(stage, os.path.join(work, "initramfs.cpio.gz"))
    console = os.path.join(work, "console.log")
    secs, timed_out = at.boot(image, img, console, a.timeout, smp=1)
    text = at.read_console(console)
    sec = kt.sections(text)
    k = re.search(r"^@@KERNEL (\S+)", text, re.M)
    print(f"== {k.group(1) if k else '?'} ({pkg}), {a.n} calls per run, {secs:.0f} s in qemu (TCG, 1 vCPU)")
    print(f"{'class':10} {'insn at the probe':28} {'hits':>8} {'untraced ns':>12} {'probed ns':>10} {'probe us':>9}")
    texts = {"cbz": "cbz x0", "adrp": "adrp x1", "stp": "stp x29, x30, [sp,#-16]!", "mov": "mov x1, x0",
             "nop": "nop", "bti": "bti c", "paciasp": "paciasp", "autiasp": "autiasp", "ldrlit": "ldr x1, <literal>",
             "ldxr": "ldxr x1, [x0]"}
    for c in CLASSES:
        rc, b = sec.get(c, (None, ""))
        ns = [float(x) for x in re.findall(r"calls (\d+) ns/call", b)]
        h = re.search(r"^hits\s+\S+\s+\S+\s+(\d+)", b, re.M)
        hits = int(h.group(1)) if h else -1
        if len(ns) == 2:
            print(f"{c:10} {texts[c]:28} {hits:>8} {ns[0]:>12.0f} {ns[1]:>10.0f} {(ns[1] - ns[0]) / 1000:>9.2f}")
        else:
            print(f"{c:10} {texts[c]:28} {hits:>8} (no timing: {b.strip()[-300:]!r})")
    if timed_out or "@@DONE" not in text:
        print("VM did not finish:\n" + text[-2000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
