#!/usr/bin/python3
"""Issue 2: "A process started later must not lose its first allocations to
the time the attach takes: measure with a program that allocates first thing."

The target (C, compiled here) allocates first thing:
  - in a constructor with priority 101 (the first user code that runs after
    the dynamic loader): K blocks, malloc(1000 + i), from mtb_ctor_allocs()
  - first thing in main: K blocks, malloc(3000 + i), from mtb_main_allocs()
all leaked, then prints its pid and CLOCK_MONOTONIC times of the constructor's
and main's first instruction relative to a time stamp taken by the spawner
just before execve.

Cases (one `memtrace-bpf -c mtb_first --format json` session per round; the
untraced runs of each round run just before it, so traced and untraced runs
are interleaved):
  direct      spawner (mtb_spawn, untraced) forks and execs the target
  sh -c       spawner execs `sh -c 'TARGET; true'`: an untraced shell forks
              and execs the target (time stamp is before the exec of sh)
  unrelated   a copy of the target under another comm (mtb_firstu) while the
              tool runs: what an untraced process pays at startup
  dlopen      the target then dlopen()s libmtb_later.so whose constructor does
              K more mallocs (5000 + i), from mtb_lib_allocs(); and, if one is
              installed and loads, dlopen()s a second allocator (mimalloc,
              jemalloc or tcmalloc) and calls its malloc K times (7000 + i)
              from mtb_dl_allocator_allocs() (a different allocator object
              appearing after the process was attached)
  launch      `memtrace-bpf --format json -o F -- TARGET` (one tool per run)

The JSON report is read back: for every spawned pid (from the target's own
output), the blocks of the leak groups whose stack contains mtb_ctor_allocs /
mtb_main_allocs / ... are counted; all K of each must be there (100%).

Latency: median over N of exec -> constructor and exec -> main, untraced vs
with the tool (the tool stops a matching process at exec and again when its
allocator is mapped, until probes are attached); the difference is the
startup delay the attach costs the target.

  sudo bench/attach/first_alloc_window.py [-n 20] [-k 100]
        [--memtrace build/src/loader/memtrace-bpf]
"""
import argparse
import glob
import json
import os
import shutil
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
COMM = "mtb_first"
UNRELATED = "mtb_firstu"

TARGET_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void *ctor_blocks[K], *main_blocks[K], *dl_blocks[K];
static long long t_ctor;

