// Target for --track-allocs-from make_blocks: blocks returned to make_blocks
// are tracked until freed; main's own allocation is not. Prints the expected
// per-block counts: "B<i> <size> reads <r> writes <w>".
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static void* blocks[3];

__attribute__((noinline)) void make_blocks(void) {
  blocks[0] = malloc(24);
  blocks[1] = calloc(4, 8);
  blocks[2] = malloc(100);
}

#if defined(__aarch64__)  // tests/kernels/arm64_test.py cross-compiles it
static inline void st64(void* p, uint64_t v) { __asm__ volatile("str %1, [%0]" ::"r"(p), "r"(v) : "memory"); }
static inline uint64_t ld64(void* p) { uint64_t v; __asm__ volatile("ldr %0, [%1]" : "=r"(v) : "r"(p) : "memory"); return v; }
#else
static inline void st64(void* p, uint64_t v) { __asm__ volatile("movq %1, (%0)" ::"r"(p), "r"(v) : "memory"); }
static inline uint64_t ld64(void* p) { uint64_t v; __asm__ volatile("movq (%1), %0" : "=r"(v) : "r"(p) : "memory"); return v; }
#endif

int main(void) {
  void* mine = malloc(64);  // not from make_blocks: not tracked
  make_blocks();
  volatile uint64_t s = 0;
  for (int i = 0; i < 3; i++) st64(blocks[0], (uint64_t)i);  // B0: 3 writes
  s += ld64(blocks[0]);                                      // B0: 1 read
  s += ld64((char*)blocks[1] + 8);                           // B1: 1 read
  free(blocks[1]);
  s += ld64(blocks[2]);                                      // B2: 2 reads, 1 write
  s += ld64((char*)blocks[2] + 8);
  st64((char*)blocks[2] + 16, 5);
  st64(mine, 1);
  free(blocks[2]);
  free(blocks[0]);
  free(mine);
  printf("B0 24 reads 1 writes 3\nB1 32 reads 1 writes 0\nB2 100 reads 2 writes 1\ndone\n");
  return 0;
}
