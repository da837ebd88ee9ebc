/* stripped_nofp: a stripped non-PIE program without frame pointers or
 * unwind tables (as Debian's gcc driver is), whose frame-pointer register
 * holds data when it calls malloc, as code without frame pointers may keep
 * anything there. The words it points at are what a frame-pointer walk
 * takes for two more frames: a code address no call precedes (leaf's first
 * byte), then an address in no mapping. Every stack it gives is trustworthy
 * for one frame (leaf's call, read at malloc's entry) and no more.
 * Leaks one block of 54321 bytes. */
#include <stdint.h>
#include <stdlib.h>

void *volatile sink;

__attribute__((noinline)) void *leaf(size_t n) {
  void *p = malloc(n);
  sink = p;
  return p;
}

__attribute__((noinline)) void *middle(size_t n) {
  volatile uint64_t junk[4];
  junk[0] = (uint64_t)&junk[2]; /* "caller's frame pointer" */
  junk[1] = (uint64_t)&leaf;    /* "return address": code, after no call */
  junk[2] = 0;
  junk[3] = 0x3aef74d0; /* "return address": in no mapping */
#if defined(__x86_64__)
  register volatile uint64_t *fp __asm__("rbp") = junk;
#elif defined(__aarch64__)
  register volatile uint64_t *fp __asm__("x29") = junk;
#endif
  __asm__ volatile("" : "+r"(fp));
  void *p = leaf(n);
  __asm__ volatile("" : : "r"(fp));
  return p;
}

int main(void) {
  free(middle(100));
  middle(54321);
  return 0;
}
