#!/usr/bin/python3
"""Issue 2: "While you trace by comm (-c), a malloc loop in an unrelated
process must run within 5% of its untraced speed."

Two unrelated workloads (C, compiled here with cc -O2 into a temp dir):

  malloc   N x { p = malloc(64); free(p); }            (allocator uprobes)
  mmap     N x { mmap 64 KiB anon; touch 16 pages; munmap }
           (the mmap/munmap syscall tracepoints and the sched tracepoints are
           global in -c mode: every process in the system runs them)

each timed in these modes, interleaved within every repetition (the order of
the modes alternates from one repetition to the next):

  untraced      the workload alone
  c-other       while `memtrace-bpf -c mtb_other` runs; mtb_other is a small
                process (malloc/free + usleep(2 ms) loop) started before the
                tool, so the tool really has uprobes attached in some process
  c-self        while `memtrace-bpf -c <the workload's own comm>` runs: proves
                that the probes are attached when the comm matches (much slower)
  system-wide   while `memtrace-bpf` (no filter) runs, for reference

Before each timed run the tool must have printed "tracing" on stderr; after it
the tool is stopped with SIGINT and must exit 0.  c-self and system-wide use a
smaller N (per-iteration time is what is compared).

Figures per mode: the loop's own time per iteration (CLOCK_MONOTONIC around
the loop, printed by the workload), the wall time of the whole process and
its user+sys (os.wait4 rusage).  Ratios are against untraced; PASS/FAIL is
c-other vs untraced against 5% (ratio of medians; the median of the per-
repetition paired ratios is printed as well).

  sudo bench/comm/comm_overhead.py [--reps 7] [--seconds 1.0]
        [--memtrace build/src/loader/memtrace-bpf] [--bpf-stats [MODES]]

--bpf-stats [c-other,c-self,...]: after the timed repetitions (--reps 0: only
this), one more run per workload in each of those modes (default c-other)
with kernel.bpf_stats_enabled=1, printing run count and run time of each BPF
program of the tool (bpftool prog show), i.e. what the unrelated process pays
for in the kernel.  Not part of the timed figures (stats cost time themselves).
"""
import argparse
import json
import os
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
DEFAULT_TOOL = os.path.join(ROOT, "build/src/loader/memtrace-bpf")

WORKLOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		return 2;
	long n = atol(argv[2]);
	double t0 = now();
	if (!strcmp(argv[1], "malloc")) {
		for (long i = 0; i < n; i++) {
			void *volatile p = malloc(64);
			free(p);
		}
	} else if (!strcmp(argv[1], "mmap")) {
		const size_t len = 16 * 4096;
		for (long i = 0; i < n; i++) {
			volatile char *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
						MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (p == MAP_FAILED)
				return 3;
			for (size_t o = 0; o < len; o += 4096)
				p[o] = 1;
			munmap((void *)p, len);
		}
	} else {
		return 2;
	}
	double t1 = now();
	printf("%.3f\n", (t1 - t0) / n * 1e9); /* ns per iteration */
	return 0;
}
"""

OTHER_C = r"""
#include <stdlib.h>
#include <unistd.h>
int main(void)
{
	for (;;) {
		void *volatile p = malloc(128);
		free(p);
		usleep(2000);
	}
}
"""

LOOP_COMM = "mtb_loop"
OTHER_COMM = "mtb_other"
MODES = ["untraced", "c-other", "c-self", "system-wide"]


def compile_c(tmp, name, src):
    c = os.path.join(tmp, name + ".c")
    with open(c, "w") as f:
        f.write(src)
    exe = os.path.join(tmp, name)
    subprocess.run(["cc", "-O2", "-fno-builtin-malloc", "-fno-builtin-free", "-o", exe, c],
                   check=True)
    return exe


class Tool:
    """memtrace-bpf running in the background until stop()."""

    def __init__(self, tool, args, tmp, tag):
        self.out = os.path.join(tmp, "report-%s.txt" % tag)
        self.errf = os.path.join(tmp, "stderr-%s.txt" % tag)
        self.p = subprocess.Popen([tool] + args + ["--top", "3", "-o", self.out],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        self.lines = []
        self.ready = threading.Event()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()
        if not self.ready.wait(120) or self.p.poll() is not None:
            self.p.kill()
            self.p.wait()
            raise RuntimeError("memtrace-bpf %s did not start tracing: %s"
                               % (args, "".join(self.lines)[-2000:]))

    def _read(self):
        for raw in self.p.stderr:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if "tracing" in line:
                self.ready.set()
        self.ready.set()

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        try:
            rc = self.p.wait(600)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise RuntimeError("memtrace-bpf did not exit within 600 s of SIGINT")
        self.t.join(5)
        if rc != 0:
            raise RuntimeError("memtrace-bpf exited %d after SIGINT: %s"
                               % (rc, "".join(self.lines)[-2000:]))
        return rc


def run_workload(exe, kind, n):
    """(ns per iteration from the loop, wall s, user+sys s)"""
    t0 = time.perf_counter()
    p = subprocess.Popen([exe, kind, str(n)], stdout=subprocess.PIPE)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError("%s %s %d exited %d" % (exe, kind, n, p.returncode))
    return float(out.decode().strip()), wall, ru.ru_utime + ru.ru_stime


def tool_args(mode):
    return {"c-other": ["-c", OTHER_COMM], "c-self": ["-c", LOOP_COMM],
            "system-wide": []}[mode]


def timed(tool, mode, exe, kind, n, tmp, tag):
    if mode == "untraced":
        return run_workload(exe, kind, n)
    t = Tool(tool, tool_args(mode), tmp, tag)
    try:
        r = run_workload(exe, kind, n)
    except Exception:
        t.p.send_signal(signal.SIGINT)
        t.p.wait(600)
        raise
    t.stop()
    return r


def mt_progs():
    """{(id, name): (run_cnt, run_time_ns)} of the loaded BPF programs named mt_*
    (bpftool here does not list owning pids)."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {(p["id"], p.get("name", "?")): (p.get("run_cnt", 0), p.get("run_time_ns", 0))
            for p in json.loads(out) if p.get("name", "").startswith("mt_")}


