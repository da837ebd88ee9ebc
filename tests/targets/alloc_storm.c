/* Background load (tests/loader/busy_host_test, bench/busy_host): a process
 * that allocates as fast as it can (or at a given rate), with a count it
 * knows: malloc(size)+free pairs for --seconds S, paced to --rate R
 * pairs per second (0: as fast as it can), in batches of 256. Prints
 * "pairs=N seconds=T" at the end. With --threads N, N threads share the
 * rate, and one block of every batch is handed to whichever thread comes
 * next through a shared slot and freed there (a free on another thread
 * than the malloc, as in a work queue); every block is freed by the end.
 *
 *   alloc_storm [--seconds S] [--rate R] [--size B] [--threads N]
 */
#include <pthread.h>
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

static double seconds = 5, rate = 0;
static size_t size = 64;
static void *slot; /* a block on its way to another thread */

static void *storm(void *arg) {
  long *out = arg;
  double t0 = now(), end = t0 + seconds, t = t0;
  long pairs = 0;
  while (t < end) {
    for (int k = 0; k < 256; k++) {
      void *p = malloc(size);
      sink = p;
      if (k == 0) p = __atomic_exchange_n(&slot, p, __ATOMIC_ACQ_REL); /* someone else's, or NULL */
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
  *out = pairs;
  return NULL;
}

int main(int argc, char **argv) {
  int threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--rate")) rate = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--size")) size = strtoul(argv[i + 1], NULL, 0);
    else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
  }
  if (threads < 1 || threads > 64) return 2;
  rate /= threads;
  double t0 = now();
  pthread_t tid[64];
  long pairs[64] = {0}, total = 0;
  for (int i = 1; i < threads; i++)
    if (pthread_create(&tid[i], NULL, storm, &pairs[i])) return 1;
  storm(&pairs[0]);
  for (int i = 1; i < threads; i++) pthread_join(tid[i], NULL);
  free(slot); /* the last block handed over */
  for (int i = 0; i < threads; i++) total += pairs[i];
  printf("pairs=%ld seconds=%.3f\n", total, now() - t0);
  return 0;
}
