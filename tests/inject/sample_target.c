/* --sample-bytes (issue 34): a target that knows its byte totals per call
 * site. Three sites of different sizes allocate 256 MiB each (site_small:
 * 64-byte blocks, site_mid: 4 KiB, site_big: 256 KiB), freeing every block
 * but one in 64 (kept to the end: in use at exit). Prints the figures:
 * "expect total=B small=B mid=B big=B live=B". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define SITE_BYTES (256ull << 20)
static void* keep[1 << 17];
static size_t kept;

static __attribute__((noinline)) void* site_small(void) { return malloc(64); }
static __attribute__((noinline)) void* site_mid(void) { return malloc(4096); }
static __attribute__((noinline)) void* site_big(void) { return malloc(256 << 10); }

static uint64_t run(void* (*site)(void), size_t size, uint64_t* live) {
  uint64_t n = SITE_BYTES / size;
  for (uint64_t i = 0; i < n; i++) {
    char* p = site();
    if (!p) exit(2);
    p[0] = (char)i;
    if (i % 64 == 0 && kept < sizeof keep / sizeof keep[0]) {
      keep[kept++] = p;
      *live += size;
    } else {
      free(p);
    }
  }
  return n * size;
}

int main(void) {
  uint64_t live = 0;
  uint64_t a = run(site_small, 64, &live), b = run(site_mid, 4096, &live), c = run(site_big, 256 << 10, &live);
  printf("expect total=%llu small=%llu mid=%llu big=%llu live=%llu\n", (unsigned long long)(a + b + c),
         (unsigned long long)a, (unsigned long long)b, (unsigned long long)c, (unsigned long long)live);
  fflush(stdout);
  return 0;
}
