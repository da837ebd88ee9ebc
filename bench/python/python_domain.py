#!/usr/bin/env python3
"""The python domain's cost on the BPF path (issue 32): W1 (bench/workloads/
w1_json_dicts.py) on the default allocator under memtrace-bpf with
--python-domain=off (malloc only: pymalloc's blocks unseen) and =on
(pymalloc traced too), in the same run, interleaved, Python frames as
given (--frames, default on). Time: the tool's launched_traced_us (from the
resume after attach to the program's exit), median of REPS runs; the
untraced program and the allocations each run counted, for reference.

    sudo bench/python/python_domain.py [--tool build/src/loader/memtrace-bpf] [--reps 3] [--n 50000] [--frames on]
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
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--n", type=int, default=50000)
ap.add_argument("--frames", default="on", choices=["on", "off"])
a = ap.parse_args()
tool = benchlib.snapshot(a.tool)
w1 = os.path.join(benchlib.ROOT, "bench/workloads/w1_json_dicts.py")
py = "/usr/bin/python3.11"
env = dict(os.environ)
env.pop("PYTHONMALLOC", None)


def untraced():
    t = time.monotonic()
    subprocess.run([py, w1, str(a.n)], env=env, check=True)
    return (time.monotonic() - t) * 1e6


def traced(domain):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([tool, "--python-domain=" + domain, "--python-frames=" + a.frames, "--format", "json", "-o",
                        f.name, "--", py, w1, str(a.n)],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = json.load(open(f.name))
    p = [x for x in r["processes"] if x["comm"].startswith("python")][0]
    return r["stats"]["launched_traced_us"], p["summary"], {k: v for k, v in r["dropped"].items() if v}


uname = os.uname()
print("machine: %s, kernel %s, %d CPUs, load %.1f; W1 n=%d default allocator, frames %s, %d reps, medians" %
      (uname.nodename, uname.release, os.cpu_count(), os.getloadavg()[0], a.n, a.frames, a.reps))
res = {"untraced": [], "off": [], "on": []}
summ = {}
drops = {}
for _ in range(a.reps):
    res["untraced"].append(untraced())
    for d in ("off", "on"):
        us, s, dr = traced(d)
        res[d].append(us)
        summ[d] = s
        drops[d] = dr
m = {k: benchlib.med(v) for k, v in res.items()}
dom = summ["on"].get("domains", {}).get("python", {})
print("untraced %.0f ms | python domain off %.0f ms (%d allocs) | on %.0f ms (%d allocs, %d of them python's) | "
      "on/off %.2fx | dropped %s" % (m["untraced"] / 1e3, m["off"] / 1e3, summ["off"]["allocs"], m["on"] / 1e3,
                                     summ["on"]["allocs"], dom.get("allocs", 0), m["on"] / m["off"], drops["on"] or "none"))
