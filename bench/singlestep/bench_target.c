// Workload for bench/singlestep: T threads, each doing N accesses (alternating
// 8-byte store and load; --sse: 16-byte movdqu store/load, which the helper
// single-steps instead of emulating) to its own slot of bench_region, or of
// bench_word for the hardware-watchpoint path. Prints "performed P seconds S
// captured C" (captured only with --inproc).
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "inproc_tracker.h"

__attribute__((aligned(4096))) unsigned char bench_region[4096];
__attribute__((aligned(64))) uint64_t bench_word;

static int n_iter = 10000, sse = 0, word = 0;
static pthread_barrier_t bar;
static volatile uint64_t sink;

static void* worker(void* arg) {
  unsigned char* p = word ? (unsigned char*)&bench_word : bench_region + 64 * (intptr_t)arg;
  pthread_barrier_wait(&bar);
  for (int i = 0; i < n_iter / 2; i++) {
    if (sse) {
      __asm__ volatile("movdqu %%xmm0, (%0)\n\tmovdqu (%0), %%xmm0" ::"r"(p) : "xmm0", "memory");
    } else {
      uint64_t v;
      __asm__ volatile("movq %1, (%0)" ::"r"(p), "r"((uint64_t)i) : "memory");
      __asm__ volatile("movq (%1), %0" : "=r"(v) : "r"(p) : "memory");
      sink += v;
    }
  }
  pthread_barrier_wait(&bar);
  return NULL;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char** argv) {
  int threads = 1, inproc = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--iters")) n_iter = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--sse")) sse = 1;
    else if (!strcmp(argv[i], "--word")) word = 1;
    else if (!strcmp(argv[i], "--inproc")) inproc = 1;
  }
  pthread_barrier_init(&bar, NULL, (unsigned)threads + 1);
  pthread_t th[16];
  for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, worker, (void*)(intptr_t)t);
  uintptr_t* addrs = NULL;
  if (inproc) {
    addrs = calloc((size_t)n_iter * threads + 16, sizeof *addrs);
    inproc_start(bench_region, 4096, addrs, (uint64_t)n_iter * threads + 16);
  }
  double t0 = now();
  pthread_barrier_wait(&bar);
  pthread_barrier_wait(&bar);
  double t1 = now();
  uint64_t captured = inproc ? inproc_end() : 0;
  for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
  printf("performed %llu seconds %.6f captured %llu\n", (unsigned long long)n_iter / 2 * 2 * threads, t1 - t0,
         (unsigned long long)captured);
  return 0;
}
