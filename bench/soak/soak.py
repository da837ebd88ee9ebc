#!/usr/bin/env python3
"""Soak of the always-on daemon (issue 34): `memtrace-bpf --sample-bytes 524288
--inject -c redis-soak -c soak_storm --pprof-dir DIR --pprof-every 60
--metrics ADDR` for --minutes (default 30) over

  * a long-running server: Debian's redis-server (copied as OUT/bin/redis-soak:
    -c matches every process of a name, and others run redis-server and
    alloc_rounds on this machine) on a free loopback port
    (--save '' --appendonly no), started before the daemon (injected as a
    running process), under redis-benchmark bursts (-c 4, -n per burst, a pause
    between bursts: a steady, modest load on a 2-core machine);
  * a fork/exec storm: tests/targets/alloc_rounds (as OUT/bin/soak_storm) --rounds 2 started --rate
    times a second (every 5th with --fork: a child of an injected process),
    each injected at its exec (BPF stops it there) or refused in one line.

Every --every seconds (30) a sample: the daemon's VmRSS, threads, fds, CPU
seconds, the pprof dir's files and bytes, /metrics (memtrace_tool_resident_bytes,
memtrace_dropped_total, memtrace_stat), the storm processes started and still
running; every 5 s a scan of /proc for a redis-soak or soak_storm in state
T/t (stopped): one seen stopped in every scan for 10 s is a stuck process.

At the end: the storm stops, the daemon gets SIGINT (it must exit 0 and write
its report), redis must still answer PING; a table and a verdict are printed
and written, with every figure, to OUT/summary.json.

  python3 bench/soak/soak.py --tool build/src/loader/memtrace-bpf --out /tmp/soak
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

# Names of their own: other work on the machine runs redis-server and
# tests/targets/alloc_rounds, and `-c` matches every process of a name.
REDIS_COMM = "redis-soak"
STORM_COMM = "soak_storm"
WATCHED = (REDIS_COMM, STORM_COMM)
STUCK_S = 10.0  # stopped this long without a break: stuck


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0])
    return out


def dir_usage(d):
    n = size = 0
    for e in os.scandir(d) if os.path.isdir(d) else []:
        if e.is_file():
            n += 1
            size += e.stat().st_size
    return n, size


def scrape(url):
    """The /metrics series we follow: name{labels} -> value."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError as e:
        return {"error": str(e)}
    keep = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^(memtrace_(?:tool_resident_bytes|dropped_total|stat|processes_exported|processes_over_cap|events_total|snapshot_age_seconds)"
                     r"(?:\{[^}]*\})?)\s+(\S+)", line)
        if m:
            keep[m.group(1)] = float(m.group(2))
    return keep


