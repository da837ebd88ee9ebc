#!/usr/bin/python3
"""Issue 19, --metrics: what a scrape costs and what it costs the drain.

alloc_storm (tests/targets/alloc_storm.c: malloc(64)+free pairs as fast as
it can for --seconds S) launched under memtrace-bpf in three modes, the
order alternating within every repetition:

  off      no --metrics
  idle     --metrics 127.0.0.1:0, nobody scrapes
  scraped  --metrics 127.0.0.1:0, a GET /metrics every --every seconds
           (0.1: 150 times Prometheus' default rate)

Per mode (medians over --reps): pairs/s the storm made while traced, events
the tool drained per second, ring drops, the ring's peak fill, the tool's
CPU seconds (user+sys, every thread, from /proc/PID/stat) per million events; for `scraped`, the
scrape latency seen by the client (median, p99, max) and the body size.

  sudo bench/metrics/scrape_cost.py [--tool build-metrics/src/loader/memtrace-bpf]
       [--storm build-metrics/tests/targets/alloc_storm] [--reps 3] [--seconds 5] [--every 0.1]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchlib import med, snapshot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


def run(tool, storm, mode, seconds, every):
    rep = tempfile.mktemp(prefix="mtb-metrics-", suffix=".json")
    argv = [tool, "--format", "json", "-o", rep]
    if mode != "off":
        argv += ["--metrics", "127.0.0.1:0"]
    argv += ["--", storm, "--seconds", str(seconds)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The tool's own CPU (every thread, not the storm's): the last reading
    # of /proc/PID/stat before it exits.
    tool_cpu = [0.0]
    tick = os.sysconf("SC_CLK_TCK")

    def watch():
        while p.poll() is None:
            try:
                with open("/proc/%d/stat" % p.pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                tool_cpu[0] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.05)
    w = threading.Thread(target=watch)
    w.start()
    url, lat, size = None, [], 0
    if mode != "off":
        for line in p.stderr:
            m = re.search(r"metrics at (http://\S+)", line)
            if m:
                url = m.group(1)
                break
    err_rest = []
    t = threading.Thread(target=lambda: err_rest.append(p.stderr.read()))
    t.start()
    if mode == "scraped" and url:
        while p.poll() is None:
            t0 = time.perf_counter()
            try:
                body = urllib.request.urlopen(url, timeout=5).read()
                lat.append(time.perf_counter() - t0)
                size = len(body)
            except OSError:
                pass
            time.sleep(every)
    out = p.stdout.read()
    p.wait()
    t.join()
    w.join()
    with open(rep) as f:
        r = json.load(f)
    os.unlink(rep)
    pairs = int(re.search(r"pairs=(\d+)", out).group(1))
    secs = float(re.search(r"seconds=([\d.]+)", out).group(1))
    cpu = tool_cpu[0]
    events = r["stats"]["events"]
    return {"pairs_s": pairs / secs, "events_s": events / secs,
            "drops": r["dropped"]["ringbuf"] + r["dropped"]["stack_ringbuf"],
            "peak_kb": r["stats"].get("ringbuf_peak_kb", 0),
            "cpu_per_mevent": cpu / (events / 1e6) if events else float("nan"),
            "lat": lat, "size": size}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", default=os.path.join(ROOT, "build-metrics/src/loader/memtrace-bpf"))
    ap.add_argument("--storm", default=os.path.join(ROOT, "build-metrics/tests/targets/alloc_storm"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--every", type=float, default=0.1)
    a = ap.parse_args()
    tool = snapshot(a.tool)
    modes = ["off", "idle", "scraped"]
    res = {m: [] for m in modes}
    for rep in range(a.reps):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            res[m].append(run(tool, a.storm, m, a.seconds, a.every))
            x = res[m][-1]
            print("rep %d %-8s pairs/s %9.0f events/s %9.0f drops %d peak %d KiB cpu/Mevent %.3f s%s" % (
                rep, m, x["pairs_s"], x["events_s"], x["drops"], x["peak_kb"], x["cpu_per_mevent"],
                (" scrapes %d" % len(x["lat"])) if x["lat"] else ""), flush=True)
    print("\n| mode | pairs/s | events/s | ring drops | ring peak KiB | tool CPU s per M events |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in modes:
        xs = res[m]
        print("| %s | %.0f | %.0f | %d | %.0f | %.3f |" % (
            m, med([x["pairs_s"] for x in xs]), med([x["events_s"] for x in xs]), sum(x["drops"] for x in xs),
            med([x["peak_kb"] for x in xs]), med([x["cpu_per_mevent"] for x in xs])))
    lat = sorted(l for x in res["scraped"] for l in x["lat"])
    if lat:
        print("\nscrape latency (client, %d scrapes while the storm ran): median %.2f ms, p99 %.2f ms, max %.2f ms; "
              "body %d bytes" % (len(lat), 1e3 * med(lat), 1e3 * lat[int(0.99 * (len(lat) - 1))], 1e3 * lat[-1],
                                 res["scraped"][-1]["size"]))


if __name__ == "__main__":
    main()
