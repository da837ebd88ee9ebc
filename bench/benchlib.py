"""Helpers shared by the bench scripts (import with bench/ on sys.path)."""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(tool):
    """Copy the binary (others may rebuild the shared build dir while we run);
    retry while it is being written."""
    d = tempfile.mkdtemp(prefix="mtb-tool-")
    dst = os.path.join(d, "memtrace-bpf")
    for _ in range(30):
        try:
            shutil.copy2(tool, dst)
            # --inject's agent, found beside the program (session.cpp's
            # agent_path): without it --inject falls back to uprobes.
            agent = os.path.join(os.path.dirname(tool), "libmemtrace_agent.so")
            if os.path.exists(agent):
                shutil.copy2(agent, os.path.join(d, "libmemtrace_agent.so"))
            if subprocess.run([dst, "--help"], capture_output=True, timeout=30).returncode == 0:
                st = os.stat(tool)
                print("memtrace-bpf snapshot of %s (mtime %s, git %s)" % (
                    tool, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)),
                    subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                                   capture_output=True, text=True).stdout.strip()))
                return dst
        except (OSError, subprocess.SubprocessError):
            pass
        time.sleep(10)
    sys.exit("cannot copy a working %s" % tool)


def med(xs):
    """Median; NaN for no samples."""
    return statistics.median(xs) if xs else float("nan")
