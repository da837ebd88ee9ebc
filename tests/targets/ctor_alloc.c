/* A target whose allocations start before its entry point (STYLE.md #8):
 * libctor_alloc_lib.so's constructor, run by ld.so before the program's
 * entry, allocates 6 blocks of 100..600 bytes (2100 in all). main frees
 * the blocks of 100, 300 and 500 bytes (allocated before the entry, freed
 * after), leaks the other three (1200 bytes), runs ROUNDS rounds of
 * malloc(48) + free and prints what a tracer of the whole run counts:
 *
 *   expect allocs=A frees=F bytes=B leaked_blocks=L leaked_bytes=LB
 *
 * No stdio (its buffer would be one more allocation): the line is written
 * with write(2). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void* ctor_alloc_block(int i);
int ctor_alloc_blocks(void);

int main(int argc, char** argv) {
  long rounds = argc > 1 ? atol(argv[1]) : 100;
  int n = ctor_alloc_blocks();
  long leaked = 0, leaked_bytes = 0, frees = 0, ctor_bytes = 0;
  for (int i = 0; i < n; i++) {
    ctor_bytes += 100 * (i + 1);
    if (i % 2 == 0) {
      free(ctor_alloc_block(i));
      frees++;
    } else {
      leaked++;
      leaked_bytes += 100 * (i + 1);
    }
  }
  for (long r = 0; r < rounds; r++) {
    void* volatile p = malloc(48);
    free(p);
  }
  char line[160];
  int len = snprintf(line, sizeof line, "expect allocs=%ld frees=%ld bytes=%ld leaked_blocks=%ld leaked_bytes=%ld\n",
                     n + rounds, frees + rounds, ctor_bytes + 48 * rounds, leaked, leaked_bytes);
  return write(1, line, (size_t)len) == len ? 0 : 1;
}
