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
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "kernels"))
import arm64_test as at  # noqa: E402
import kernel_test as kt  # noqa: E402

CLASSES = at.UPROBE_CLASSES


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
    prog, offs = at.uprobe_classes(work)
    stage = at.stage_base(work, cache)
    kt.copy_to(stage, prog, "/uprobe_classes")
    body = at.uprobe_class_script("/uprobe_classes", offs, a.n, True)
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
        hits = at.uprobe_hits(b)
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
