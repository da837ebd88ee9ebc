#!/usr/bin/python3
"""--inject against heaptrack, the BPF path and no tracing, interleaved in
one run, on W1 (python3 json), W3 (sqlite3) and MT (a multi-threaded
allocator stress); medians and ratios (issue 21, docs/inject.md).

  sudo bench/inject/inject_bench.py [--repeat 5] [--build build]
       [--workloads W1,W3,MT] [--modes untraced,heaptrack,bpf,inject,inject-libunwind,inject-sample,inject-fp,inject-got,inject-entry,inject-before]
       [--mt-threads 4] [--mt-rounds 1000000] [--redis-requests 100000]
  sudo bench/inject/inject_bench.py --workloads REDIS --modes untraced,bpf,inject,heaptrack
  sudo bench/inject/inject_bench.py --workloads REDIS --modes untraced,inject-libunwind,inject --repeat 5
  sudo bench/inject/inject_bench.py --workloads W1@jemalloc,W3@tcmalloc,MT@mimalloc --modes heaptrack,inject

Every run starts the target, which waits before its work (W1 and MT read a
line from stdin, sqlite3 waits for its commands on stdin); the tool (bpf:
`memtrace-bpf -p PID`, inject: `memtrace-bpf --inject -p PID`) attaches to
the running process and says "tracing"; then the work starts (inject's
stacks by the agent's walk on the loader's CFI rows, the default;
inject-libunwind: by libunwind's, MEMTRACE_INJECT_UNWIND=libunwind). heaptrack
launches its target (LD_PRELOAD) and starts it at once. Figures:

  workload  wall seconds of the work alone (W1, MT: timed inside the target;
            W3: from sending `.read` to sqlite3's answer to the `.print` that
            follows it): what tracing costs the program
  cpu       the target's CPU seconds over the same span (user + sys; W3:
            /proc/PID/schedstat): steadier than wall on a shared host; the
            tool's own process (memtrace-bpf, heaptrack_interpret) not in it
  done      from the start of the work to the tool's exit, report written
            (heaptrack: its script's exit, interpretation done)
  waits     --inject: inject_full_waits of the report (50 us naps of the
            target's threads on a full ring: the tool's drain was behind)
  e2e       end to end: from the target's launch to the report written and
            the tool exited (the user's prompt back); heaptrack: from
            `heaptrack PROG`'s launch to `heaptrack_print` of its recording
            done (its analysis, output to /dev/null): what a user waits for
            a report (issue 33)

Preloaded allocators (issue 33): a workload named W1@jemalloc, W3@tcmalloc,
MT@mimalloc runs with LD_PRELOAD of Debian's libjemalloc.so.2,
libtcmalloc_minimal.so.4 or libmimalloc.so.2 in every mode (heaptrack's
preload goes before it and calls it).

REDIS (issue 33): Debian's redis-server (libjemalloc) on a loopback port,
no persistence; the tool attaches with -p (heaptrack too: `heaptrack -p`,
through gdb), then `redis-benchmark -h 127.0.0.1 -c 20 -n N -t set,get,lpush`
(--redis-requests N each); its requests/s per test, their mean as the
workload figure (ops/s, higher is better; "x" is then the fraction of
untraced throughput kept). After the tool ends (SIGINT) redis must answer
PING; its report must count allocations under zmalloc.

An --inject attach that is refused (the tool's one line "... traced with
uprobes instead") is printed as it happens and counted per workload at the
end ("not injected in N of R attaches"): its round measured the BPF path.
"""
import argparse
import json
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
ENV = dict(os.environ, PYTHONMALLOC="malloc")
DONE = "MEMTRACE_BENCH_DONE"


def schedstat_s(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0]) / 1e9