def wait_quiet(limit=20):
    """Wait (up to limit s) until no other memtrace-bpf has programs loaded;
    return True if some still had (the sample is flagged)."""
    t0 = time.time()
    while mt_progs():
        if time.time() - t0 > limit:
            return True
        time.sleep(1)
    return False


def bpf_stats_pass(tool, exe, kind, n, tmp, mode="c-other"):
    print("\n-- BPF run time during one %s run of %s (n=%d), kernel.bpf_stats_enabled=1"
          % (mode, kind, n))
    old = open("/proc/sys/kernel/bpf_stats_enabled").read().strip()
    subprocess.run(["sysctl", "-q", "kernel.bpf_stats_enabled=1"], check=True)
    try:
        wait_quiet()
        others = set(mt_progs())
        t = Tool(tool, tool_args(mode), tmp, "stats-%s-%s" % (mode, kind))
        before = {k: v for k, v in mt_progs().items() if k not in others}
        ns, wall, cpu = run_workload(exe, kind, n)
        after = {k: v for k, v in mt_progs().items() if k in before}
        t.stop()
    finally:
        subprocess.run(["sysctl", "-q", "kernel.bpf_stats_enabled=" + old], check=True)
    total = 0
    print("   %-18s %12s %12s %10s" % ("program", "runs", "run_ns", "ns/run"))
    for k in sorted(after):
        c0, t0 = before.get(k, (0, 0))
        c1, t1 = after[k]
        dc, dt = c1 - c0, t1 - t0
        total += dt
        if dc:
            print("   %-18s %12d %12d %10.1f" % (k[1], dc, dt, dt / dc))
    print("   total BPF time %.3f ms over %d iterations = %.1f ns per iteration "
          "(loop: %.1f ns/iter; includes every other process's hits in that window)"
          % (total / 1e6, n, total / n, ns))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0,
                    help="target untraced duration of a malloc/mmap run")
    ap.add_argument("--memtrace", default=os.environ.get("MEMTRACE_BPF", DEFAULT_TOOL))
    ap.add_argument("--workloads", default="malloc,mmap")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--small-malloc", type=int, default=100000,
                    help="N for c-self/system-wide malloc runs")
    ap.add_argument("--small-mmap", type=int, default=20000,
                    help="N for c-self/system-wide mmap runs")
    ap.add_argument("--bpf-stats", nargs="?", const="c-other", default=None,
                    metavar="MODES", help="comma-separated modes (default c-other)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (memtrace-bpf needs it)")
    if not os.access(args.memtrace, os.X_OK):
        sys.exit("no memtrace-bpf at %s (--memtrace)" % args.memtrace)
    args.memtrace = snapshot(args.memtrace)
    modes = args.modes.split(",")
    kinds = args.workloads.split(",")

    tmp = tempfile.mkdtemp(prefix="mtb-comm-")
    loop = compile_c(tmp, LOOP_COMM, WORKLOAD_C)
    other_exe = compile_c(tmp, OTHER_COMM, OTHER_C)
    other = subprocess.Popen([other_exe])
    try:
        # Calibrate N so that an untraced run takes about --seconds.
        n_big = {}
        for kind, probe_n in (("malloc", 2000000), ("mmap", 20000)):
            if kind not in kinds:
                continue
            runs = [run_workload(loop, kind, probe_n)[0] for _ in range(3)]
            n_big[kind] = max(1000, int(args.seconds * 1e9 / min(runs)))
        n_small = {"malloc": args.small_malloc, "mmap": args.small_mmap}
        print("memtrace-bpf: %s" % args.memtrace)
        print("kernel %s, %d CPUs, %d repetitions, modes alternate order each repetition"
              % (os.uname().release, os.cpu_count(), args.reps))
        for kind in kinds:
            print("N(%s): %d for untraced/c-other, %d for c-self/system-wide"
                  % (kind, n_big[kind], min(n_small[kind], n_big[kind])))
        sys.stdout.flush()

        res = {(k, m): [] for k in kinds for m in modes}
        for rep in range(args.reps):
            for kind in kinds:
                order = modes if rep % 2 == 0 else list(reversed(modes))
                for mode in order:
                    n = n_big[kind] if mode in ("untraced", "c-other") else \
                        min(n_small[kind], n_big[kind])
                    busy = wait_quiet()
                    for attempt in range(3):
                        try:
                            r = timed(args.memtrace, mode, loop, kind, n, tmp,
                                      "%s-%s-%d" % (kind, mode, rep))
                            break
                        except RuntimeError as e:  # e.g. binary being rebuilt
                            print("  retry (%s)" % e, file=sys.stderr)
                            time.sleep(5)
                    else:
                        raise
                    res[(kind, mode)].append((n,) + r + (busy,))
            print("rep %d/%d done" % (rep + 1, args.reps), file=sys.stderr)

        verdicts = []
        for kind in (kinds if args.reps > 0 else []):
            print("\n== %s loop (%s)" % (kind, "malloc(64)/free pairs" if kind == "malloc"
                                          else "mmap 64 KiB + touch 16 pages + munmap"))
            print("%-12s %9s %12s %12s %12s %10s %10s %10s %10s" %
                  ("mode", "N", "ns/iter", "(min..max)", "wall s", "user+sys s",
                   "ratio", "wall/N", "cpu/N"))
            base = res.get((kind, "untraced"))
            b_ns = med([r[1] for r in base]) if base else None
            b_wall = med([r[2] / r[0] for r in base]) if base else None
            b_cpu = med([r[3] / r[0] for r in base]) if base else None
            for mode in modes:
                rs = res[(kind, mode)]
                ns = [r[1] for r in rs]
                wall = [r[2] for r in rs]
                cpu = [r[3] for r in rs]
                m_ns = med(ns)
                ratio = m_ns / b_ns if b_ns else float("nan")
                wr = med([r[2] / r[0] for r in rs]) / b_wall if b_wall else float("nan")
                cr = med([r[3] / r[0] for r in rs]) / b_cpu if b_cpu else float("nan")
                print("%-12s %9d %12.2f %12s %12.3f %10.3f %9.3fx %9.3fx %9.3fx" %
                      (mode, rs[0][0], m_ns, "%.1f..%.1f" % (min(ns), max(ns)), med(wall),
                       med(cpu), ratio, wr, cr))
            if base and (kind, "c-other") in res:
                co = res[(kind, "c-other")]
                paired = [c[1] / b[1] for b, c in zip(base, co)]
                r_ns = med([r[1] for r in co]) / b_ns
                r_wall = med([r[2] / r[0] for r in co]) / b_wall
                r_cpu = med([r[3] / r[0] for r in co]) / b_cpu
                spread = (max(r[1] for r in base) - min(r[1] for r in base)) / b_ns
                ok = r_ns <= 1.05
                verdicts.append((kind, ok))
                print("c-other / untraced: loop %.3f (paired median %.3f), wall %.3f, "
                      "user+sys %.3f -> %s (limit 1.05; untraced run-to-run spread %.1f%%)"
                      % (r_ns, med(paired), r_wall, r_cpu, "PASS" if ok else "FAIL",
                         100 * spread))
            busy = {m: sum(1 for r in res[(kind, m)] if r[4]) for m in modes}
            if any(busy.values()):
                print("runs during which another memtrace-bpf had BPF programs loaded: %s"
                      % busy)
            if (kind, "c-self") in res and b_ns:
                r = med([x[1] for x in res[(kind, "c-self")]]) / b_ns
                if kind == "malloc":
                    print("c-self / untraced: %.1fx (probes attached when the comm matches: %s)"
                          % (r, "yes" if r > 1.5 else "NOT VISIBLE"))
                else:
                    print("c-self / untraced: %.2fx (syscall records with stacks)" % r)
        print()
        for kind, ok in verdicts:
            print("%s: %s" % (kind, "PASS" if ok else "FAIL"))

        if args.bpf_stats:
            for mode in args.bpf_stats.split(","):
                for kind in kinds:
                    n = n_big[kind] if mode in ("untraced", "c-other") else \
                        min(n_small[kind], n_big[kind])
                    bpf_stats_pass(args.memtrace, loop, kind, n, tmp, mode)
    finally:
        other.kill()
        other.wait()


if __name__ == "__main__":
    main()