def stopped_watched():
    """pid -> comm of every redis-soak / soak_storm in state T or t."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        state = s[s.rindex(")") + 2]
        if comm in WATCHED and state in "Tt":
            out[int(d)] = comm
    return out


class Storm(threading.Thread):
    """alloc_rounds --rounds 2 at `rate` a second, reaped as they end."""

    def __init__(self, exe, rate, max_running):
        super().__init__(daemon=True)
        self.exe, self.rate, self.max_running = exe, rate, max_running
        self.started = 0
        self.skipped = 0        # a tick with max_running still running: no start
        self.failed = 0         # exit code other than 0
        self.pids = set()
        self.running = {}       # Popen -> start time
        self.oldest_s = 0.0     # the age of the oldest running, at the last tick
        self.oldest_max_s = 0.0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def reap(self):
        now = time.monotonic()
        for p, t0 in list(self.running.items()):
            rc = p.poll()
            if rc is not None:
                del self.running[p]
                if rc != 0:
                    self.failed += 1
        self.oldest_s = max((now - t0 for t0 in self.running.values()), default=0.0)
        self.oldest_max_s = max(self.oldest_max_s, self.oldest_s)

    def run(self):
        period = 1.0 / self.rate
        nxt = time.monotonic()
        while not self.stop.is_set():
            with self.lock:
                self.reap()
                if len(self.running) >= self.max_running:
                    self.skipped += 1
                else:
                    args = [self.exe, "--rounds", "2"] + (["--fork"] if self.started % 5 == 4 else [])
                    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    self.running[p] = time.monotonic()
                    self.pids.add(p.pid)
                    self.started += 1
            nxt += period
            self.stop.wait(max(0.0, nxt - time.monotonic()))

    def finish(self, timeout):
        self.stop.set()
        self.join()
        end = time.monotonic() + timeout
        while self.running and time.monotonic() < end:
            with self.lock:
                self.reap()
            time.sleep(0.1)
        return len(self.running)


class Load(threading.Thread):
    """redis-benchmark bursts: -n N -c 4 -q, then a pause."""

    def __init__(self, port, n, pause, logf):
        super().__init__(daemon=True)
        self.port, self.n, self.pause, self.logf = port, n, pause, logf
        self.bursts = self.failed = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            r = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(self.port), "-n", str(self.n),
                                "-c", "4", "-q", "-t", "set,get,lpush,lpop", "-d", "128", "-r", "100000"],
                               stdout=self.logf, stderr=subprocess.STDOUT)
            self.bursts += 1
            if r.returncode != 0:
                self.failed += 1
            self.stop.wait(self.pause)


def classify(stderr_text, storm_pids, redis_pid):
    """The daemon's -v log: which pids it injected, which it said it would not
    (one line each), which ended during their attach."""
    injected = {int(m) for m in re.findall(r"injected \S+ into pid (\d+):", stderr_text)}
    refused = {}
    for m in re.finditer(r"^memtrace-bpf: --inject: (.*); pid (\d+) is traced with uprobes instead$", stderr_text, re.M):
        refused.setdefault(int(m.group(2)), m.group(1))
    went = {int(m) for m in re.findall(r"pid (\d+) went during its attach", stderr_text)}
    execs = {}
    for m in re.finditer(r"^memtrace-bpf: exec pid (\d+) \((.*)\)$", stderr_text, re.M):
        execs.setdefault(int(m.group(1)), m.group(2))
    forks = [(int(a), int(b)) for a, b in re.findall(r"^memtrace-bpf: fork (\d+) -> (\d+)$", stderr_text, re.M)]
    storm = {"started": len(storm_pids), "injected": 0, "refused": 0, "went": 0, "no_line": 0, "no_line_pids": []}
    for pid in sorted(storm_pids):
        if pid in injected:
            storm["injected"] += 1
        elif pid in refused:
            storm["refused"] += 1
        elif pid in went:
            storm["went"] += 1
        else:
            storm["no_line"] += 1
            if len(storm["no_line_pids"]) < 20:
                storm["no_line_pids"].append(pid)
    # Refusal reasons, by their text with the numbers taken out.
    reasons = {}
    for pid, why in refused.items():
        key = re.sub(r"\d+", "N", why)
        reasons[key] = reasons.get(key, 0) + 1
    fork_children = [c for p, c in forks if p in storm_pids]
    return {
        "storm": storm,
        "storm_execs_seen": sum(1 for p in storm_pids if p in execs),
        "storm_fork_children_seen": len(fork_children),
        "redis_injected": redis_pid in injected,
        "redis_refused": refused.get(redis_pid),
        "injected_total": len(injected),
        "refused_total": len(refused),
        "refusal_reasons": reasons,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, help="memtrace-bpf (its agent beside it)")
    ap.add_argument("--storm-exe", help="alloc_rounds (default: TOOL/../../tests/targets/alloc_rounds)")
    ap.add_argument("--out", required=True, help="directory for the logs, the report and summary.json")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--every", type=float, default=30, help="seconds between two samples")
    ap.add_argument("--rate", type=float, default=15, help="storm processes started a second")
    ap.add_argument("--max-running", type=int, default=64, help="storm processes running at once, at most")
    ap.add_argument("--cpu-cap", type=float, default=1.0,
                    help="the daemon's CPU, cores at most (a cgroup v1 cpu quota; 0: none): other work runs here")
    ap.add_argument("--min-available-mib", type=int, default=4096,
                    help="end the soak early when the machine's MemAvailable falls below this")
    ap.add_argument("--max-threads", type=int, default=400, help="end the soak early past this many daemon threads")
    ap.add_argument("--burst", type=int, default=20000, help="redis-benchmark -n of one burst")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between two bursts")
    a = ap.parse_args()

    tool = os.path.abspath(a.tool)
    storm_exe = a.storm_exe or os.path.join(os.path.dirname(tool), "..", "..", "tests", "targets", "alloc_rounds")
    storm_exe = os.path.abspath(storm_exe)
    for f in (tool, storm_exe):
        if not os.access(f, os.X_OK):
            sys.exit(f"soak.py: {f}: not an executable")
    os.makedirs(a.out, exist_ok=True)
    pprof_dir = os.path.join(a.out, "pprof")
    bindir = os.path.join(a.out, "bin")
    os.makedirs(bindir, exist_ok=True)
    redis_exe = os.path.join(bindir, REDIS_COMM)
    shutil.copy2(shutil.which("redis-server"), redis_exe)
    shutil.copy2(storm_exe, os.path.join(bindir, STORM_COMM))
    storm_exe = os.path.join(bindir, STORM_COMM)
    rport, mport = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{mport}/metrics"

    redis_log = open(os.path.join(a.out, "redis.log"), "w")
    redis = subprocess.Popen([redis_exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--daemonize", "no"], stdout=redis_log, stderr=subprocess.STDOUT)
    for _ in range(50):
        if subprocess.run(["redis-cli", "-p", str(rport), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
            break
        time.sleep(0.1)
    else:
        sys.exit("soak.py: redis-server did not answer PING in 5 s")

    cmd = [tool, "-v", "--sample-bytes", "524288", "--inject", "-c", REDIS_COMM, "-c", STORM_COMM,
           "--pprof-dir", pprof_dir, "--pprof-every", "60", "--metrics", f"127.0.0.1:{mport}",
           "-o", os.path.join(a.out, "report.json"), "-o", os.path.join(a.out, "report.txt")]
    derr = open(os.path.join(a.out, "daemon.stderr"), "w")
    dout = open(os.path.join(a.out, "daemon.stdout"), "w")
    t0 = time.monotonic()
    daemon = subprocess.Popen(cmd, stdout=dout, stderr=derr)
    print("soak.py:", " ".join(cmd), flush=True)
    cg = None
    if a.cpu_cap > 0 and os.path.isdir("/sys/fs/cgroup/cpu"):
        cg = f"/sys/fs/cgroup/cpu/memtrace-soak-{os.getpid()}"
        os.makedirs(cg, exist_ok=True)
        with open(f"{cg}/cpu.cfs_quota_us", "w") as f:
            f.write(str(int(a.cpu_cap * 100000)))
        with open(f"{cg}/cgroup.procs", "w") as f:
            f.write(str(daemon.pid))
    for _ in range(100):
        if "error" not in scrape(metrics_url):
            break
        if daemon.poll() is not None:
            sys.exit(f"soak.py: the daemon ended at its start, exit {daemon.returncode}; see {a.out}/daemon.stderr")
        time.sleep(0.2)

    bench_log = open(os.path.join(a.out, "redis-benchmark.log"), "w")
    load = Load(rport, a.burst, a.pause, bench_log)
    storm = Storm(storm_exe, a.rate, a.max_running)
    load.start()
    storm.start()

    samples, stuck, prev_stopped, stopped_seen = [], {}, {}, 0
    end = t0 + a.minutes * 60
    next_sample = time.monotonic()
    crashed = None
    early = None
    while True:
        now = time.monotonic()
        if daemon.poll() is not None:
            crashed = daemon.returncode
            break
        st = stopped_watched()
        stopped_seen = max(stopped_seen, len(st))
        # Stopped since the first of the scans in a row that saw it so: stuck
        # past STUCK_S (a process waits in the injection queue for seconds at
        # most; two scans in a row were 5 s apart but for the last ones, a
        # few ms apart, which made a queued process "stuck").
        prev_stopped = {pid: prev_stopped.get(pid, now) for pid in st}
        for pid, comm in st.items():
            if now - prev_stopped[pid] >= STUCK_S:
                stuck.setdefault(pid, {"comm": comm, "first_s": round(prev_stopped[pid] - t0, 1)})
        if now >= next_sample or now >= end:
            try:
                s = proc_status(daemon.pid)
                fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
                cpu = cpu_seconds(daemon.pid)
            except OSError:
                continue
            n, size = dir_usage(pprof_dir)
            mi = meminfo()
            m = scrape(metrics_url)
            with storm.lock:
                running, oldest = len(storm.running), storm.oldest_s
            row = {
                "t_s": round(now - t0, 1),
                "rss_kb": int(s["VmRSS"].split()[0]),
                "rss_anon_kb": int(s["RssAnon"].split()[0]),
                "rss_shmem_kb": int(s["RssShmem"].split()[0]),
                "vm_size_kb": int(s["VmSize"].split()[0]),
                "sys_shmem_kb": mi["Shmem"],
                "sys_available_kb": mi["MemAvailable"],
                "snapshot_age_s": m.get("memtrace_snapshot_age_seconds"),
                "threads": int(s["Threads"]),
                "fds": fds,
                "cpu_s": round(cpu, 1),
                "pprof_files": n,
                "pprof_bytes": size,
                "metrics_rss": m.get("memtrace_tool_resident_bytes"),
                "dropped": {k: v for k, v in m.items() if k.startswith("memtrace_dropped_total") and v},
                "stats": {k: v for k, v in m.items() if k.startswith("memtrace_stat")},
                "exported": m.get("memtrace_processes_exported"),
                "scrape_error": m.get("error"),
                "storm_started": storm.started,
                "storm_running": running,
                "storm_oldest_s": round(oldest, 1),
                "stopped_now": len(st),
                "stuck_so_far": len(stuck),
                "bursts": load.bursts,
            }
            samples.append(row)
            print(f"t={row['t_s']:7.1f}s rss={row['rss_kb'] / 1024:7.1f}MiB thr={row['threads']} fds={row['fds']} "
                  f"cpu={row['cpu_s']}s pprof={n}/{size / 1e6:.1f}MB storm={storm.started} run={running} "
                  f"stopped={len(st)} stuck={len(stuck)} dropped={sum(row['dropped'].values()):.0f} "
                  f"shmem={mi['Shmem'] / 2**20:.1f}GiB avail={mi['MemAvailable'] / 2**20:.1f}GiB "
                  f"age={row['snapshot_age_s']}", flush=True)
            next_sample += a.every
            if now >= end:
                break
        if meminfo()["MemAvailable"] < a.min_available_mib * 1024:
            early = f"MemAvailable under {a.min_available_mib} MiB at {now - t0:.0f} s"
        elif os.path.exists(f"/proc/{daemon.pid}/status") and int(proc_status(daemon.pid)["Threads"]) > a.max_threads:
            early = f"the daemon past {a.max_threads} threads at {now - t0:.0f} s"
        if early:
            print("soak.py: ending early:", early, flush=True)
            break
        time.sleep(max(0.0, min(5.0, end - time.monotonic())))

    load.stop.set()
    left_running = storm.finish(15)
    load.join(120)
    rc = crashed
    exit_s = None
    if crashed is None:
        t_int = time.monotonic()
        daemon.send_signal(signal.SIGINT)
        try:
            rc = daemon.wait(120)
            exit_s = round(time.monotonic() - t_int, 1)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            rc = "no exit in 120 s after SIGINT (killed)"
    derr.close()
    dout.close()
    if cg:
        os.rmdir(cg)
    redis_pong = subprocess.run(["redis-cli", "-p", str(rport), "ping"], capture_output=True, text=True).stdout.strip()
    redis_state = open(f"/proc/{redis.pid}/stat").read().rsplit(")", 1)[1].split()[0] if redis.poll() is None else "gone"
    redis.terminate()
    redis.wait(30)

    report = {}
    rp = os.path.join(a.out, "report.json")
    if os.path.exists(rp):
        with open(rp) as f:
            report = json.load(f)
    with open(os.path.join(a.out, "daemon.stderr"), errors="replace") as f:
        err = f.read()
    cls = classify(err, storm.pids, redis.pid)

    # The verdict.
    base = next((r for r in samples if r["t_s"] >= 300), samples[0] if samples else None)
    last = samples[-1] if samples else None
    v = {"ended_early": early, "daemon_exit": rc, "exit_after_sigint_s": exit_s, "report_written": bool(report),
         "redis_after": redis_pong, "redis_state_before_stop": redis_state, "stopped_stuck": stuck,
         "stopped_max_in_one_scan": stopped_seen, "storm_left_running": left_running,
         "storm_oldest_max_s": round(storm.oldest_max_s, 1), "storm_skipped_ticks": storm.skipped,
         "storm_failed": storm.failed, "bursts": load.bursts, "bursts_failed": load.failed, **cls}
    if base and last:
        g = (last["rss_kb"] - base["rss_kb"]) / 1024
        v.update(rss_base_t_s=base["t_s"], rss_base_mib=round(base["rss_kb"] / 1024, 1),
                 rss_end_mib=round(last["rss_kb"] / 1024, 1), rss_growth_mib=round(g, 1),
                 rss_growth_pct=round(100 * g * 1024 / base["rss_kb"], 1),
                 rss_max_mib=round(max(r["rss_kb"] for r in samples) / 1024, 1),
                 fds=[min(r["fds"] for r in samples), max(r["fds"] for r in samples)],
                 threads=[min(r["threads"] for r in samples), max(r["threads"] for r in samples)],
                 fds_after_5min=[min(r["fds"] for r in samples if r["t_s"] >= base["t_s"]),
                                 max(r["fds"] for r in samples if r["t_s"] >= base["t_s"])],
                 threads_after_5min=[min(r["threads"] for r in samples if r["t_s"] >= base["t_s"]),
                                     max(r["threads"] for r in samples if r["t_s"] >= base["t_s"])],
                 cpu_s=last["cpu_s"], pprof_files=last["pprof_files"], pprof_bytes=last["pprof_bytes"])
    if report:
        v["report_dropped_nonzero"] = {k: x for k, x in report.get("dropped", {}).items() if x}
        v["report_errors"] = report.get("errors", [])[:20]
        v["report_notes"] = report.get("notes", [])[:20]
        v["report_processes"] = len(report.get("processes", []))
        st = report.get("stats", {})
        v["report_stats"] = {k: st.get(k) for k in ("tool_rss_kb", "tool_peak_rss_kb", "model_images",
                                                    "model_merged_images", "model_sealed_images", "model_stacks",
                                                    "model_live_blocks", "static_exec_stops", "events")}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"command": cmd, "minutes": a.minutes, "rate": a.rate, "max_running": a.max_running,
                   "cpu_cap": a.cpu_cap if cg else None, "samples": samples, "verdict": v}, f, indent=1)

    print()
    print(f"{'t_s':>7} {'rss_MiB':>8} {'metr_MiB':>8} {'thr':>4} {'fds':>4} {'cpu_s':>6} {'pprof':>6} {'pprof_MB':>8} "
          f"{'storm':>6} {'run':>4} {'stop':>4} {'stuck':>5} {'dropped':>7} {'shm_GiB':>7} {'age_s':>6}")
    for r in samples:
        mr = r["metrics_rss"] / 2**20 if r["metrics_rss"] else float("nan")
        print(f"{r['t_s']:7.0f} {r['rss_kb'] / 1024:8.1f} {mr:8.1f} {r['threads']:4} {r['fds']:4} {r['cpu_s']:6.1f} "
              f"{r['pprof_files']:6} {r['pprof_bytes'] / 1e6:8.1f} {r['storm_started']:6} {r['storm_running']:4} "
              f"{r['stopped_now']:4} {r['stuck_so_far']:5} {sum(r['dropped'].values()):7.0f} "
              f"{r['sys_shmem_kb'] / 2**20:7.2f} {r['snapshot_age_s'] if r['snapshot_age_s'] is not None else float('nan'):6.0f}")
    print()
    print(json.dumps(v, indent=1))
    ok = (not early and rc == 0 and bool(report) and not stuck and redis_pong == "PONG" and left_running == 0
          and cls["storm"]["no_line"] == 0 and base is not None
          and v["rss_growth_mib"] <= max(2.0, 0.05 * v["rss_base_mib"])
          and v["threads_after_5min"][1] - v["threads_after_5min"][0] <= 4
          and v["fds_after_5min"][1] - v["fds_after_5min"][0] <= 8)
    print("\nVERDICT:", "PASS" if ok else "FAIL (see the figures above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
