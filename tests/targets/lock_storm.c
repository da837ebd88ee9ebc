/* A target whose threads spend most of their time inside the allocator and
 * the dynamic loader, for --inject's attach (issue 21: the remote dlopen
 * must not deadlock on a lock a stopped thread holds), and which knows the
 * counts of the part it runs after the agent records (STYLE.md #8).
 *
 *   lock_storm LIB THREADS ROUNDS
 *
 * Prints "ready PID", then until libmemtrace_agent.so records in this
 * process: THREADS workers loop malloc/free of 16 B - 256 KiB (the largest
 * through mmap), freeing one another's blocks (other arenas' locks), worker
 * 0 loops dlopen(LIB)/dlclose (ld.so's lock; LIB's constructor allocates
 * under it), and the main thread loops malloc/free and the dlopen of its
 * check. Then every thread stops storming and frees what it holds; the
 * main thread calls malloc(MARK_START) and free on it, the workers run
 * ROUNDS rounds each (malloc(100 + worker) and calloc(4, 32), freed;
 * every 10th round one malloc(500 + worker) kept), the main thread joins
 * them, calls malloc(MARK_END) and free, and prints what a tracer counts
 * from the MARK_START allocation to the MARK_END one, both included:
 *
 *   expect allocs=A frees=F bytes=B leaked_blocks=L leaked_bytes=LB
 *
 * Exit 0; 3: the agent never recorded within 30 s (a tool that fell back
 * kills it first). No stdio after "ready" but that line. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MARK_START 0x5eed01
#define MARK_END 0x5eed02
#define SLOTS 64

static const char* g_lib;
static int g_rounds;
static atomic_int g_go;                 /* 1: stop storming */
static _Atomic(void*) g_shared[SLOTS];  /* blocks freed by another thread */
static pthread_barrier_t g_calm, g_counted;
/* Every block goes through here: the compiler may not pair a malloc with
 * its free away. */
static void* volatile g_sink;

static int recording(void) {
  void* h = dlopen("libmemtrace_agent.so", RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  int (*fn)(void) = (int (*)(void))dlsym(h, "memtrace_agent_recording");
  int r = fn ? fn() : 0;
  dlclose(h);
  return r;
}

static size_t size_of(unsigned* seed) {
  unsigned r = rand_r(seed);
  if (r % 97 == 0) return 256 * 1024; /* mmap'd: sysmalloc, munmap */
  return 16 + r % 4096;
}

static void storm(unsigned seed) {
  void* mine[16] = {0};
  for (unsigned i = 0; !atomic_load_explicit(&g_go, memory_order_relaxed); i++) {
    unsigned k = i % 16;
    free(mine[k]);
    g_sink = mine[k] = malloc(size_of(&seed));
    /* Another thread's block freed here: its arena's lock. */
    void* other = atomic_exchange(&g_shared[rand_r(&seed) % SLOTS], malloc(size_of(&seed)));
    free(other);
  }
  for (int k = 0; k < 16; k++) free(mine[k]);
}

static void* worker(void* arg) {
  int idx = (int)(long)arg;
  if (idx == 0) {
    while (!atomic_load_explicit(&g_go, memory_order_relaxed)) {
      void* h = dlopen(g_lib, RTLD_NOW | RTLD_LOCAL);
      if (h) dlclose(h);
    }
  } else {
    storm((unsigned)idx * 7919u);
  }
  pthread_barrier_wait(&g_calm);
  pthread_barrier_wait(&g_counted); /* the main thread's MARK_START is in */
  for (int r = 0; r < g_rounds; r++) {
    void* a = g_sink = malloc(100 + (size_t)idx);
    void* b = g_sink = calloc(4, 32);
    free(a);
    free(b);
    if (r % 10 == 0) g_sink = malloc(500 + (size_t)idx);
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  g_lib = argv[1];
  int threads = atoi(argv[2]);
  g_rounds = atoi(argv[3]);
  if (threads < 1) return 2;
  pthread_barrier_init(&g_calm, NULL, (unsigned)threads + 1);
  pthread_barrier_init(&g_counted, NULL, (unsigned)threads + 1);
  pthread_t* t = calloc((size_t)threads, sizeof *t);
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void*)(long)i);
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned seed = 12345;
  void* mine[16] = {0};
  for (unsigned i = 0;; i++) {
    unsigned k = i % 16;
    free(mine[k]);
    mine[k] = malloc(size_of(&seed));
    if (i % 256 == 0) {
      if (recording()) break;
      struct timespec now;
      clock_gettime(CLOCK_MONOTONIC, &now);
      if (now.tv_sec - t0.tv_sec > 30) {
        atomic_store(&g_go, 1);
        return 3;
      }
    }
  }
  for (int k = 0; k < 16; k++) free(mine[k]);
  atomic_store(&g_go, 1);
  pthread_barrier_wait(&g_calm);
  for (int s = 0; s < SLOTS; s++) free(atomic_exchange(&g_shared[s], NULL));
  free(g_sink = malloc(MARK_START));
  pthread_barrier_wait(&g_counted);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  free(g_sink = malloc(MARK_END));
  long workers = threads, rounds = g_rounds, kept = (rounds + 9) / 10;
  long allocs = 2 + workers * (2 * rounds + kept);
  long frees = 2 + workers * 2 * rounds;
  long bytes = MARK_START + MARK_END, leaked_bytes = 0;
  for (long w = 0; w < workers; w++) {
    bytes += rounds * (100 + w + 128) + kept * (500 + w);
    leaked_bytes += kept * (500 + w);
  }
  printf("expect allocs=%ld frees=%ld bytes=%ld leaked_blocks=%ld leaked_bytes=%ld\n", allocs, frees, bytes,
         workers * kept, leaked_bytes);
  return 0;
}
