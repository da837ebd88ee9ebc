#!/usr/bin/python3
"""Probe cost of memtrace-bpf against the uprobe floor (issue 4).

For each workload (W1 python+json, W2 C malloc/free loop, W3 sqlite3) and each
mode, run N times and print the median wall time and the ratios against the
untraced run and against floor(chosen):

  untraced        the command alone
  floor0          bench/floor: empty BPF programs, probes at offset 0
  floor           the same at the chosen offsets (src/probes)
  memtrace        memtrace-bpf -- CMD            (if the binary exists)
  memtrace-fp     memtrace-bpf --unwind fp -- CMD   (frame-pointer stacks only)
  memtrace-nostk  memtrace-bpf --no-stacks -- CMD
  memtrace-perf   memtrace-bpf -- CMD with MEMTRACE_UPROBE_ATTACH=perf: one
                  perf-event uprobe per probe, as before uprobe_multi (6.1)
  memtrace-compat memtrace-bpf -- CMD with MEMTRACE_BPF_VARIANT=compat: the BPF
                  object for kernels before 5.17 (5.10: frame-pointer stacks,
                  a hash for in-flight calls, one program per role)
  memtrace-b      the memtrace row with another binary (--memtrace-b PATH):
                  an A/B of two builds, interleaved; the paired ratio b/a is
                  printed per workload
  heaptrack       heaptrack CMD (LD_PRELOAD + libunwind)

Floor rows use the floor's own FLOOR_CHILD_SECONDS (release to exit: the
detach of its links is not the workload's cost); every other row is the wall
time of the whole command as a user sees it.

  sudo bench/probe_cost.py [--repeat 5] [--build build] [--memtrace PATH]
                           [--memtrace-b PATH] [--workloads W1,W2,W3,W4]
                           [--modes untraced,floor0,...]

--cpu: each cell is the workload's own CPU time (user + sys, from
/usr/bin/time run inside the trace: uprobe traps and BPF programs run in the
task's sys time) instead of its wall time; only the untraced and memtrace*
modes (the floor does not follow /usr/bin/time's child). Wall times on a VM
shared with other work moved by 2x from one repetition to the next; CPU
times by a few percent.

W4 (not in the default set): C++ sized and aligned new/delete,
tests/targets/cxx_new, 100k rounds of 9 allocations (6 aligned new, whose
libstdc++ operator gets an entry probe of its own: issue 17).
"""
import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = "/usr/bin/python3"
MEMTRACE_B = None  # --memtrace-b
CPU = False  # --cpu


def workloads(build, tmp):
    w2 = os.path.join(build, "bench/floor/w2_malloc_loop")
    if not os.path.exists(w2):
        w2 = os.path.join(tmp, "w2_malloc_loop")
        subprocess.run(["cc", "-O2", "-fno-builtin", "-o", w2,
                        os.path.join(HERE, "workloads/w2_malloc_loop.c")], check=True)
    w4 = os.path.join(build, "tests/targets/cxx_new")
    if not os.path.exists(w4):
        w4 = os.path.join(tmp, "cxx_new")
        subprocess.run(["g++", "-std=c++20", "-O0", "-g", "-fno-omit-frame-pointer", "-o", w4,
                        os.path.join(ROOT, "tests/targets/cxx_new.cpp")], check=True)
    sql = os.path.join(tmp, "w3.sql")
    subprocess.run([PY, os.path.join(HERE, "workloads/w3_gen_sql.py"), sql], check=True)
    return {
        # PYTHONMALLOC=malloc is set in the environment of every run (see run_once),
        # not through env(1): the traced process is python3 itself, no exec in between.
        "W1": ([PY, os.path.join(HERE, "workloads/w1_json_dicts.py")],
               "PYTHONMALLOC=malloc python3 json round-trip of 50k dicts"),
        "W2": ([w2, "2000000"], "C malloc/free loop, 2M rounds"),
        "W3": (["sqlite3", ":memory:", ".read " + sql], "sqlite3: 60k inserts, index, 500 updates"),
        "W4": ([w4, "--rounds", "100000"], "C++ sized and aligned new/delete, 100k rounds"),
    }


