#!/usr/bin/python3
"""What the kernel's attach mechanism costs a process the tool follows.

Kernels before 6.6 have no uprobe_multi links: every allocator probe of a
process is its own perf-event uprobe (about 18 per process instead of 2
links), and kernels before 5.17 load the compat BPF object (one program per
allocator function). This runs `memtrace-bpf -c mtb_attach` in each mode,
interleaved, on this machine's kernel, starts N short processes of a target
under that name one after the other, and reports:

  attach per process   the loader's time in Attacher::attach (STATS attach_us
                       / attach_processes: the mean of a run), median over
                       repetitions
  startup delay        spawn -> exit of the target, traced minus untraced
                       (the untraced runs of each repetition run just before
                       it), median
  tool exit            SIGINT -> exit of memtrace-bpf
  detach per process   the kernel's time in the closes of an ended process's
                       perf events during the run (STATS uprobe_detach_us /
                       uprobe_detach_sets; perf-event modes only)
  reaper after exit    exit of memtrace-bpf -> the end of its guardian or
                       reaper process, which closes the perf-event uprobes
                       still open (src/loader/attach.cpp: detach_in_background)

Modes: multi (uprobe_multi links, the default here), perf
(MEMTRACE_UPROBE_ATTACH=perf: perf-event uprobes with cookies, as on 6.1:
tracefs events shared by every process, src/loader/shared_uprobes.h),
perf-pmu (each process's own perf events from the uprobe PMU, as before the
shared events), compat (MEMTRACE_BPF_VARIANT=compat: the 5.10 object,
perf-event uprobes without cookies, shared).

  sudo bench/attach/attach_modes.py [-n 20] [--reps 5] [--modes multi,perf,perf-pmu,compat]
                                    [--memtrace build/src/loader/memtrace-bpf]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchlib import med, snapshot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
MODES = {
    "multi": {},
    "perf": {"MEMTRACE_UPROBE_ATTACH": "perf"},
    "perf-pmu": {"MEMTRACE_UPROBE_ATTACH": "perf-pmu"},
    "compat": {"MEMTRACE_BPF_VARIANT": "compat"},
}


def reaper_wait():
    """Seconds until no memtrace-bpf or memtrace-guard process is left: before 6.6 a reaper
    process closes the perf-event uprobes after the tool exits (one RCU grace
    period each, under the kernel's event_mutex, which the next run's attaches
    also take); each run starts after the last one's reaper is done."""
    t0 = time.monotonic()
    while True:
        busy = False
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        busy |= f.read().strip() in ("memtrace-bpf", "memtrace-guard")
                except OSError:
                    pass
        if not busy:
            return time.monotonic() - t0
        time.sleep(0.05)


def run_targets(target, n):
    """Wall time of n sequential runs of the target, seconds each."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([target, "--rounds", "1"], stdout=subprocess.DEVNULL, check=True)
        times.append(time.monotonic() - t0)
    return times


def traced(tool, mode, target, n, tmp):
    rep = os.path.join(tmp, "rep.json")
    env = dict(os.environ, **MODES[mode])
    env.pop("MEMTRACE_LIBBPF_VERBOSE", None)
    p = subprocess.Popen([tool, "--format", "json", "-o", rep, "-c", "mtb_attach"], env=env,
                         stderr=subprocess.PIPE, text=True)
    buf = ""
    while "tracing" not in buf:
        line = p.stderr.readline()
        if not line:
            sys.exit(f"memtrace-bpf ({mode}) ended before tracing: {buf}")
        buf += line
    times = run_targets(target, n)
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.wait()
    exit_s = time.monotonic() - t0
    with open(rep) as f:
        j = json.load(f)
    st = j["stats"]
    procs = [q for q in j["processes"] if q["comm"] == "mtb_attach"]
    if len(procs) != n or st["attach_processes"] < n:
        sys.exit(f"{mode}: {len(procs)} processes traced, {st['attach_processes']} attaches, want {n}")
    detach = st["uprobe_detach_us"] / st["uprobe_detach_sets"] if st.get("uprobe_detach_sets") else float("nan")
    return times, st["attach_us"] / st["attach_processes"], j["kernel"], exit_s, reaper_wait(), detach


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20, help="processes per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memtrace", default=os.path.join(ROOT, "build/src/loader/memtrace-bpf"))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    a = ap.parse_args()
    for m in list(MODES):
        if m not in a.modes.split(","):
            del MODES[m]
    base_mode = "multi" if "multi" in MODES else next(iter(MODES))
    tool = snapshot(a.memtrace)
    tmp = tempfile.mkdtemp(prefix="mtb-attach-")
    target = os.path.join(tmp, "mtb_attach")
    shutil.copy2(os.path.join(ROOT, "build/tests/targets/alloc_rounds"), target)
    attach = {m: [] for m in MODES}
    delay = {m: [] for m in MODES}
    exits = {m: [] for m in MODES}
    reaps = {m: [] for m in MODES}
    detaches = {m: [] for m in MODES}
    kernel = {}
    for r in range(a.reps):
        for m in MODES:
            base = med(run_targets(target, a.n))
            reaper_wait()
            times, per, kernel[m], ex, reap, det = traced(tool, m, target, a.n, tmp)
            attach[m].append(per)
            detaches[m].append(det)
            exits[m].append(ex)
            reaps[m].append(reap)
            delay[m].append(med(times) - base)
        print(f"rep {r + 1}/{a.reps}: " + ", ".join(f"{m} {attach[m][-1] / 1000:.2f} ms" for m in MODES),
              flush=True)
    rel = os.uname().release
    print(f"\nkernel {rel}, {a.n} processes x {a.reps} repetitions, medians")
    print(f"{'mode':8} {'uprobes':17} {'attach per process':>19} {'vs ' + base_mode:>9} {'startup delay':>14} "
          f"{'detach per process':>19} {'tool exit':>10} {'reaper after exit':>18}")
    for m in MODES:
        print(f"{m:8} {kernel[m]['uprobes']:17} {med(attach[m]) / 1000:16.2f} ms "
              f"{med(attach[m]) / med(attach[base_mode]):8.2f}x {med(delay[m]) * 1000:11.2f} ms"
              f" {med(detaches[m]) / 1000:16.2f} ms {med(exits[m]):8.2f} s {med(reaps[m]):15.2f} s")
    shutil.rmtree(tmp)
    shutil.rmtree(os.path.dirname(tool))


if __name__ == "__main__":
    main()
