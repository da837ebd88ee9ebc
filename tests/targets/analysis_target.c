/* A target for the analyses of issue 19 (temporary allocations, lifetimes,
 * the peak by stack, churn, memory over time) that knows its own numbers.
 * Each allocation site is a function of its own, so that the tests find its
 * stack by name.
 *
 *   keep_site      KEEP blocks of 1000 bytes, allocated first, never freed
 *   temp_site      TEMP x (malloc(64); free): each one temporary
 *   thread_temp    THREAD_TEMP x (malloc(48); free) on a second thread, at
 *                  the same time as temp_site on the main thread: temporary
 *                  per thread (heaptrack, counting one stream for all
 *                  threads, counts fewer when the two interleave)
 *   pair_a, pair_b PAIRS x (a = malloc; b = malloc; free(a); free(b)): not
 *                  temporary (another call of the thread came between)
 *   peak_big       PEAK_BIG blocks of 10000 bytes \ held together for HOLD_MS,
 *   peak_small     PEAK_SMALL blocks of 2000 bytes / then freed: the peak
 *
 *   --one-thread   no second thread (thread_temp=0): every tracer that counts
 *                  one stream per process counts the same temporaries
 *
 * Prints (stdout, at the end, after every allocation it counts):
 *   analysis keep=KEEP temp=TEMP thread_temp=THREAD_TEMP pairs=PAIRS
 *            peak_big=BYTES peak_small=BYTES hold_ms=HOLD_MS
 *   peak_window A B   CLOCK_MONOTONIC ns (bpf_ktime_get_ns's clock) just before
 *                     the last peak allocation and just after it
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { KEEP = 200, TEMP = 1000, THREAD_TEMP = 300, PAIRS = 100, PEAK_BIG = 100, PEAK_SMALL = 50, HOLD_MS = 150 };

static void *volatile sink;
static pthread_barrier_t together;

static unsigned long long mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

__attribute__((noinline)) static void *keep_site(void) { return malloc(1000); }
__attribute__((noinline)) static void temp_site(void) {
  void *p = malloc(64);
  sink = p;
  free(p);
}
__attribute__((noinline)) static void thread_temp(void) {
  void *p = malloc(48);
  sink = p;
  free(p);
}
__attribute__((noinline)) static void *pair_a(void) { return malloc(24); }
__attribute__((noinline)) static void *pair_b(void) { return malloc(40); }
__attribute__((noinline)) static void *peak_big(void) { return malloc(10000); }
__attribute__((noinline)) static void *peak_small(void) { return malloc(2000); }

static void *second_thread(void *arg) {
  (void)arg;
  pthread_barrier_wait(&together);
  for (int i = 0; i < THREAD_TEMP; i++) thread_temp();
  return NULL;
}

int main(int argc, char **argv) {
  static void *keep[KEEP], *big[PEAK_BIG], *small[PEAK_SMALL];
  int threads = !(argc > 1 && strcmp(argv[1], "--one-thread") == 0);
  for (int i = 0; i < KEEP; i++) keep[i] = keep_site();
  sink = keep;

  /* The thread is created (its stack, glibc's thread state) before the
   * barrier; both loops start together. */
  pthread_t t;
  if (threads) {
    pthread_barrier_init(&together, NULL, 2);
    pthread_create(&t, NULL, second_thread, NULL);
    pthread_barrier_wait(&together);
  }
  for (int i = 0; i < TEMP; i++) temp_site();
  if (threads) pthread_join(t, NULL);

  for (int i = 0; i < PAIRS; i++) {
    void *a = pair_a(), *b = pair_b();
    free(a);
    free(b);
  }

  unsigned long long before = 0, after = 0;
  for (int i = 0; i < PEAK_BIG; i++) big[i] = peak_big();
  for (int i = 0; i < PEAK_SMALL; i++) {
    if (i == PEAK_SMALL - 1) before = mono_ns();
    small[i] = peak_small();
  }
  after = mono_ns();
  usleep(HOLD_MS * 1000);
  for (int i = 0; i < PEAK_BIG; i++) free(big[i]);
  for (int i = 0; i < PEAK_SMALL; i++) free(small[i]);

  printf("analysis keep=%d temp=%d thread_temp=%d pairs=%d peak_big=%d peak_small=%d hold_ms=%d\n", KEEP, TEMP,
         threads ? THREAD_TEMP : 0, PAIRS, PEAK_BIG * 10000, PEAK_SMALL * 2000, HOLD_MS);
  printf("peak_window %llu %llu\n", before, after);
  return 0;
}
