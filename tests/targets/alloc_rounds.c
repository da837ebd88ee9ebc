/* A target that knows its own counts. Each round makes a fixed set of
 * allocator calls; the program prints what one round adds, so tests compare
 * the tool's numbers for N rounds minus 0 rounds with N * that, exactly.
 *
 *   alloc_rounds [--rounds N] [--threads T] [--fork] [--wait] [--exit-code C]
 *                [--simple]
 *   --wait: print "ready <pid>" and wait for a line on stdin before the rounds
 *           and again before exiting (for -p tests).
 *   --simple: each round is one malloc(64)+free (thread stress).
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

struct counts {
  long allocs, frees, bytes, failed, leaked_blocks, leaked_bytes, mmap_direct;
};

static void *volatile sink;

__attribute__((noinline)) void *leak_here(size_t n) {
  void *p = malloc(n); /* LEAK-SITE */
  sink = p;
  return p;
}

static void one_round(struct counts *c) {
  void *p;
  p = malloc(100); free(p); c->allocs++; c->frees++; c->bytes += 100;
  p = calloc(10, 20); free(p); c->allocs++; c->frees++; c->bytes += 200;
  p = realloc(NULL, 50); c->allocs++; c->bytes += 50;           /* realloc(NULL) = alloc */
  p = realloc(p, 5000); c->allocs++; c->frees++; c->bytes += 5000; /* free old + alloc new */
  p = realloc(p, 0); c->frees++;                                 /* glibc: frees, returns NULL */
  sink = p;
  p = reallocarray(NULL, 4, 25); free(p); c->allocs++; c->frees++; c->bytes += 100;
  if (posix_memalign(&p, 64, 256) == 0) { free(p); c->allocs++; c->frees++; c->bytes += 256; }
  p = aligned_alloc(64, 128); free(p); c->allocs++; c->frees++; c->bytes += 128;
  p = memalign(32, 64); free(p); c->allocs++; c->frees++; c->bytes += 64;
  p = valloc(4096); free(p); c->allocs++; c->frees++; c->bytes += 4096;
  p = pvalloc(100); free(p); c->allocs++; c->frees++; c->bytes += 100;
  free(NULL);                                                    /* not a free */
  p = malloc(SIZE_MAX / 2); sink = p; c->failed++;               /* fails */
  p = malloc(1 << 20); memset(p, 1, 64); free(p);                /* mmap'd by the allocator */
  c->allocs++; c->frees++; c->bytes += 1 << 20;
  p = mmap(NULL, 16384, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  munmap(p, 16384); c->mmap_direct += 16384;
  leak_here(33); c->allocs++; c->bytes += 33; c->leaked_blocks++; c->leaked_bytes += 33;
}

/* Before main, before anything else of the program runs: a process traced
 * from its exec (launch, -c) must show this block. */
__attribute__((constructor)) static void early_alloc(void) {
  /* A fixed threshold: glibc would otherwise raise it when the first mmap'd
   * chunk is freed, and later 1 MiB blocks would come from the heap. */
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  sink = malloc(12345);
}

static long rounds = 0;
static int simple = 0;

static void *thread_main(void *arg) {
  for (long i = 0; i < rounds; i++) {
    void *p = malloc(64);
    sink = p;
    free(p);
  }
  return NULL;
}

static void wait_line(void) {
  char buf[64];
  if (!fgets(buf, sizeof buf, stdin)) {}
}

int main(int argc, char **argv) {
  int threads = 0, do_fork = 0, wait = 0, code = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atol(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--fork")) do_fork = 1;
    else if (!strcmp(argv[i], "--wait")) wait = 1;
    else if (!strcmp(argv[i], "--simple")) simple = 1;
    else if (!strcmp(argv[i], "--exit-code") && i + 1 < argc) code = atoi(argv[++i]);
  }
  setvbuf(stdout, NULL, _IONBF, 0); /* no stdio buffer allocation differences */
  struct counts one = {0};
  one_round(&one); /* measure one round's expectations... */
  struct counts per = one;
  /* ...and undo its effect on the totals by reporting it as part of startup:
   * the 0-round run makes the same call, so it cancels. */
  if (wait) {
    printf("ready %d\n", getpid());
    wait_line();
  }
  pid_t child = -1;
  if (do_fork) {
    child = fork();
    if (child < 0) return 99;
  }
  if (threads > 0) {
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++) pthread_create(&t[i], NULL, thread_main, NULL);
    for (int i = 0; i < threads && i < 64; i++) pthread_join(t[i], NULL);
  } else {
    struct counts c = {0};
    for (long i = 0; i < rounds; i++) one_round(&c);
  }
  if (child == 0) _exit(7);
  if (child > 0) waitpid(child, NULL, 0);
  printf("per_round allocs=%ld frees=%ld bytes=%ld failed=%ld leaked_blocks=%ld leaked_bytes=%ld mmap_direct=%ld\n",
         per.allocs, per.frees, per.bytes, per.failed, per.leaked_blocks, per.leaked_bytes,
         per.mmap_direct);
  if (wait) wait_line();
  return code;
}
