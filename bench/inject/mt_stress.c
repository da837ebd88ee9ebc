/* A multi-threaded allocator stress for bench/inject/inject_bench.py
 * (issue 21): T threads, each R rounds of malloc(size) into one of 64
 * slots, freeing the block the slot held (sizes 16..2064 from a per-thread
 * LCG); every block is freed by the end. Exactly T*R mallocs and frees.
 *
 *   mt_stress [--wait] THREADS ROUNDS
 *
 * --wait: prints "ready PID" and reads one line from stdin before the
 * threads start (the bench attaches a tracer meanwhile). Prints
 * "workload_seconds S cpu C" on stderr: wall and user+sys seconds of the
 * threads' work, as bench/inject/wait_then_run.py does for python3. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static long rounds;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static __attribute__((noinline)) void* grab(size_t n) {
  char* p = malloc(n);
  if (p) p[0] = 1;
  return p;
}

static void* worker(void* arg) {
  unsigned long x = (unsigned long)(size_t)arg * 2654435761u + 1;
  void* slot[64] = {0};
  for (long i = 0; i < rounds; i++) {
    x = x * 6364136223846793005ul + 1442695040888963407ul;
    unsigned k = (unsigned)(x >> 58);
    free(slot[k]);
    slot[k] = grab(16 + ((x >> 20) & 2047));
  }
  for (int k = 0; k < 64; k++) free(slot[k]);
  return NULL;
}

int main(int argc, char** argv) {
  int a = 1, wait = 0;
  if (a < argc && strcmp(argv[a], "--wait") == 0) wait = 1, a++;
  if (argc - a != 2) {
    fprintf(stderr, "usage: mt_stress [--wait] THREADS ROUNDS\n");
    return 2;
  }
  int threads = atoi(argv[a]);
  rounds = atol(argv[a + 1]);
  if (threads < 1 || threads > 256 || rounds < 64) return 2;
  if (wait) {
    char line[64];
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 3;
  }
  pthread_t t[256];
  double c0 = cpu(), t0 = now();
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void*)(size_t)i);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  double t1 = now(), c1 = cpu();
  fprintf(stderr, "workload_seconds %.4f cpu %.4f\n", t1 - t0, c1 - c0);
  return 0;
}