static long long mono(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

__attribute__((noinline)) void mtb_ctor_allocs(void)
{
	for (int i = 0; i < K; i++)
		ctor_blocks[i] = malloc(1000 + i);
}

__attribute__((constructor(101))) static void mtb_early(void)
{
	t_ctor = mono();
	mtb_ctor_allocs();
}

__attribute__((noinline)) void mtb_main_allocs(void)
{
	for (int i = 0; i < K; i++)
		main_blocks[i] = malloc(3000 + i);
}

__attribute__((noinline)) int mtb_dl_allocator_allocs(const char *lib)
{
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return -1;
	void *(*m)(size_t) = (void *(*)(size_t))dlsym(h, "malloc");
	if (!m)
		return -1;
	for (int i = 0; i < K; i++)
		dl_blocks[i] = m(7000 + i);
	return 0;
}

/* argv[1]: exec time stamp (ns); argv[2]: library to dlopen (or "-");
 * argv[3]: allocator library to dlopen and use (or "-") */
int main(int argc, char **argv)
{
	long long t_main = mono();
	mtb_main_allocs();
	long long t0 = argc > 1 ? atoll(argv[1]) : 0;
	int lib = -2, dla = -2;
	if (argc > 2 && strcmp(argv[2], "-"))
		lib = dlopen(argv[2], RTLD_NOW) ? 0 : -1;
	if (argc > 3 && strcmp(argv[3], "-"))
		dla = mtb_dl_allocator_allocs(argv[3]);
	char buf[160];
	int n = snprintf(buf, sizeof buf, "%d %lld %lld %d %d\n", (int)getpid(), t_ctor - t0,
			 t_main - t0, lib, dla);
	write(1, buf, n);
	return 0;
}
"""

LIB_C = r"""
#include <stdlib.h>
static void *blocks[K];
__attribute__((noinline)) void mtb_lib_allocs(void)
{
	for (int i = 0; i < K; i++)
		blocks[i] = malloc(5000 + i);
}
__attribute__((constructor)) static void lib_init(void) { mtb_lib_allocs(); }
"""

SPAWN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
/* mtb_spawn PROG ARGS...: fork; in the child, replace every "@T0@" in ARGS
 * by CLOCK_MONOTONIC ns taken just before execv(PROG). */
int main(int argc, char **argv)
{
	pid_t pid = fork();
	if (pid == 0) {
		char ts[32], *buf[64];
		struct timespec t;
		int i;
		for (i = 1; i < argc && i < 63; i++)
			buf[i - 1] = argv[i];
		buf[i - 1] = NULL;
		clock_gettime(CLOCK_MONOTONIC, &t);
		snprintf(ts, sizeof ts, "%lld", t.tv_sec * 1000000000LL + t.tv_nsec);
		for (i = 0; buf[i]; i++) {
			char *p = strstr(buf[i], "@T0@");
			if (p) {
				char *s = malloc(strlen(buf[i]) + 32);
				sprintf(s, "%.*s%s%s", (int)(p - buf[i]), buf[i], ts, p + 4);
				buf[i] = s;
			}
		}
		execv(buf[0], buf);
		_exit(127);
	}
	int st;
	waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
"""

# group -> (allocating function, first block size); block sizes are first+i, i<K
GROUPS = {"ctor": ("mtb_ctor_allocs", 1000), "main": ("mtb_main_allocs", 3000),
          "lib": ("mtb_lib_allocs", 5000), "dlalloc": ("mtb_dl_allocator_allocs", 7000)}


def build(tmp, k):
    def cc(name, src, extra):
        c = os.path.join(tmp, name + ".c")
        with open(c, "w") as f:
            f.write(src)
        out = os.path.join(tmp, name)
        subprocess.run(["cc", "-O2", "-g", "-fno-omit-frame-pointer", "-fno-builtin-malloc",
                        "-DK=%d" % k, "-o", out, c] + extra, check=True)
        return out
    target = cc(COMM, TARGET_C, ["-ldl"])
    unrelated = os.path.join(tmp, UNRELATED)
    shutil.copy(target, unrelated)
    lib = cc("libmtb_later.so", LIB_C, ["-shared", "-fPIC"])
    spawn = cc("mtb_spawn", SPAWN_C, [])
    return target, unrelated, lib, spawn


def find_dl_allocator(target):
    """A second allocator library that a glibc program can dlopen and use."""
    cands = []
    for pat in ("libmimalloc.so.2", "libjemalloc.so.2", "libtcmalloc_minimal.so.4"):
        cands += glob.glob("/usr/lib/x86_64-linux-gnu/" + pat)
    for c in cands:
        r = subprocess.run([target, "0", "-", c], capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.split()[4] == "0":
            return c
    return None


class Tool:
    def __init__(self, tool, args, tmp, tag):
        self.json = os.path.join(tmp, "report-%s.json" % tag)
        self.p = subprocess.Popen([tool] + args + ["--format", "json", "--top", "100",
                                                   "-o", self.json],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        self.lines = []
        self.ready = threading.Event()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()
        if not self.ready.wait(120) or self.p.poll() is not None:
            self.p.kill()
            self.p.wait()
            raise RuntimeError("memtrace-bpf did not start: " + "".join(self.lines)[-2000:])

    def _read(self):
        for raw in self.p.stderr:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if "tracing" in line:
                self.ready.set()
        self.ready.set()

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        rc = self.p.wait(600)
        self.t.join(5)
        if rc != 0:
            raise RuntimeError("memtrace-bpf exited %d after SIGINT: %s"
                               % (rc, "".join(self.lines)[-2000:]))
        with open(self.json) as f:
            return json.load(f)


def spawn(spawner, argv):
    r = subprocess.run([spawner] + argv, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (argv, r.returncode, r.stderr))
    f = r.stdout.split()
    return {"pid": int(f[0]), "ctor_ns": int(f[1]), "main_ns": int(f[2]),
            "lib": int(f[3]), "dla": int(f[4])}


def seen_blocks(report, pid, k):
    """{group: blocks} for pid in a memtrace-bpf JSON report (None if absent).
    A leak group is assigned by its mean block size (the groups' size ranges
    are disjoint), so that a frame the tool could not symbolize does not hide
    a block; "<group>_sym" counts the blocks whose stack also names the
    allocating function."""
    for p in report.get("processes", []):
        if p.get("pid") != pid:
            continue
        res = {g: 0 for g in GROUPS}
        res.update({g + "_sym": 0 for g in GROUPS})
        for leak in p.get("leaks", []):
            blocks = leak.get("blocks", 0)
            if not blocks:
                continue
            mean = leak.get("bytes", 0) / blocks
            names = [fr.get("function") or "" for fr in leak.get("stack", [])]
            for g, (fn, first) in GROUPS.items():
                if first <= mean < first + k:
                    res[g] += blocks
                    if any(n.startswith(fn) for n in names):
                        res[g + "_sym"] += blocks
        res["_allocs"] = p.get("summary", {}).get("allocs", 0)
        res["_leak_groups_total"] = p.get("leak_groups_total")
        return res
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="processes per case")
    ap.add_argument("-k", type=int, default=100, help="allocations per group")
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--memtrace", default=os.environ.get("MEMTRACE_BPF", DEFAULT_TOOL))
    ap.add_argument("--no-launch", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root")
    if not os.access(args.memtrace, os.X_OK):
        sys.exit("no memtrace-bpf at %s (--memtrace)" % args.memtrace)
    args.memtrace = snapshot(args.memtrace)
    K, N = args.k, args.n
    tmp = tempfile.mkdtemp(prefix="mtb-attach-")
    target, unrelated, lib, spawner = build(tmp, K)
    dla = find_dl_allocator(target)
    print("memtrace-bpf: %s" % args.memtrace)
    print("kernel %s, %d CPUs; N=%d processes per case, K=%d allocations per group"
          % (os.uname().release, os.cpu_count(), N, K))
    print("dlopen'd second allocator: %s" % (dla or "none usable (case skipped)"))
    sys.stdout.flush()

    direct = [target, "@T0@"]
    via_sh = ["/bin/sh", "-c", "%s @T0@; true" % target]
    lat = {c: [] for c in ("untraced direct", "untraced sh -c", "traced direct",
                           "traced sh -c", "unrelated, tool running")}
    seen = {c: [] for c in ("direct", "sh -c", "dlopen", "launch")}  # (pid, res)
    problems = []
    rounds = (N + args.per_round - 1) // args.per_round
    done = 0
    for rnd in range(rounds):
        m = min(args.per_round, N - done)
        done += m
        for _ in range(m):
            r = spawn(spawner, direct)
            lat["untraced direct"].append(r)
            lat["untraced sh -c"].append(spawn(spawner, via_sh))
        for attempt in range(3):
            try:
                tool = Tool(args.memtrace, ["-c", COMM], tmp, "c-%d-%d" % (rnd, attempt))
                break
            except RuntimeError as e:
                print("  retry: %s" % e, file=sys.stderr)
                time.sleep(5)
        else:
            raise RuntimeError("memtrace-bpf does not start")
        mine = []
        try:
            for _ in range(m):
                r = spawn(spawner, direct)
                lat["traced direct"].append(r)
                mine.append(("direct", r))
                r = spawn(spawner, via_sh)
                lat["traced sh -c"].append(r)
                mine.append(("sh -c", r))
                lat["unrelated, tool running"].append(spawn(spawner, [unrelated, "@T0@"]))
                r = spawn(spawner, [target, "@T0@", lib, dla or "-"])
                mine.append(("dlopen", r))
        finally:
            report = tool.stop()
        for case, r in mine:
            seen[case].append((r, seen_blocks(report, r["pid"], K)))
        d = report.get("dropped", {})
        if any(v for v in d.values()):
            problems.append("round %d: dropped %s" % (rnd, {k: v for k, v in d.items() if v}))
        if report.get("errors"):
            problems.append("round %d: errors %s" % (rnd, report["errors"][:3]))
        print("round %d/%d done" % (rnd + 1, rounds), file=sys.stderr)

    if not args.no_launch:
        for i in range(N):
            rep = os.path.join(tmp, "launch-%d.json" % i)
            r = subprocess.run([args.memtrace, "--format", "json", "--top", "100", "-o", rep,
                                "--", target, "0", lib, dla or "-"],
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                problems.append("launch %d: exit %d %s" % (i, r.returncode, r.stderr[-300:]))
                continue
            f = r.stdout.split()
            res = {"pid": int(f[0]), "lib": int(f[3]), "dla": int(f[4])}
            with open(rep) as fh:
                seen["launch"].append((res, seen_blocks(json.load(fh), res["pid"], K)))

    # ---- counts
    print("\n== first allocations seen (blocks reported as leaked, by allocating function)")
    print("%-8s %5s  %-16s %-16s %-18s %-18s" % ("case", "procs", "constructor", "main",
                                                "dlopen'd lib ctor", "dlopen'd allocator"))
    total_exp = total_seen = 0
    verdict = True
    unsym = []
    for case, rows in seen.items():
        if not rows:
            continue
        cols = []
        for g in ("ctor", "main", "lib", "dlalloc"):
            want = 0
            got = 0
            for r, res in rows:
                if g == "lib" and r["lib"] != 0:
                    continue
                if g == "dlalloc" and r["dla"] != 0:
                    continue
                want += K
                got += res[g] if res else 0
            if want == 0:
                cols.append("-")
                continue
            cols.append("%d/%d %5.1f%%" % (got, want, 100.0 * got / want))
            sym = sum(res[g + "_sym"] for r, res in rows if res and
                      (g not in ("lib", "dlalloc") or r[g if g == "lib" else "dla"] == 0))
            if sym != got:
                unsym.append("%s/%s: %d of %d seen blocks have no stack frame naming %s"
                             % (case, g, got - sym, got, GROUPS[g][0]))
            if g in ("ctor", "main"):
                total_exp += want
                total_seen += got
                verdict &= got == want
        missing = sum(1 for _, res in rows if res is None)
        print("%-8s %5d  %-16s %-16s %-18s %-18s%s" % (case, len(rows), *cols,
              "  (%d pids absent from the report)" % missing if missing else ""))
    print("constructor+main blocks over all cases: %d/%d = %.2f%% -> %s"
          % (total_seen, total_exp, 100.0 * total_seen / max(1, total_exp),
             "PASS" if verdict else "FAIL"))
    for u in unsym:
        print("  symbolization: " + u)
    worst = [(c, r["pid"], res) for c, rows in seen.items() for r, res in rows
             if res is None or res["ctor"] != K or res["main"] != K]
    for c, pid, res in worst[:10]:
        print("  incomplete: %s pid %d: %s" % (c, pid, res))

    # ---- latency
    print("\n== startup latency (median over N, microseconds; exec = spawner's time stamp"
          " just before execve)")
    print("%-26s %5s %14s %14s %14s" % ("case", "n", "exec->ctor", "exec->main", "(max main)"))
    for c, rs in lat.items():
        print("%-26s %5d %14.1f %14.1f %14.1f" % (
            c, len(rs), med([r["ctor_ns"] for r in rs]) / 1e3,
            med([r["main_ns"] for r in rs]) / 1e3,
            max([r["main_ns"] for r in rs] or [0]) / 1e3))
    for a, b in (("traced direct", "untraced direct"), ("traced sh -c", "untraced sh -c"),
                 ("unrelated, tool running", "untraced direct")):
        dm = med([r["main_ns"] for r in lat[a]]) - med([r["main_ns"] for r in lat[b]])
        dc = med([r["ctor_ns"] for r in lat[a]]) - med([r["ctor_ns"] for r in lat[b]])
        print("extra delay %-26s vs %-16s: +%.1f us to ctor, +%.1f us to main"
              % (a, b, dc / 1e3, dm / 1e3))
    if problems:
        print("\nproblems:")
        for p in problems[:20]:
            print("  " + p)


if __name__ == "__main__":
    main()
