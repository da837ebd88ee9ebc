# Runs a Python workload script in this process, timed from inside:
#   wait_then_run.py [--wait|--go] SCRIPT [ARGS...]
# --go: prints "ready PID" and reads one line from stdin before it runs
# SCRIPT (inject_bench.py attaches a tracer, any kind, meanwhile).
# --wait: prints "ready PID" and sleeps until memtrace's agent records in
# this process (memtrace-bpf --inject -p PID loaded it), then runs SCRIPT.
# Prints "workload_seconds S cpu C" on stderr: the script alone (imports,
# allocations, frees), not the interpreter's start or the tool's attach;
# wall seconds and this process's user + sys seconds (on a busy host the
# CPU time moves far less from run to run).
import ctypes
import os
import resource
import runpy
import sys
import time

args = sys.argv[1:]
wait = args and args[0] == "--wait"
if args and args[0] == "--go":
    args = args[1:]
    print("ready %d" % os.getpid(), flush=True)
    sys.stdin.readline()
elif wait:
    args = args[1:]
    print("ready %d" % os.getpid(), flush=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            lib = ctypes.CDLL("libmemtrace_agent.so", mode=os.RTLD_NOW | os.RTLD_NOLOAD)
            if lib.memtrace_agent_recording():
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.005)
sys.argv = args
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
runpy.run_path(args[0], run_name="__main__")
t1 = time.perf_counter()
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print("workload_seconds %.4f cpu %.4f vcsw %d ivcsw %d majflt %d minflt %d" % (t1 - t0, cpu, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw, r1.ru_majflt - r0.ru_majflt, r1.ru_minflt - r0.ru_minflt), file=sys.stderr, flush=True)
