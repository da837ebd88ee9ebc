# Target of tests/python's py-bt comparison (issue 32): 20 bytearrays, each
# made under its own Python call chain (a/b recursion k deep, the odd
# ones through a method), each of its own size: bytearray(n)
# asks malloc for n + 1 bytes, so the block of chain k is 4001 + 16 * k
# bytes. It keeps them and stops without finalizing (they stay in use).
import os

KEEP = []


def leaf(k):
    KEEP.append(bytearray(4000 + 16 * k))


def a(k, d):
    if d == 0:
        leaf(k)
    else:
        b(k, d - 1)


def b(k, d):
    if d == 0:
        leaf(k)
    else:
        a(k, d - 1)


class C:
    def m(self, k):
        a(k, k)


for k in range(20):
    if k % 2:
        C().m(k)
    else:
        a(k, k)
os._exit(0)
