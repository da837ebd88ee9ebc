#!/usr/bin/env python3
"""Python frames' cost (issue 32): W1 (bench/workloads/w1_json_dicts.py)
under memtrace-bpf with --python-frames=off and =on, on the BPF path and
with --inject (the agent's walk), in the same run, interleaved, PYTHONMALLOC=malloc (every object through malloc)
and the default allocator (pymalloc: malloc sees blocks > 512 bytes only).
Time: the tool's launched_traced_us (from the resume after attach to the
program's exit), median of REPS runs; the untraced program for reference.

    sudo bench/python/python_frames.py [--tool build/src/loader/memtrace-bpf] [--reps 5] [--n 50000]
        [--modes off,on,inject-off,inject-on]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tool", default=os.path.join(benchlib.ROOT, "build/src/loader/memtrace-bpf"))
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--n", type=int, default=50000)
ap.add_argument("--modes", default="off,on,inject-off,inject-on", help="of off,on,inject-off,inject-on")
a = ap.parse_args()
tool = benchlib.snapshot(a.tool)
w1 = os.path.join(benchlib.ROOT, "bench/workloads/w1_json_dicts.py")
py = "/usr/bin/python3.11"


def untraced(env):
    t = time.monotonic()
    subprocess.run([py, w1, str(a.n)], env=env, check=True)
    return (time.monotonic() - t) * 1e6


MODES = tuple(a.modes.split(","))


def traced(env, mode):
    inject = ["--inject"] if mode.startswith("inject-") else []
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        p = subprocess.run([tool] + inject + ["--python-frames=" + mode.split("-")[-1], "--format", "json", "-o", f.name,
                                          "--", py, w1, str(a.n)],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = p.stderr.decode(errors="replace")
        if inject and "uprobes instead" in err:
            sys.exit("--inject fell back to uprobes: " + err.strip())
        r = json.load(open(f.name))
    s = r["stats"]
    return s["launched_traced_us"], s.get("model_stacks", 0), r["dropped"]


uname = os.uname()
print("machine: %s, kernel %s, %d CPUs; W1 n=%d, %d reps, medians" % (uname.nodename, uname.release,
                                                                    os.cpu_count(), a.n, a.reps))
for alloc in ("malloc", "default"):
    env = dict(os.environ)
    if alloc == "malloc":
        env["PYTHONMALLOC"] = "malloc"
    else:
        env.pop("PYTHONMALLOC", None)
    res = {m: [] for m in ("untraced",) + MODES}
    stacks = {m: 0 for m in MODES}
    drops = {}
    for _ in range(a.reps):
        res["untraced"].append(untraced(env))
        for mode in MODES:
            us, st, d = traced(env, mode)
            res[mode].append(us)
            stacks[mode] = st
            if mode.endswith("on"):
                drops.update({mode + ":" + k: v for k, v in d.items() if k.startswith("python") and v})
    m = {k: benchlib.med(v) for k, v in res.items()}
    for k in ("off", "on", "inject-off", "inject-on"):
        m.setdefault(k, float("nan"))
        stacks.setdefault(k, 0)
    print("W1 %-7s untraced %7.0f ms | BPF path: frames off %7.0f ms (%d stacks), on %7.0f ms (%d stacks), "
          "on/off %.2fx | --inject: off %7.0f ms (%d stacks), on %7.0f ms (%d stacks), on/off %.2fx | "
          "python losses %s" % (alloc, m["untraced"] / 1e3, m["off"] / 1e3, stacks["off"], m["on"] / 1e3,
                                stacks["on"], m["on"] / m["off"], m["inject-off"] / 1e3, stacks["inject-off"],
                                m["inject-on"] / 1e3, stacks["inject-on"], m["inject-on"] / m["inject-off"],
                                drops or "none"))
