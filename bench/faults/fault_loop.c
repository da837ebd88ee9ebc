/* A page-fault-heavy loop: map N MiB of anonymous memory, write one byte per
 * page, unmap; repeat. Prints ns per fault. Used by bench/faults/run.sh as
 * the process that is NOT traced (its cost must not change when memtrace-bpf
 * --faults -c OTHER runs) and, with --sweep, as a --rearm subject. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	size_t mib = argc > 1 ? strtoul(argv[1], 0, 0) : 64;
	int rounds = argc > 2 ? atoi(argv[2]) : 20;
	size_t len = mib << 20, pages = len / 4096;
	double t0 = now();
	for (int r = 0; r < rounds; r++) {
		char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED)
			return 1;
		madvise(m, len, MADV_NOHUGEPAGE);
		for (size_t i = 0; i < pages; i++)
			m[i * 4096] = 1;
		munmap(m, len);
	}
	double t = now() - t0;
	printf("faults=%zu ns_per_fault=%.1f\n", pages * rounds, t * 1e9 / (pages * rounds));
	return 0;
}
