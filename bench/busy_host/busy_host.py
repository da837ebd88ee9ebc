#!/usr/bin/python3
"""Issue 17, "No loss at a busy machine's event rates": system-wide tracing
on a busy host.

Two parts, each run for every tool given (--tool NAME=PATH, several allowed:
an old and a new build side by side, interleaved within every repetition):

  ladder   system-wide tracing while --procs alloc_storm processes (C,
           malloc(64)+free pairs, paced to a total --rates R pairs/s, or
           as fast as they can for "max") and --compilers compiler loops
           (`gcc -O2 -c` of a C file, in a loop) run for --seconds S.
           Per step: pairs the storms made per second, events the tool
           counted per second, ring drops (ringbuf, stack_ringbuf).
           "max sustained" = the highest offered rate whose run had no drop
           (median over the repetitions).

  build    a 2-job C++ build (g++ -O2 of this project's own sources, two at
           a time, from build-busy's compile_commands.json, for --build-seconds)
           traced system-wide for its whole length; alloc_rounds (the
           integration tests' target that knows its counts) started in the
           middle with --rounds 0 and --rounds R: the difference of its two
           reports must be exactly R x its per-round counts. Prints every
           DROPPED counter that is not 0, mappings_not_captured, the tool's
           CPU (user+sys) and peak RSS.

  sudo bench/busy_host/busy_host.py [--tool new=build-busy/src/loader/memtrace-bpf]
        [--tool base=/tmp/old/memtrace-bpf] [--reps 3] [--parts ladder,build]
        [--rates 50000,100000,200000,max] [--procs 2] [--compilers 2]
        [--seconds 8] [--build-seconds 45] [--extra-args "--ringbuf-mb 64"]
"""
import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchlib import med, snapshot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))

LOSS_KEYS = ("ringbuf", "stack_ringbuf", "inflight_map_full", "sysargs_map_full", "stack_record_missing",
             "missed_returns", "malformed")

