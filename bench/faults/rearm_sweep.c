/* --rearm cost: PAGES pages touched once, then (after a line on stdin)
 * SWEEPS sweeps reading one byte per page with GAP ms between sweeps. Prints
 * the mean time per page access inside the sweeps: with --rearm every access
 * is a first access of its interval (gap > interval), so the difference with
 * an unarmed run is the cost of one re-armed fault. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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
	unsigned long pages = argc > 1 ? strtoul(argv[1], 0, 0) : 256;
	int sweeps = argc > 2 ? atoi(argv[2]) : 20, gap = argc > 3 ? atoi(argv[3]) : 50;
	char *m = mmap(NULL, pages * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	madvise(m, pages * 4096, MADV_NOHUGEPAGE);
	for (unsigned long i = 0; i < pages; i++)
		m[i * 4096] = 1;
	printf("range %p-%p\n", (void *)m, (void *)(m + pages * 4096));
	fflush(stdout);
	char b[16];
	if (!fgets(b, sizeof b, stdin))
		return 1;
	volatile unsigned long s = 0;
	double in = 0;
	struct timespec ts = {gap / 1000, (gap % 1000) * 1000000L};
	for (int k = 0; k < sweeps; k++) {
		double t0 = now();
		for (unsigned long i = 0; i < pages; i++)
			s += ((volatile char *)m)[i * 4096];
		in += now() - t0;
		nanosleep(&ts, NULL);
	}
	printf("ns_per_access=%.1f\n", in * 1e9 / (pages * sweeps));
	return 0;
}
