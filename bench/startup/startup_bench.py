#!/usr/bin/python3
"""The fixed cost of a run: `/bin/true` and a 10 ms program (ten_ms.c) under
memtrace-bpf, valgrind and heaptrack, interleaved in one run; medians and
ratios (issue 33, docs/startup-cost.md).

  sudo bench/startup/startup_bench.py [--repeat 7] [--build build]
       [--modes untraced,memtrace,memtrace-before,valgrind,heaptrack] [--programs true,10ms]
       [--prev-build DIR  (with mode memtrace-prev)]

Each figure is the wall time from the tool's launch to its exit (the user's
prompt back), report written:
  memtrace       memtrace-bpf -o FILE -- PROG (the default: CFI stacks)
  memtrace-before  the same with MEMTRACE_SYNC_TEARDOWN=1 MEMTRACE_SERIAL_LOAD=1:
                 the tool closes its links itself before it exits, its programs
                 verified one after the other (what it did before issue 33)
  memtrace-prev  memtrace with the tool of another build (--prev-build DIR,
                 e.g. one of an older commit): A/B across commits
  valgrind       valgrind -q PROG (memcheck)
  heaptrack      heaptrack -o FILE PROG (its recording; no heaptrack_print)
  untraced       PROG alone
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def argv_of(mode, tool, prog, tmp):
    if mode in ("memtrace", "memtrace-before", "memtrace-prev"):
        return [tool, "-o", os.path.join(tmp, "r.txt"), "--"] + prog
    if mode == "valgrind":
        return ["valgrind", "-q"] + prog
    if mode == "heaptrack":
        return ["heaptrack", "-o", os.path.join(tmp, "ht")] + prog
    if mode == "untraced":
        return prog
    raise SystemExit("unknown mode " + mode)


def run_once(mode, tools, prog, tmp):
    tool = tools.get(mode, tools["memtrace"])
    env = dict(os.environ)
    if mode == "memtrace-before":
        env["MEMTRACE_SYNC_TEARDOWN"] = "1"
        env["MEMTRACE_SERIAL_LOAD"] = "1"
    t0 = time.monotonic()
    p = subprocess.run(argv_of(mode, tool, prog, tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env=env)
    dt = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError("%s %s: exit %d: %s" % (mode, prog, p.returncode, p.stderr[-2000:]))
    if mode.startswith("memtrace"):
        with open(os.path.join(tmp, "r.txt")) as f:
            if "HEAP SUMMARY" not in f.read():  # the report was written
                raise RuntimeError("%s: no report" % mode)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--modes", default="untraced,memtrace,memtrace-before,valgrind,heaptrack")
    ap.add_argument("--programs", default="true,10ms")
    ap.add_argument("--prev-build", help="the build whose tool memtrace-prev runs")
    a = ap.parse_args()
    tools = {"memtrace": os.path.join(a.build, "src/loader/memtrace-bpf")}
    modes = a.modes.split(",")
    if "memtrace-prev" in modes:
        if not a.prev_build:
            raise SystemExit("memtrace-prev needs --prev-build DIR")
        tools["memtrace-prev"] = os.path.join(a.prev_build, "src/loader/memtrace-bpf")
    with tempfile.TemporaryDirectory() as tmp:
        ten = os.path.join(tmp, "ten_ms")
        subprocess.run(["cc", "-O2", "-g", "-o", ten, os.path.join(HERE, "ten_ms.c")], check=True)
        progs = {"true": ["/bin/true"], "10ms": [ten]}
        names = a.programs.split(",")
        res = {(n, m): [] for n in names for m in modes}
        for r in range(a.repeat):
            for n in names:
                for m in modes:
                    v = run_once(m, tools, progs[n], tmp)
                    res[(n, m)].append(v)
                    print("round %d %-5s %-16s %7.3f s" % (r, n, m, v), file=sys.stderr, flush=True)
        un = os.uname()
        print("%d CPUs, kernel %s; medians of %d rounds, interleaved; launch to exit, report written" %
              (os.cpu_count(), un.release, a.repeat))
        for n in names:
            print("\n%s (%s)" % (n, " ".join(progs[n])))
            print("%-16s %9s %9s %9s %9s" % ("mode", "seconds", "min", "/valgrind", "/heaptrack"))
            med = {m: statistics.median(res[(n, m)]) for m in modes}
            for m in modes:
                print("%-16s %9.3f %9.3f %9s %9s" % (
                    m, med[m], min(res[(n, m)]),
                    "%.2f" % (med[m] / med["valgrind"]) if "valgrind" in med else "-",
                    "%.2f" % (med[m] / med["heaptrack"]) if "heaptrack" in med else "-"))
            # the paired ratio: per round, then the median (steadier on a shared host)
            if "memtrace" in modes and "valgrind" in modes:
                pr = [x / y for x, y in zip(res[(n, "memtrace")], res[(n, "valgrind")])]
                print("memtrace/valgrind paired: %.2f" % statistics.median(pr))


if __name__ == "__main__":
    main()
