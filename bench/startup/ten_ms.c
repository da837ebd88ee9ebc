/* A 10 ms program for the fixed-cost bench: a few allocations, then 10 ms
 * of CPU (not a sleep: the same work under every tool), then exit. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(void)
{
	void *p[16];
	for (int i = 0; i < 16; i++)
		p[i] = malloc(64 << i);
	double end = now() + 0.010;
	volatile unsigned long x = 0;
	while (now() < end)
		for (int i = 0; i < 1000; i++)
			x += i;
	for (int i = 0; i < 16; i++)
		free(p[i]);
	return 0;
}
