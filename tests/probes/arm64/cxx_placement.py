#!/usr/bin/env python3
"""Placements past the entry on arm64, checked in a real kernel: cxx_new
(tests/targets) under Debian's arm64 kernel in qemu (TCG), launched twice by
memtrace-bpf --explain-probes (0 and 20 rounds). libstdc++'s aligned
operator new takes no return probe, so its entry probe goes past
stp x29, x30 (+0x24 on libstdc++ 12, sp moved by 32; the nothrow form at
+0x8); the BPF program finds the caller's sp as sp + rsp_adjust, and the
sizes as the program asked them (1309 bytes a round, not the rounded 1468)
come out only if it does. PASS if the 20 rounds add exactly 20 x per_round.

    sudo tests/probes/arm64/cxx_placement.py [--kernel 6.1|6.12] [--build /tmp/b-arm64]
"""
import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "kernels"))
import arm64_test as at  # noqa: E402
import kernel_test as kt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="6.1")
    ap.add_argument("--build", default=os.path.join(kt.ROOT, "build-arm64"))
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    cache = os.path.join(build, "kernels")
    os.makedirs(cache, exist_ok=True)
    pkg, image = kt.kernel_image(a.kernel, cache, at.PATTERNS)
    work = os.path.join(build, "arm64-cxx", a.kernel)
    os.makedirs(work, exist_ok=True)
    stage = at.stage_base(work, cache)
    tool = os.path.join(build, "src/loader/memtrace-bpf")
    cxx = os.path.join(build, "tests/targets/cxx_new")
    kt.copy_to(stage, tool)
    kt.copy_to(stage, cxx)
    libs, interps = at.arm64_libs([cxx])
    for lib in sorted(libs):
        kt.copy_to(stage, lib)
        if lib.startswith("/lib/"):
            kt.copy_to(stage, lib, "/usr" + lib)
        elif lib.startswith("/usr/lib/"):
            kt.copy_to(stage, lib, lib[4:])
        else:  # the cross packages' /usr/aarch64-linux-gnu/lib: where ld.so looks
            kt.copy_to(stage, lib, "/lib/aarch64-linux-gnu/" + os.path.basename(lib))
    for i in interps:
        src = i if os.path.exists(i) else os.path.join("/usr/lib/aarch64-linux-gnu", os.path.basename(i))
        kt.copy_to(stage, src, i)
    body = f"""TOOL={tool}
CXX={cxx}
for r in 0 20; do
  echo "@@BEGIN cxx.Launch.$r"
  $TOOL --explain-probes --format json -o /tmp/r.json -- $CXX --rounds $r > /tmp/r.out 2>/tmp/r.err
  rc=$?
  cat /tmp/r.json
  echo "@@STDOUT"
  cat /tmp/r.out
  echo "@@END cxx.Launch.$r $rc"
  echo "@@BEGIN explain.$r"
  grep "aligned_new\\|kernel refused" /tmp/r.err
  echo "@@END explain.$r 0"
done
"""
    with open(os.path.join(stage, "init"), "w") as f:
        f.write(at.INIT_HEAD + body + at.INIT_TAIL)
    os.chmod(os.path.join(stage, "init"), 0o755)
    img = kt.pack_initramfs(stage, os.path.join(work, "initramfs.cpio.gz"))
    console = os.path.join(work, "console.log")
    secs, timed_out = at.boot(image, img, console, a.timeout)
    text = at.read_console(console)
    sec = kt.sections(text)
    k = re.search(r"^@@KERNEL (\S+)", text, re.M)
    print(f"== {k.group(1) if k else '?'} ({pkg}), {secs:.0f} s in qemu (TCG)")
    print(sec.get("explain.20", (None, "(no --explain-probes output)"))[1].rstrip())
    ok, why = kt.launch_counts(sec, "cxx.Launch.", "cxx_new")
    rc, b = sec.get("cxx.Launch.20", (None, ""))
    m = re.search(r"per_round .*", b)
    print(m.group(0) if m else "(no per_round line)")
    try:
        rep = json.loads(b.partition("@@STDOUT\n")[0])
        drops = {k: v for k, v in rep.get("dropped", {}).items() if v}
        if drops:
            ok, why = False, why + f" dropped {drops}"
    except ValueError:
        pass
    print(f"{'PASS' if ok else 'FAIL'} cxx.LaunchCountsExactly{'' if ok else ': ' + why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
