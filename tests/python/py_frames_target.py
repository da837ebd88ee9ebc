# Target of tests/python (issue 32): keeps 40 bytearrays of 3,000 bytes made
# in inner() <- middle() <- outer() <- <module>, under tracemalloc, and
# prints what tracemalloc charges to the line that makes them: every block,
# and the blocks over 512 bytes (the ones malloc sees under the default
# allocator), with its traceback. Then it stops without finalizing (the
# blocks stay in use at exit). Waits for a line on stdin first if given
# "wait" (a -p attach).
import os
import sys
import tracemalloc

KEEP = []


def inner(n):
    for i in range(n):
        KEEP.append(bytearray(3000))  # THE LINE


def middle(n):
    inner(n)


def outer(n):
    middle(n)


if len(sys.argv) > 1 and sys.argv[1] == "wait":
    print("ready", flush=True)
    sys.stdin.readline()
tracemalloc.start(25)
outer(40)
snap = tracemalloc.take_snapshot()
tracemalloc.stop()
line = next(i + 1 for i, l in enumerate(open(__file__)) if l.rstrip().endswith("# THE LINE"))
all_b = all_n = big_b = big_n = 0
chain = None
for t in snap.traces:
    fr = t.traceback[-1]  # the most recent frame last
    if fr.filename != __file__ or fr.lineno != line:
        continue
    all_b += t.size
    all_n += 1
    if t.size > 512:
        big_b += t.size
        big_n += 1
        chain = " < ".join("%s:%d" % (os.path.basename(f.filename), f.lineno) for f in reversed(t.traceback))
print("line %d all %d bytes %d blocks big %d bytes %d blocks" % (line, all_b, all_n, big_b, big_n))
print("chain %s" % chain)
sys.stdout.flush()
os._exit(0)
