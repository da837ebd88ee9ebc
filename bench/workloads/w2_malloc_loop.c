/* W2: a C malloc/free loop. ITER rounds (argv[1], default 2,000,000) of one
 * malloc and one free over 256 live slots with sizes 16..1040 bytes, plus a
 * calloc/realloc every 64 rounds. Prints its own counts for checking. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
	long iters = argc > 1 ? atol(argv[1]) : 2000000;
	void *slot[256] = {0};
	unsigned long x = 12345, mallocs = 0, frees = 0;
	for (long i = 0; i < iters; i++) {
		x = x * 6364136223846793005UL + 1442695040888963407UL;
		unsigned k = (x >> 33) & 255;
		size_t sz = 16 + ((x >> 20) & 1023);
		if (slot[k]) {
			free(slot[k]);
			frees++;
		}
		if ((i & 63) == 0) {
			slot[k] = calloc(1, sz);
			slot[k] = realloc(slot[k], sz * 2);
		} else {
			slot[k] = malloc(sz);
			memset(slot[k], 1, 8);
		}
		mallocs++;
	}
	for (int k = 0; k < 256; k++)
		if (slot[k]) {
			free(slot[k]);
			frees++;
		}
	printf("w2: %lu allocations, %lu frees\n", mallocs, frees);
	return 0;
}
