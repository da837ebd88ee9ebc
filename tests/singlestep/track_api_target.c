// The C API test: a program tracks a region of its own memory, with a second
// thread touching it too, and checks the exact list it gets back.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "memtrace_track.h"

static char page[8192] __attribute__((aligned(4096)));

static void* other(void* arg) {
  volatile uint32_t* p = (volatile uint32_t*)(page + 256);
  for (int i = 0; i < 10; i++) p[0] = (uint32_t)i;  // 10 writes of 4 bytes
  return arg;
}

int main(void) {
  char* region = page + 64;  // not page-aligned on purpose
  MemTracker* t = StartTrackMemory(region, 512, 1000, STDOUT_FILENO);
  if (!t) {
    printf("StartTrackMemory failed\n");
    return 1;
  }
  volatile char* r = region;
  r[0] = 1;                        // write 1
  char c = r[1];                   // read 1
  volatile uint64_t* q = (volatile uint64_t*)(region + 8);
  *q = 5;                          // write 8
  page[0] = 9;                     // same page, outside: not recorded
  pthread_t th;
  pthread_create(&th, NULL, other, NULL);
  pthread_join(th, NULL);
  if (EndTrackMemory(t) != 0) {
    printf("EndTrackMemory failed\n");
    return 1;
  }
  int ok = t->num_access == 13 && t->addrs[0] == region && t->accesses[0].kind == MEMTRACK_WRITE &&
           t->addrs[1] == region + 1 && t->accesses[1].kind == MEMTRACK_READ && t->addrs[2] == region + 8 &&
           t->accesses[2].size == 8;
  for (size_t i = 3; i < t->num_access; i++)
    ok = ok && t->addrs[i] == page + 256 && t->accesses[i].size == 4 && t->accesses[i].kind == MEMTRACK_WRITE;
  // After EndTrackMemory the region is plain memory again.
  r[2] = c;
  printf("num_access %zu %s\n", t->num_access, ok ? "PASS" : "FAIL");
  FreeMemTracker(t);
  return ok ? 0 : 1;
}
