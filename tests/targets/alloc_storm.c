/* Background load (tests/loader/busy_host_test, bench/busy_host): a process
 * that allocates as fast as it can (or at a given rate), with a count it
 * knows: malloc(size)+free pairs for --seconds S, paced to --rate R
 * pairs per second (0: as fast as it can), in batches of 256. Prints
 * "pairs=N seconds=T" at the end.
 *
 *   alloc_storm [--seconds S] [--rate R] [--size B]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void *volatile sink;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  double seconds = 5, rate = 0;
  size_t size = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--rate")) rate = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--size")) size = strtoul(argv[i + 1], NULL, 0);
  }
  double t0 = now(), end = t0 + seconds, t = t0;
  long pairs = 0;
  while (t < end) {
    for (int k = 0; k < 256; k++) {
      void *p = malloc(size);
      sink = p;
      free(p);
    }
    pairs += 256;
    t = now();
    if (rate > 0) {
      double due = t0 + pairs / rate; /* when this many pairs are due */
      if (due > t) {
        struct timespec ts = {(time_t)(due - t), (long)((due - t - (time_t)(due - t)) * 1e9)};
        nanosleep(&ts, NULL);
        t = now();
      }
    }
  }
  printf("pairs=%ld seconds=%.3f\n", pairs, t - t0);
  return 0;
}