def command(mode, cmd, floor_bin, memtrace_bin, tmp):
    if CPU:
        cmd = ["/usr/bin/time", "-f", "MT_CPU %U %S"] + cmd
    if mode == "untraced":
        return cmd
    if mode == "floor0":
        return [floor_bin, "--offsets", "zero", "--"] + cmd
    if mode == "floor":
        return [floor_bin, "--offsets", "chosen", "--"] + cmd
    rep = ["--format", "json", "-o", os.path.join(tmp, "report.json")]
    if mode == "memtrace":
        return [memtrace_bin] + rep + ["--"] + cmd
    if mode == "memtrace-b":
        return [MEMTRACE_B] + rep + ["--"] + cmd
    if mode == "memtrace-fp":
        return [memtrace_bin, "--unwind", "fp"] + rep + ["--"] + cmd
    if mode == "memtrace-nostk":
        return [memtrace_bin, "--no-stacks"] + rep + ["--"] + cmd
    if mode == "memtrace-perf":
        return ["env", "MEMTRACE_UPROBE_ATTACH=perf", memtrace_bin] + rep + ["--"] + cmd
    if mode == "memtrace-compat":
        return ["env", "MEMTRACE_BPF_VARIANT=compat", memtrace_bin] + rep + ["--"] + cmd
    if mode == "heaptrack":
        return ["heaptrack", "-o", os.path.join(tmp, "ht")] + cmd
    raise ValueError(mode)


