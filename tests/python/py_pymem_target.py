# Target of tests/python/pymem_test.cpp (issue 32, the python domain): keeps
# N bytes objects of 100 bytes (one pymalloc block of 133 bytes each) made by
# small() and M of 2,000 bytes (2,033: pymalloc hands them to malloc) made by
# big(), in a list allocated beforehand (no list growth on those lines).
# Given "tm", runs under tracemalloc and prints what it charges to each of
# the two lines (the oracle). Then stops without finalizing: the blocks stay
# in use at exit.
import os
import sys
import tracemalloc

N, M = 1000, 50
KEEP = [None] * (N + M)


def small():
    for i in range(N):
        KEEP[i] = bytes(100)  # SMALL LINE


def big():
    for i in range(M):
        KEEP[N + i] = bytes(2000)  # BIG LINE


tm = len(sys.argv) > 1 and sys.argv[1] == "tm"
if tm:
    tracemalloc.start()
small()
big()
if tm:
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    for tag in ("SMALL", "BIG"):
        line = next(i + 1 for i, l in enumerate(open(__file__)) if l.rstrip().endswith("# " + tag + " LINE"))
        b = n = 0
        for t in snap.traces:
            fr = t.traceback[-1]
            if fr.filename == __file__ and fr.lineno == line:
                b += t.size
                n += 1
        print("%s line %d %d bytes %d blocks" % (tag, line, b, n))
else:
    for tag in ("SMALL", "BIG"):
        line = next(i + 1 for i, l in enumerate(open(__file__)) if l.rstrip().endswith("# " + tag + " LINE"))
        print("%s line %d" % (tag, line))
sys.stdout.flush()
os._exit(0)