def child_named(ppid, comm, timeout=10):
    """The pid of ppid's child called comm (heaptrack's script runs its program as a child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % d) as f:
                    st = f.read()
            except OSError:
                continue
            name = st[st.index("(") + 1:st.rindex(")")]
            fields = st[st.rindex(")") + 2:].split()
            if name == comm and int(fields[1]) == ppid:
                return int(d)
        time.sleep(0.01)
    raise RuntimeError("no child %s of %d" % (comm, ppid))


def workloads(tmp, threads, rounds):
    sql = os.path.join(tmp, "w3.sql")
    subprocess.run([PY, os.path.join(ROOT, "bench/workloads/w3_gen_sql.py"), sql], check=True)
    mt = os.path.join(tmp, "mt_stress")
    subprocess.run(["cc", "-O2", "-g", "-fno-omit-frame-pointer", "-pthread", "-o", mt,
                    os.path.join(HERE, "mt_stress.c")], check=True)
    return {
        "W1": {"argv": [PY, os.path.join(HERE, "wait_then_run.py"), "--go",
                        os.path.join(ROOT, "bench/workloads/w1_json_dicts.py")],
               "what": "PYTHONMALLOC=malloc python3, json round trip of 50k dicts"},
        "W3": {"argv": ["sqlite3", ":memory:"], "sql": sql, "comm": "sqlite3",
               "what": "sqlite3 :memory: .read w3.sql (60k inserts, index, updates)"},
        "MT": {"argv": [mt, "--wait", str(threads), str(rounds)],
               "what": "mt_stress: %d threads x %d malloc/free rounds" % (threads, rounds)},
    }


PRELOAD = {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
           "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
           "mimalloc": "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"}


def redis_ping(port):
    r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), "PING"], capture_output=True, text=True)
    return r.stdout.strip() == "PONG"


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_redis(mode, tool, tmp, requests):
    """ops/s of redis-benchmark against redis-server under mode; (ops, ops, done, waits)."""
    port = free_port()
    srv = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--daemonize", "no"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    for _ in range(500):
        if redis_ping(port):
            break
        time.sleep(0.01)
    else:
        srv.kill()
        raise RuntimeError("redis-server did not answer")
    tool_p = None
    rep = os.path.join(tmp, "r.json")
    if os.path.exists(rep):
        os.unlink(rep)
    if mode == "heaptrack":
        tool_p = subprocess.Popen(["heaptrack", "-o", os.path.join(tmp, "htr"), "-p", str(srv.pid)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(3)  # gdb's attach; heaptrack says nothing when it is in
    elif mode != "untraced":
        tool_p = subprocess.Popen(tool_argv(tool, mode, srv.pid, rep), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=dict(os.environ, **TOOL_ENV.get(mode, {})))
        while True:
            line = tool_p.stderr.readline()
            if not line:
                srv.kill()
                raise RuntimeError("%s: the tool ended before tracing" % mode)
            if "uprobes instead" in line:
                print("  %s: not injected: %s" % (mode, line.strip()), file=sys.stderr, flush=True)
                REFUSED[("REDIS", mode)] = REFUSED.get(("REDIS", mode), 0) + 1
            if "tracing" in line:
                break
    t0 = time.monotonic()
    b = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "20", "-n", str(requests),
                        "-t", "set,get,lpush", "-q"], capture_output=True, text=True)
    rates = [float(x) for x in re.findall(r"([0-9.]+) requests per second", b.stdout)]
    if len(rates) != 3:
        srv.kill()
        raise RuntimeError("redis-benchmark: %s %s" % (b.stdout[-1000:], b.stderr[-1000:]))
    ops = statistics.mean(rates)
    waits = 0
    if mode == "heaptrack":
        # heaptrack_interpret reads until redis closes its pipe: redis
        # ends first (its PING after heaptrack is not checked).
        ok = redis_ping(port)
        srv.terminate()
        srv.wait()
        tool_p.communicate()
        if not ok:
            raise RuntimeError("heaptrack: redis did not answer PING")
        return ops, ops, time.monotonic() - t0, 0, float("nan")
    if tool_p:
        tool_p.send_signal(2)
        _, merr = tool_p.communicate()
        if True:
            if tool_p.returncode != 0:
                raise RuntimeError("%s: tool exited %d: %s" % (mode, tool_p.returncode, merr[-2000:]))
            with open(rep) as f:
                d = json.load(f)
            waits = d.get("stats", {}).get("inject_full_waits", 0)
            p = [x for x in d.get("processes", []) if x.get("pid") == srv.pid]
            zm = 0
            for site in (p[0].get("top_sites", []) + p[0].get("leaks", [])) if p else []:
                if any(f.get("function", "").startswith(("zmalloc", "ztrymalloc")) for f in site.get("stack", [])):
                    zm += 1
            st, dr = d.get("stats", {}), d.get("dropped", {})
            print("  %s: redis allocs %s, %d sites under zmalloc; stacks: %s libunwind's, %s cut, %s verified, "
                  "%s differed" % (mode, p[0]["summary"]["allocs"] if p else "?", zm, st.get("inject_stack_slow"),
                                   dr.get("inject_stack_cut"), st.get("inject_stack_verified"),
                                   st.get("inject_stack_mismatch")), file=sys.stderr, flush=True)
    done = time.monotonic() - t0
    ok = redis_ping(port)
    srv.terminate()
    srv.wait()
    if not ok:
        raise RuntimeError("%s: redis did not answer PING after the tool" % mode)
    return ops, ops, done, waits, float("nan")  # e2e: a server has no end of its own


def tool_argv(tool, mode, pid, rep):
    base = [tool, "-p", str(pid), "--format", "json", "-o", rep]
    if mode == "bpf":
        return base
    if mode == "inject":
        return [tool, "--inject"] + base[1:]
    if mode == "inject-fp":
        return [tool, "--inject", "--unwind", "fp"] + base[1:]
    if mode == "inject-sample":  # issue 34: the documented production rate
        return [tool, "--inject", "--sample-bytes", "524288"] + base[1:]
    if mode in TOOL_ENV:
        return [tool, "--inject"] + base[1:]
    raise SystemExit("unknown mode " + mode)


# --inject with one of its two ways in alone (src/inject/session.cpp):
# inject-got: GOT slots only (no entry trampolines: what --inject was before
# them); inject-entry: entry trampolines only (no GOT slot rewritten).
# inject-before: the tool's fixed cost as before issue 33 (its links closed
# by itself before it exits, its programs verified one after the other).
# inject-libunwind: stacks by libunwind's unw_backtrace, as --inject walked
# them before its own walk on the loader's CFI rows (`inject`, the default;
# docs/inject.md, MEMTRACE_INJECT_UNWIND).
TOOL_ENV = {"inject-got": {"MEMTRACE_INJECT_ENTRIES": "0"}, "inject-entry": {"MEMTRACE_INJECT_GOT": "0"},
            "inject-before": {"MEMTRACE_SYNC_TEARDOWN": "1", "MEMTRACE_SERIAL_LOAD": "1"},
            "inject-libunwind": {"MEMTRACE_INJECT_UNWIND": "libunwind"}}


# (workload, mode) -> attaches refused (the deadlock-window check,
# src/inject/busy_frames.h, or another fallback): printed at the end.
REFUSED = {}


def run_once(w, mode, tool, tmp):
    argv = list(w["argv"])
    if mode == "heaptrack":
        argv = ["heaptrack", "-o", os.path.join(tmp, "ht")] + argv
        for f in os.listdir(tmp):
            if f.startswith("ht."):
                os.unlink(os.path.join(tmp, f))
    env = dict(ENV, LD_PRELOAD=w["preload"]) if w.get("preload") else ENV
    launched = time.monotonic()
    target = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, bufsize=1)
    sqlite = "sql" in w
    if sqlite:
        pid = child_named(target.pid, w["comm"]) if mode == "heaptrack" else target.pid
    else:
        while True:
            line = target.stdout.readline()
            if not line:
                raise RuntimeError("%s: no ready line: %s" % (mode, target.stderr.read()[-2000:]))
            if line.startswith("ready "):
                pid = int(line.split()[1])
                break
    tool_p = None
    rep = os.path.join(tmp, "r.json")
    if mode not in ("untraced", "heaptrack"):
        if os.path.exists(rep):
            os.unlink(rep)
        tool_p = subprocess.Popen(tool_argv(tool, mode, pid, rep), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=dict(os.environ, **TOOL_ENV.get(mode, {})))
        while True:
            line = tool_p.stderr.readline()
            if not line:
                target.kill()
                raise RuntimeError("%s: the tool ended before tracing" % mode)
            if "uprobes instead" in line:
                # An --inject attach refused (the process gets the BPF path):
                # its round measures the BPF path, said so.
                print("  %s: not injected: %s" % (mode, line.strip()), file=sys.stderr, flush=True)
                REFUSED[(w["name"], mode)] = REFUSED.get((w["name"], mode), 0) + 1
            if "tracing" in line:
                break
    t0 = time.monotonic()
    if sqlite:
        c0 = schedstat_s(pid)
        target.stdin.write(".read %s\n.print %s\n" % (w["sql"], DONE))
        target.stdin.flush()
        while True:
            line = target.stdout.readline()
            if not line:
                raise RuntimeError("%s: sqlite3 ended early: %s" % (mode, target.stderr.read()[-2000:]))
            if DONE in line:
                break
        wall = time.monotonic() - t0
        cpu = schedstat_s(pid) - c0
        _, terr = target.communicate()
    else:
        target.stdin.write("go\n")
        target.stdin.flush()
        _, terr = target.communicate()
        m = re.findall(r"workload_seconds ([0-9.]+) cpu ([0-9.]+)", terr)
        if not m:
            raise RuntimeError("%s: no workload_seconds: %s" % (mode, terr[-2000:]))
        wall, cpu = float(m[-1][0]), float(m[-1][1])
    waits = 0
    e2e = time.monotonic() - launched
    if mode == "heaptrack":
        rec = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("ht.")]
        if len(rec) != 1:
            raise RuntimeError("heaptrack: no one recording in %s: %s" % (tmp, rec))
        subprocess.run(["heaptrack_print", rec[0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        e2e = time.monotonic() - launched
    if tool_p:
        _, merr = tool_p.communicate()
        e2e = time.monotonic() - launched
        if tool_p.returncode != 0:
            raise RuntimeError("%s: tool exited %d: %s" % (mode, tool_p.returncode, merr[-2000:]))
        with open(rep) as f:
            d = json.load(f)
        waits = d.get("stats", {}).get("inject_full_waits", 0)
        lost = sum(v for k, v in d.get("dropped", {}).items() if k != "attach_failed")
        if lost:
            print("  %s: dropped %s" % (mode, {k: v for k, v in d["dropped"].items() if v}), file=sys.stderr)
    done = time.monotonic() - t0
    if target.returncode != 0:
        raise RuntimeError("%s: target exited %d: %s" % (mode, target.returncode, terr[-2000:]))
    return wall, cpu, done, waits, e2e


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--workloads", default="W1,W3,MT")
    ap.add_argument("--modes", default="untraced,heaptrack,bpf,inject")
    ap.add_argument("--mt-threads", type=int, default=4)
    ap.add_argument("--mt-rounds", type=int, default=1000000)
    ap.add_argument("--redis-requests", type=int, default=100000)
    a = ap.parse_args()
    tool = os.path.join(a.build, "src/loader/memtrace-bpf")
    modes = a.modes.split(",")
    wls = a.workloads.split(",")
    res = {(w, m): [] for w in wls for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        W = workloads(tmp, a.mt_threads, a.mt_rounds)
        for name in wls:
            if "@" in name:
                base, lib = name.split("@")
                W[name] = dict(W[base], preload=PRELOAD[lib], what=W[base]["what"] + ", LD_PRELOAD=" + PRELOAD[lib])
            if name == "REDIS":
                W[name] = {"what": "redis-server (libjemalloc), redis-benchmark -c 20 -n %d -t set,get,lpush: "
                                   "requests/s (mean of the three tests; higher is better)" % a.redis_requests}
        for name, w in W.items():
            w["name"] = name
        for r in range(a.repeat):
            for w in wls:
                for m in modes:
                    v = run_redis(m, tool, tmp, a.redis_requests) if w == "REDIS" else run_once(W[w], m, tool, tmp)
                    res[(w, m)].append(v)
                    if w == "REDIS":
                        print("round %d %-5s %-16s %10.0f requests/s  done %7.3f s  waits %d" %
                              (r, w, m, v[0], v[2], v[3]), file=sys.stderr, flush=True)
                    else:
                        print("round %d %-3s %-16s workload %7.3f s  cpu %7.3f s  done %7.3f s  waits %d  e2e %7.3f s" %
                              ((r, w, m) + v), file=sys.stderr, flush=True)
        print("medians of %d rounds, interleaved; x: against untraced; /ht: against heaptrack (workload wall, cpu;"
              " e2e: against heaptrack + heaptrack_print)" % a.repeat)
        for w in wls:
            print("\n%s: %s" % (w, W[w]["what"]))
            print("%-16s %9s %9s %9s %7s %8s %8s %8s %7s %7s %7s" %
                  ("mode", "workload", "cpu", "done", "waits", "e2e", "x wall", "x cpu", "/ht wall", "/ht cpu",
                   "/ht e2e"))
            med = {m: [statistics.median(v[i] for v in res[(w, m)]) for i in range(5)] for m in modes}
            base = med.get("untraced")
            ht = med.get("heaptrack")
            for m in modes:
                wl, c, d, wt, e = med[m]
                print("%-16s %9.3f %9.3f %9.3f %7d %8.3f %8s %8s %7s %7s %7s" % (
                    m, wl, c, d, wt, e,
                    "%.2f" % (wl / base[0]) if base else "-", "%.2f" % (c / base[1]) if base else "-",
                    "%.2f" % (wl / ht[0]) if ht else "-", "%.2f" % (c / ht[1]) if ht else "-",
                    "%.2f" % (e / ht[4]) if ht else "-"))
            for m in modes:
                if m.startswith("inject"):
                    print("%-16s not injected (BPF path instead) in %d of %d attaches" %
                          (m, REFUSED.get((w, m), 0), a.repeat))


if __name__ == "__main__":
    main()
