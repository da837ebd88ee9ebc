/* The HTML report test's target (tests/report/html_test.cpp): phases in time
 * that the test picks on the page's memory-over-time chart, a leak through a
 * known function and temporary allocations, each from its own function. It
 * prints the CLOCK_MONOTONIC time (the trace's clock) of each phase:
 *
 *   early START END    early_buffers: 64 blocks of 16384 bytes, live START..END
 *   late START         late_buffers: 48 blocks of 32768 bytes, live from START to the exit
 *   leak parse_header 100 blocks of 100 bytes (live from the start to the exit)
 *   temporary scratch 1000 (malloc then free, nothing in between)
 *
 * and, just before it exits, last_word mallocs and frees one block: the
 * trace's last event of the program is at its end.
 * The peak is in the late phase (1.5 MiB + the leak). Unbuffered stdout: no
 * allocation of stdio's. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PHASE_MS 250

static void *volatile sink;

static unsigned long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000};
  while (nanosleep(&t, &t) != 0) {
  }
}

__attribute__((noinline)) static char *parse_header(int i) {
  char *h = malloc(100);
  snprintf(h, 100, "GET /item/%d", i);
  return h; /* never freed */
}

__attribute__((noinline)) static void scratch(int i) {
  char *p = malloc(32);
  memset(p, i, 32);
  sink = p;
  free(p);
}

__attribute__((noinline)) static void early_buffers(void **b, int n) {
  for (int i = 0; i < n; i++) {
    b[i] = malloc(16384);
    memset(b[i], 1, 16384);
  }
}

__attribute__((noinline)) static void late_buffers(void **b, int n) {
  for (int i = 0; i < n; i++) {
    b[i] = malloc(32768);
    memset(b[i], 2, 32768);
  }
}

__attribute__((noinline)) static void last_word(void) {
  sink = malloc(8);
  free(sink);
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  static void *early[64], *late[48], *leaked[100];
  for (int i = 0; i < 1000; i++) {
    if (i % 10 == 0) leaked[i / 10] = parse_header(i);
    scratch(i);
  }
  sink = leaked;
  unsigned long long t0 = now_ns();
  early_buffers(early, 64);
  sleep_ms(PHASE_MS);
  for (int i = 0; i < 64; i++) free(early[i]);
  unsigned long long t1 = now_ns();
  printf("early %llu %llu\n", t0, t1);
  sleep_ms(PHASE_MS);
  unsigned long long t2 = now_ns();
  late_buffers(late, 48);
  sink = late;
  printf("late %llu\n", t2);
  printf("leak parse_header 100 blocks of 100 bytes\ntemporary scratch 1000\n");
  sleep_ms(PHASE_MS);
  last_word();
  return 0;
}
