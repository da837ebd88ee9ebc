#!/usr/bin/python3
"""W1 (PYTHONMALLOC=malloc python3, json round trip of 50k dicts) untraced,
under `memtrace-bpf --inject -p PID` (libunwind and frame-pointer stacks)
and under heaptrack, interleaved; medians (issue 21, docs/inject.md).

  sudo bench/inject/w1_inject.py [--repeat 5] [--build build]
                                 [--modes untraced,inject,inject-fp,inject-nostk,heaptrack]

Each run prints three figures:
  workload  the script's own time, measured inside python3 (wait_then_run.py):
            what the tracing costs the program, the attach not counted
  cpu       the same span's user + sys CPU time of python3 (steadier on a
            busy host; for heaptrack and --inject the tool's own process,
            heaptrack_interpret or memtrace-bpf, is not in it)
  command   wall time of the whole command as a user sees it (untraced,
            heaptrack: python3's start to heaptrack's end; inject: the
            tool's start, with the target already running and waiting, to
            the tool's report)
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = "/usr/bin/python3"
W1 = os.path.join(ROOT, "bench/workloads/w1_json_dicts.py")
WRAP = os.path.join(HERE, "wait_then_run.py")
ENV = dict(os.environ, PYTHONMALLOC="malloc")


def seconds_of(stderr):
    m = re.findall(r"workload_seconds ([0-9.]+) cpu ([0-9.]+)", stderr)
    if not m:
        raise RuntimeError("no workload_seconds: " + stderr[-2000:])
    return float(m[-1][0]), float(m[-1][1])


def run_plain(argv):
    t0 = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(argv), p.returncode, p.stderr[-2000:]))
    w, c = seconds_of(p.stderr)
    return w, c, wall


def run_inject(tool, extra, tmp):
    target = subprocess.Popen([PY, WRAP, "--wait", W1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV)
    line = target.stdout.readline()
    pid = int(line.split()[1])
    rep = os.path.join(tmp, "r.json")
    t0 = time.monotonic()
    tool_p = subprocess.Popen([tool, "--inject", "-p", str(pid), "--format", "json", "-o", rep] + extra,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, terr = target.communicate()
    _, merr = tool_p.communicate()
    wall = time.monotonic() - t0
    if target.returncode != 0 or tool_p.returncode != 0:
        raise RuntimeError("inject run: target %d, tool %d: %s %s" % (target.returncode, tool_p.returncode,
                                                                      terr[-1000:], merr[-1000:]))
    w, c = seconds_of(terr)
    return w, c, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--modes", default="untraced,inject,inject-fp,heaptrack")
    a = ap.parse_args()
    tool = os.path.join(a.build, "src/loader/memtrace-bpf")
    modes = a.modes.split(",")
    res = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeat):
            for m in modes:
                if m == "untraced":
                    v = run_plain([PY, WRAP, W1])
                elif m == "heaptrack":
                    v = run_plain(["heaptrack", "-o", os.path.join(tmp, "ht"), PY, WRAP, W1])
                elif m == "inject":
                    v = run_inject(tool, [], tmp)
                elif m == "inject-fp":
                    v = run_inject(tool, ["--unwind", "fp"], tmp)
                elif m == "inject-nostk":
                    v = run_inject(tool, ["--no-stacks"], tmp)
                else:
                    raise SystemExit("unknown mode " + m)
                res[m].append(v)
                print("round %d %-12s workload %.3f s (cpu %.3f s)  command %.3f s" % (r, m, v[0], v[1], v[2]),
                      file=sys.stderr)
    med = {m: [statistics.median(v[i] for v in res[m]) for i in range(3)] for m in modes}
    b = med[modes[0]]
    print("%-12s %11s %11s %11s %8s %8s" % ("mode", "workload s", "cpu s", "command s", "x wall", "x cpu"))
    for m in modes:
        w, c, cmd = med[m]
        print("%-12s %11.3f %11.3f %11.3f %8.2f %8.2f" % (m, w, c, cmd, w / b[0], c / b[1]))


if __name__ == "__main__":
    main()