def run_once(argv, mode):
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONMALLOC="malloc")
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(argv), p.returncode, p.stderr[-2000:]))
    if CPU:
        m = re.findall(r"MT_CPU ([0-9.]+) ([0-9.]+)", p.stderr)
        if not m:
            raise RuntimeError("no CPU time from " + " ".join(argv) + ": " + p.stderr[-2000:])
        return float(m[-1][0]) + float(m[-1][1])
    if mode.startswith("floor"):
        m = re.search(r"FLOOR_CHILD_SECONDS=([0-9.]+)", p.stderr)
        if not m:
            raise RuntimeError("no FLOOR_CHILD_SECONDS from " + " ".join(argv) + ": " + p.stderr[-2000:])
        if "uprobes +" not in p.stderr:
            raise RuntimeError("floor attached nothing: " + p.stderr[-2000:])
        return float(m.group(1))
    if mode.startswith("memtrace"):
        # Like the floor: the program's run from the moment its probes are
        # attached to its exit (loading BPF and the report are not in it).
        rep = argv[argv.index("-o") + 1]
        with open(rep) as f:
            j = json.load(f)
        if j["dropped"].get("ringbuf", 0) or j["dropped"].get("stack_ringbuf", 0):
            print("#  warning: events dropped: %s" % j["dropped"], file=sys.stderr)
        return j["stats"]["launched_traced_us"] / 1e6
    return wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--floor", default=None, help="memtrace-floor binary (default BUILD/bench/floor/memtrace-floor)")
    ap.add_argument("--memtrace", default=os.path.join(ROOT, "build/src/loader/memtrace-bpf"))
    ap.add_argument("--memtrace-b", default=None, help="a second memtrace-bpf for the memtrace-b mode (A/B)")
    ap.add_argument("--cpu", action="store_true", help="the workload's user+sys time instead of its wall time")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--modes", default="untraced,floor0,floor,memtrace,memtrace-fp,memtrace-nostk,heaptrack")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("probe_cost: run as root (uprobes)")
    floor_bin = a.floor or os.path.join(a.build, "bench/floor/memtrace-floor")
    if not os.path.exists(floor_bin):
        sys.exit("probe_cost: no %s (cmake --build %s --target memtrace-floor w2_malloc_loop)" % (floor_bin, a.build))
    modes = a.modes.split(",")
    global MEMTRACE_B, CPU
    MEMTRACE_B = a.memtrace_b
    CPU = a.cpu
    if CPU and any(m.startswith("floor") or m == "heaptrack" for m in modes):
        sys.exit("probe_cost: --cpu measures only the untraced and memtrace* modes")
    if a.memtrace_b and "memtrace-b" not in modes:
        modes.append("memtrace-b")
    if "memtrace-b" in modes and not (a.memtrace_b and os.path.exists(a.memtrace_b)):
        sys.exit("probe_cost: memtrace-b needs --memtrace-b PATH")
    if not os.path.exists(a.memtrace):
        print("# %s not built: skipping memtrace rows" % a.memtrace)
        modes = [m for m in modes if not m.startswith("memtrace")]
    if not shutil.which("heaptrack"):
        modes = [m for m in modes if m != "heaptrack"]

    # kernel.bpf_stats_enabled (left on by a bpf_stats A/B, bench/unwind/ab.sh)
    # adds two sched_clock() reads to every program run: ~5% of a traced
    # W3's samples here (kvm-clock's pvclock). Off for the run, put back after.
    stats_path = "/proc/sys/kernel/bpf_stats_enabled"
    stats_was = open(stats_path).read().strip() if os.path.exists(stats_path) else "0"
    if stats_was != "0":
        open(stats_path, "w").write("0")
        atexit.register(lambda: open(stats_path, "w").write(stats_was))
        print("# kernel.bpf_stats_enabled was %s: 0 for this run" % stats_was)

    tmp = tempfile.mkdtemp(prefix="probe_cost.")
    wl = workloads(a.build, tmp)
    print("# kernel %s, %d runs per cell, median %s seconds" % (os.uname().release, a.repeat,
                                                                 "CPU (user+sys)" if CPU else "wall"))
    print("# reproduce: sudo %s --repeat %d" % (" ".join(sys.argv[:1]), a.repeat))
    results = {}
    for w in a.workloads.split(","):
        cmd, what = wl[w]
        # Modes interleaved within each repetition (untraced, floor0, floor,
        # memtrace, ..., then again): this VM's speed drifts over minutes, and
        # a ratio of two medians taken minutes apart moved by up to 0.1.
        times = {mode: [] for mode in modes}
        for _ in range(a.repeat):
            for mode in modes:
                times[mode].append(run_once(command(mode, cmd, floor_bin, a.memtrace, tmp), mode))
                for f in os.listdir(tmp):
                    if f.startswith("ht."):
                        os.unlink(os.path.join(tmp, f))
        for mode in modes:
            results[(w, mode)] = statistics.median(times[mode])
            results[(w, mode, "runs")] = times[mode]
            print("#  %s %-15s %s" % (w, mode, " ".join("%.3f" % t for t in times[mode])), flush=True)

    print()
    print("| workload | mode | median s | x untraced | x floor(chosen) |")
    print("|---|---|---:|---:|---:|")
    for w in a.workloads.split(","):
        base = results.get((w, "untraced"))
        fl = results.get((w, "floor"))
        for mode in modes:
            t = results[(w, mode)]
            r1 = "%.2f" % (t / base) if base else "-"
            r2 = "%.2f" % (t / fl) if fl else "-"
            print("| %s | %s | %.3f | %s | %s |" % (w, mode, t, r1, r2))
    f0, fc = results.get(("W1", "floor0")), results.get(("W1", "floor"))
    if f0 and fc:
        print("\nW1 floor(chosen)/floor(offset 0) = %.3f (target <= 0.3)" % (fc / f0))
    for w in a.workloads.split(","):
        if (w, "memtrace", "runs") in results and (w, "memtrace-b", "runs") in results:
            ar, br = results[(w, "memtrace", "runs")], results[(w, "memtrace-b", "runs")]
            print("%s memtrace-b/memtrace = %.3f; paired, median of per-repetition ratios: %.3f" %
                  (w, results[(w, "memtrace-b")] / results[(w, "memtrace")],
                   statistics.median(y / x for x, y in zip(ar, br))))
    for w in ("W1", "W3"):
        m, fc = results.get((w, "memtrace")), results.get((w, "floor"))
        if m and fc:
            mr, fr = results[(w, "memtrace", "runs")], results[(w, "floor", "runs")]
            paired = statistics.median(x / y for x, y in zip(mr, fr))
            print("%s memtrace-bpf/floor(chosen) = %.2f (target <= 1.5); paired, median of "
                  "per-repetition ratios: %.2f" % (w, m / fc, paired))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
