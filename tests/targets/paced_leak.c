/* A target that runs for a while at a steady pace (tests/loader/pprof_dir_test:
 * continuous profiles): every --every-ms milliseconds for --seconds S it
 * keeps one block of --size bytes (allocated in leak_here) and allocates and
 * frees a temporary one, so that each periodic profile holds more than the
 * one before. Prints "kept=N" at the end.
 *
 *   paced_leak [--seconds S] [--every-ms MS] [--size B]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void *volatile sink;

__attribute__((noinline)) void *leak_here(size_t n) {
  void *p = malloc(n);
  if (p) memset(p, 1, n);
  return p;
}

__attribute__((noinline)) void temporary(size_t n) {
  void *p = malloc(n);
  sink = p;
  free(p);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  double seconds = 3;
  long every_ms = 10;
  size_t size = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--every-ms")) every_ms = atol(argv[i + 1]);
    else if (!strcmp(argv[i], "--size")) size = strtoul(argv[i + 1], NULL, 0);
  }
  double end = now() + seconds;
  long kept = 0;
  struct timespec pause = {every_ms / 1000, (every_ms % 1000) * 1000000L};
  while (now() < end) {
    sink = leak_here(size);
    kept++;
    temporary(size * 2);
    nanosleep(&pause, NULL);
  }
  printf("kept=%ld\n", kept);
  return 0;
}
