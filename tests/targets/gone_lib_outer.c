/* Libraries that only gone_lib_user maps (tests/loader/busy_host_test.cpp):
 * found for a process gone before its maps are read by their names in the
 * program's RUNPATH ($ORIGIN). This one's name is short. */
#include <stddef.h>

void *gone_lib_inner(size_t n);

__attribute__((noinline)) void *gone_lib_outer(size_t n) {
  void *p = gone_lib_inner(n);
  __asm__ volatile("" ::: "memory"); /* not a tail call */
  return p;
}