COMPILE_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
struct node { struct node *l, *r; int k; char name[32]; };
static struct node *ins(struct node *t, int k) {
  if (!t) { t = calloc(1, sizeof *t); t->k = k; snprintf(t->name, sizeof t->name, "n%d", k); return t; }
  if (k < t->k) t->l = ins(t->l, k); else t->r = ins(t->r, k);
  return t;
}
int walk(struct node *t) { return t ? walk(t->l) + walk(t->r) + (int)strlen(t->name) : 0; }
int main(void) { struct node *t = 0; for (int i = 0; i < 1000; i++) t = ins(t, (i * 7919) % 1000); return walk(t) & 1; }
"""


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


class Tool:
    """memtrace-bpf system-wide, JSON report; CPU and peak RSS from wait4."""

    def __init__(self, path, extra, tmp, tag):
        self.out = os.path.join(tmp, "rep-%s.json" % tag)
        self.err = b""
        self.p = subprocess.Popen([path, "--format", "json", "--top", "3", "-o", self.out] + extra,
                                  stderr=subprocess.PIPE)
        buf = b""
        t0 = time.time()
        while b"tracing" not in buf:
            c = self.p.stderr.read1(4096) if hasattr(self.p.stderr, "read1") else os.read(self.p.stderr.fileno(), 4096)
            if not c:
                raise RuntimeError("memtrace-bpf ended before tracing: %s" % buf.decode(errors="replace"))
            buf += c
        self.start_s = time.time() - t0
        self.err = buf
        self.t = threading.Thread(target=self._drain, daemon=True)
        self.t.start()

    def _drain(self):
        for c in iter(lambda: self.p.stderr.read(4096), b""):
            self.err += c

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        t0 = time.time()
        _, status, ru = os.wait4(self.p.pid, 0)
        self.stop_s = time.time() - t0
        self.p.returncode = status
        self.t.join(5)
        self.cpu = ru.ru_utime + ru.ru_stime
        self.maxrss_kb = ru.ru_maxrss
        if os.WEXITSTATUS(status) != 0:
            raise RuntimeError("memtrace-bpf exited with %d: %s" % (status, self.err.decode(errors="replace")[-2000:]))
        with open(self.out) as f:
            rep = json.load(f)
        os.unlink(self.out)
        return rep


RING_KEYS = ("ringbuf", "stack_ringbuf", "fault_ringbuf")


def losses(rep):
    d = rep.get("dropped", {})
    return {k: v for k, v in d.items() if v}


def ring_drops(r):
    """Events lost because a ring was full (the others, e.g. missed_returns,
    are printed but are not what the ladder measures)."""
    return sum(r["losses"].get(k, 0) for k in RING_KEYS)


def compiler_loop(tmp, stop, tag):
    src = os.path.join(tmp, "cl-%s.c" % tag)
    with open(src, "w") as f:
        f.write(COMPILE_C)
    n = 0
    while not stop.is_set():
        subprocess.run(["gcc", "-O2", "-c", src, "-o", src + ".o"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        n += 1
    return n


def ladder_step(tool, extra, storm, rate, procs, compilers, seconds, tmp, tag):
    t = Tool(tool, extra, tmp, tag)
    stop = threading.Event()
    cls = [threading.Thread(target=compiler_loop, args=(tmp, stop, "%s-%d" % (tag, i)), daemon=True)
           for i in range(compilers)]
    for c in cls:
        c.start()
    per = 0 if rate == "max" else float(rate) / procs
    ps = [subprocess.Popen([storm, "--seconds", str(seconds), "--rate", str(per)], stdout=subprocess.PIPE, text=True)
          for _ in range(procs)]
    pairs = 0
    secs = 0.0
    for p in ps:
        out, _ = p.communicate()
        kv = dict(x.split("=") for x in out.split())
        pairs += int(kv["pairs"])
        secs = max(secs, float(kv["seconds"]))
    stop.set()
    for c in cls:
        c.join()
    rep = t.stop()
    ev = rep["stats"]["events"]
    return {"pairs_per_s": pairs / secs, "events": ev, "events_per_s": ev / secs, "losses": losses(rep),
            "cpu": t.cpu, "rss_kb": t.maxrss_kb, "stop_s": t.stop_s,
            "tool_rss_kb": rep["stats"].get("tool_rss_kb"), "not_captured": rep["stats"].get("mappings_not_captured"),
            "ring_peak_kb": rep["stats"].get("ringbuf_peak_kb")}


def build_commands(build_dir, tmp, limit):
    """g++ -O2 commands for this project's own C++ sources (real code that
    pulls in nlohmann/json, libbpf, elfutils headers), outputs in tmp."""
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        cc = json.load(f)
    cmds = []
    for e in cc:
        src = e["file"]
        if "/src/" not in src or not src.endswith(".cpp") or "/fuzz" in src:
            continue
        argv = shlex.split(e["command"]) if "command" in e else e["arguments"]
        if "-o" in argv:
            argv[argv.index("-o") + 1] = os.path.join(tmp, "b-%d.o" % len(cmds))
        cmds.append((e["directory"], argv))
    cmds.sort(key=lambda c: c[1][-1])
    return cmds[:limit] if limit else cmds


def run_build(cmds, seconds, jobs, stop_at):
    """Compile cmds, `jobs` at a time, round and round until `seconds` have passed."""
    t0 = time.time()
    i = 0
    running = []
    done = 0
    while time.time() - t0 < seconds or running:
        while len(running) < jobs and time.time() - t0 < seconds:
            d, argv = cmds[i % len(cmds)]
            i += 1
            running.append(subprocess.Popen(argv, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.05)
        for p in list(running):
            if p.poll() is not None:
                running.remove(p)
                done += 1
    stop_at.append(time.time() - t0)
    return done


def known_target(target, rounds):
    p = subprocess.run([target, "--rounds", str(rounds)], capture_output=True, text=True)
    per = {}
    for w in p.stdout.split():
        if "=" in w:
            k, v = w.split("=")
            per[k] = int(v)
    return p.pid if hasattr(p, "pid") else None, per


def run_known(target, rounds, res):
    """alloc_rounds --rounds 0, then --rounds R; their pids and per-round counts."""
    for r in (0, rounds):
        p = subprocess.Popen([target, "--rounds", str(r)], stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate()
        per = {}
        for w in out.split():
            if "=" in w:
                k, v = w.split("=")
                per[k] = int(v)
        res.append((p.pid, r, per))


def entry(rep, pid):
    e = None
    for p in rep.get("processes", []):
        if p["pid"] == pid:
            e = p
    return e


def build_step(tool, extra, cmds, seconds, target, rounds, tmp, tag):
    t = Tool(tool, extra, tmp, tag)
    t0 = time.time()
    stop_at = []
    th = threading.Thread(target=lambda: stop_at.append(run_build(cmds, seconds, 2, stop_at)))
    th.start()
    time.sleep(seconds / 2)
    known = []
    run_known(target, rounds, known)
    th.join()
    build_s = time.time() - t0
    rep = t.stop()
    (pid0, _, _), (pid1, _, per) = known
    e0, e1 = entry(rep, pid0), entry(rep, pid1)
    want = {"allocs": rounds * per["allocs"], "frees": rounds * per["frees"],
            "bytes_allocated": rounds * per["bytes"], "in_use_blocks": rounds * per["leaked_blocks"],
            "in_use_bytes": rounds * per["leaked_bytes"]}
    seen = e0 is not None and e1 is not None
    got = {k: (e1["summary"][k] - e0["summary"][k]) if seen else None for k in want}
    exact = seen and got == want
    return {"build_s": build_s, "compiles": stop_at[-1], "events": rep["stats"]["events"],
            "events_per_s": rep["stats"]["events"] / build_s, "losses": losses(rep),
            "not_captured": rep["stats"].get("mappings_not_captured"), "cpu": t.cpu, "rss_kb": t.maxrss_kb,
            "tool_rss_kb": rep["stats"].get("tool_rss_kb"), "known_exact": exact, "known_got": got,
            "known_want": want, "stop_s": t.stop_s, "ring_peak_kb": rep["stats"].get("ringbuf_peak_kb"),
            "known_frames_unknown": unknown_frames(e1)}


def unknown_frames(e):
    """Frames of the known target's leak stacks that were not symbolized, by reason."""
    if not e:
        return None
    n = {}
    for l in e.get("leaks", []):
        for f in l.get("stack", []):
            if f.get("unknown"):
                n[f["unknown"]] = n.get(f["unknown"], 0) + 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", action="append", default=[], help="NAME=PATH (repeatable)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="ladder,build")
    ap.add_argument("--rates", default="50000,100000,200000,max")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--compilers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--build-seconds", type=float, default=45)
    ap.add_argument("--build-files", type=int, default=0, help="at most this many sources (0: all)")
    ap.add_argument("--rounds", type=int, default=200, help="the known target's rounds")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-busy"))
    ap.add_argument("--extra-args", default="", help="more memtrace-bpf arguments, for every tool")
    ap.add_argument("--json", help="write every result here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root")
    tools = []
    for t in a.tool or ["new=" + os.path.join(a.build_dir, "src/loader/memtrace-bpf")]:
        name, path = t.split("=", 1)
        tools.append((name, snapshot(path)))
    extra = shlex.split(a.extra_args)
    tmp = tempfile.mkdtemp(prefix="mtb-busy-")
    storm = os.path.join(tmp, "alloc_storm")
    sh(["cc", "-O2", "-o", storm, os.path.join(ROOT, "tests/targets/alloc_storm.c")])
    target = os.path.join(a.build_dir, "tests/targets/alloc_rounds")
    print("nproc %d, kernel %s, %s" % (os.cpu_count(), os.uname().release, time.strftime("%Y-%m-%d %H:%M:%S")))
    results = {"ladder": [], "build": []}
    parts = a.parts.split(",")
    rates = a.rates.split(",")
    for rep in range(a.reps):
        order = tools if rep % 2 == 0 else tools[::-1]
        if "ladder" in parts:
            for rate in rates:
                for name, path in order:
                    r = ladder_step(path, extra, storm, rate, a.procs, a.compilers, a.seconds, tmp, name)
                    r.update(tool=name, rate=rate, rep=rep)
                    results["ladder"].append(r)
                    print("ladder rep %d %-6s offered %-7s: %8.0f pairs/s, %8.0f events/s traced, tool cpu %.1f s "
                          "(%.0f%% of the run), maxrss %d MB, ring peak %s kB, losses %s" % (
                              rep, name, rate, r["pairs_per_s"], r["events_per_s"], r["cpu"],
                              100 * r["cpu"] / a.seconds, r["rss_kb"] // 1024, r["ring_peak_kb"],
                              r["losses"] or "none"), flush=True)
        if "build" in parts:
            cmds = build_commands(a.build_dir, tmp, a.build_files)
            for name, path in order:
                r = build_step(path, extra, cmds, a.build_seconds, target, a.rounds, tmp, name)
                r.update(tool=name, rep=rep)
                results["build"].append(r)
                print("build  rep %d %-6s %.0f s, %d compiles, %8.0f events/s, tool cpu %.1f s, maxrss %d MB, "
                      "ring peak %s kB, not_captured %s, losses %s; known target %s %s (want %s), unknown frames %s" % (
                          rep, name, r["build_s"], r["compiles"], r["events_per_s"], r["cpu"],
                          r["rss_kb"] // 1024, r["ring_peak_kb"], r["not_captured"], r["losses"] or "none",
                          "EXACT" if r["known_exact"] else "WRONG", r["known_got"], r["known_want"],
                          r["known_frames_unknown"]), flush=True)
    print("\nSummary (medians over %d repetitions)" % a.reps)
    for name, _ in tools:
        if "ladder" in parts:
            best = []
            for rep in range(a.reps):
                ok = [r["events_per_s"] for r in results["ladder"]
                      if r["tool"] == name and r["rep"] == rep and not ring_drops(r)]
                best.append(max(ok) if ok else 0)
            print("%-6s ladder: max sustained events/s (all traced events) without a ring drop: median %.0f "
                  "(per rep %s)" % (
                name, med(best), ", ".join("%.0f" % b for b in best)))
            for rate in rates:
                rs = [r for r in results["ladder"] if r["tool"] == name and r["rate"] == rate]
                print("%-6s   offered %-7s: %8.0f pairs/s, %8.0f events/s, ring drops in %d of %d, ringbuf median %d, "
                      "tool cpu %.1f s" % (
                          name, rate, med([r["pairs_per_s"] for r in rs]), med([r["events_per_s"] for r in rs]),
                          sum(bool(ring_drops(r)) for r in rs), len(rs),
                          med([r["losses"].get("ringbuf", 0) for r in rs]), med([r["cpu"] for r in rs])))
        if "build" in parts:
            bs = [r for r in results["build"] if r["tool"] == name]
            print("%-6s build: %d of %d runs without a ring drop, known target exact in %d of %d; ringbuf median %d, "
                  "stack_ringbuf median %d, not_captured median %s, events/s median %.0f, tool cpu median %.1f s, "
                  "maxrss median %d MB" % (
                      name, sum(not ring_drops(r) for r in bs), len(bs), sum(r["known_exact"] for r in bs), len(bs),
                      med([r["losses"].get("ringbuf", 0) for r in bs]),
                      med([r["losses"].get("stack_ringbuf", 0) for r in bs]),
                      med([r["not_captured"] or 0 for r in bs]), med([r["events_per_s"] for r in bs]),
                      med([r["cpu"] for r in bs]), med([r["rss_kb"] for r in bs]) // 1024))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
