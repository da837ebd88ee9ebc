#!/usr/bin/env python3
"""Symbolizer benchmark: lookups per second for 100k addresses spread over
libc, libstdc++ and a large binary, cold (a fresh process: open, parse, look
up) and warm (the same addresses again in the same process: memoized), against
elfutils eu-addr2line and binutils addr2line run on the same addresses in the
same run (both -f -i -C, fresh process each: they have no warm state).

  bench_symbolize.py --symbolizer build/src/symbolize/memtrace-symbolize \
                     [--large FILE] [--count 100000] [--seed 1]

Addresses are instruction addresses of each file's .text (from objdump),
sampled with repetition (stacks repeat), 40% libc, 30% libstdc++, 30% large.
"""
import argparse, os, random, re, subprocess, sys, tempfile, time

def text_addrs(path):
    out = subprocess.run(['objdump', '-d', '--no-show-raw-insn', '-j', '.text', path],
                         capture_output=True, text=True).stdout
    return [int(m.group(1), 16) for m in re.finditer(r'^\s+([0-9a-f]+):', out, re.M)]

def timed(cmd, stdin_path):
    with open(stdin_path) as f:
        t = time.perf_counter()
        r = subprocess.run(cmd, stdin=f, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return time.perf_counter() - t, r

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--symbolizer', required=True)
    ap.add_argument('--large', default=None, help='large binary with DWARF (default: the symbolizer test binary if found)')
    ap.add_argument('--count', type=int, default=100000)
    ap.add_argument('--seed', type=int, default=1)
    a = ap.parse_args()
    libc = os.path.realpath('/lib/x86_64-linux-gnu/libc.so.6')
    libstdcxx = os.path.realpath('/usr/lib/x86_64-linux-gnu/libstdc++.so.6')
    large = a.large
    if not large:
        cand = os.path.join(os.path.dirname(os.path.abspath(a.symbolizer)), '..', '..', 'tests', 'symbolize', 'symbolize_test')
        large = os.path.realpath(cand) if os.path.exists(cand) else os.path.realpath(a.symbolizer)
    files = [(libc, 0.4), (libstdcxx, 0.3), (large, 0.3)]
    rnd = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix='symbench.')
    print(f'# {a.count} addresses; {time.strftime("%Y-%m-%d %H:%M")}; {os.cpu_count()} CPUs')
    print(f'{"file":<28} {"addrs":>7} {"ours cold/s":>12} {"ours warm/s":>12} {"eu-addr2line/s":>15} {"addr2line/s":>12} {"cold/eu":>8} {"cold/bu":>8} {"warm/eu":>8} {"warm/bu":>8}')
    tot = {'cold': 0.0, 'warm': 0.0, 'eu': 0.0, 'bu': 0.0, 'n': 0}
    for path, share in files:
        n = int(a.count * share)
        pool = text_addrs(path)
        # Distinct addresses: about a fifth of the samples (repeated frames).
        distinct = rnd.sample(pool, min(len(pool), max(1, n // 5)))
        addrs = [rnd.choice(distinct) for _ in range(n)]
        af = os.path.join(tmp, os.path.basename(path) + '.addrs')
        with open(af, 'w') as f:
            f.write(''.join(f'{x:x}\n' for x in addrs))
        t_all, r = timed([a.symbolizer, '-e', path, '-t', '--passes', '2'], af)
        m = re.findall(r'pass (\d): (\d+) addresses in ([0-9.]+) s', r.stderr)
        if len(m) != 2:
            print('symbolizer failed:', r.stderr, file=sys.stderr)
            return 1
        cold = float(m[0][2]); warm = float(m[1][2])
        t_eu, _ = timed(['eu-addr2line', '-f', '-i', '-C', '-e', path], af)
        t_bu, _ = timed(['addr2line', '-f', '-i', '-C', '-e', path], af)
        # Our cold figure counts the whole process like theirs do.
        t_cold = t_all - warm
        row = (n / t_cold, n / max(warm, 1e-9), n / t_eu, n / t_bu)
        print(f'{os.path.basename(path)[:28]:<28} {n:>7} {row[0]:>12.0f} {row[1]:>12.0f} {row[2]:>15.0f} {row[3]:>12.0f} '
              f'{row[0]/row[2]:>7.1f}x {row[0]/row[3]:>7.1f}x {row[1]/row[2]:>7.0f}x {row[1]/row[3]:>7.0f}x')
        tot['cold'] += t_cold; tot['warm'] += warm; tot['eu'] += t_eu; tot['bu'] += t_bu; tot['n'] += n
    n = tot['n']
    c, w, e, b = n / tot['cold'], n / tot['warm'], n / tot['eu'], n / tot['bu']
    print(f'{"all":<28} {n:>7} {c:>12.0f} {w:>12.0f} {e:>15.0f} {b:>12.0f} {c/e:>7.1f}x {c/b:>7.1f}x {w/e:>7.0f}x {w/b:>7.0f}x')
    print(f'# large binary: {large}')
    subprocess.run(['rm', '-rf', tmp])
    return 0

if __name__ == '__main__':
    sys.exit(main())
