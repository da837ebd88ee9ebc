/* The library with a name longer than the kernel's record keeps (47 bytes):
 * found by the name's first bytes in the program's RUNPATH ($ORIGIN). */
#include <stdlib.h>

static void *volatile sink;

__attribute__((noinline)) void *gone_lib_inner(size_t n) {
  void *p = malloc(n);
  sink = p;
  __asm__ volatile("" ::: "memory");
  return p;
}
