/* Targets for the injector's deadlock-window check (issue 21,
 * src/inject/busy_frames.h): where its threads are when the tool stops
 * them, and what a tracer must count after (STYLE.md #8).
 *
 *   busy_target stale ROUNDS
 *     Two stale return addresses kept in an unused slot of a live frame
 *     (main's): one into ld.so (where its relocation called our IFUNC
 *     resolver) and one into libc's dl_iterate_phdr (where it called our
 *     callback); both follow a call instruction, as a real return address
 *     does. Then it prints "ready PID stale N" (N of them found) and waits
 *     for a line on stdin in read(): no live frame is busy, a raw scan of
 *     the stack words would take them for frames.
 *   busy_target inmalloc ROUNDS
 *     Prints "ready PID" and blocks inside malloc_info (which holds the
 *     main arena's lock) in the write of a FILE of its own (fopencookie),
 *     until a line on stdin: a thread genuinely inside the allocator. A
 *     dlopen on it would wait for the lock it holds. Then "free PID" and it
 *     waits for a second line in read().
 *   busy_target insignal ROUNDS
 *     The same, but the cookie write raises SIGUSR1 and the handler waits
 *     for the line: malloc_info lies past a signal frame.
 *   busy_target injit ROUNDS
 *     As inmalloc, but the line is read by a stub in an anonymous
 *     executable page (no CFI, as a JIT's code): the unwind stops there.
 *   busy_target mt THREADS ROUNDS
 *     bench/inject/mt_stress.c's shape: THREADS threads that have used
 *     malloc wait on a condition variable, the main thread (an array of
 *     256 thread ids in its frame, mostly unwritten: what ld.so's start-up
 *     left there) prints "ready PID" and waits in fgets; on a line each thread runs ROUNDS rounds of
 *     malloc (16..2063 bytes) and free, the main thread prints the expect
 *     line and the process exits with its threads still there (no thread
 *     exit frees the allocator's per-thread cache).
 *
 * After the line (the second for inmalloc/insignal), ROUNDS rounds of
 * malloc(100 + i % 50) and free (stale, inmalloc, insignal), then
 *   expect allocs=A frees=F bytes=B
 * No allocation of the program's own after "ready" but those. */
#define _GNU_SOURCE
#include <link.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* --- stale return addresses -------------------------------------------- */

static uintptr_t from_ld_so;  /* return address of ld.so's call of the resolver */
static uintptr_t from_iterate; /* return address of dl_iterate_phdr's call of the callback */

static int answer(void) { return 42; }

/* Called by ld.so while it relocates this program (IRELATIVE): its return
 * address lies in ld.so's relocation code. */
static __attribute__((noinline)) int (*resolve_answer(void))(void) {
  from_ld_so = (uintptr_t)__builtin_return_address(0);
  return answer;
}
int ifunc_answer(void) __attribute__((ifunc("resolve_answer")));

static __attribute__((noinline)) int on_object(struct dl_phdr_info* info, size_t size, void* data) {
  (void)info, (void)size, (void)data;
  from_iterate = (uintptr_t)__builtin_return_address(0);
  return 1;
}

/* --- waiting ----------------------------------------------------------- */

/* read(2) through code without CFI (injit: an anonymous executable page,
 * as a JIT's): mov eax, 0; syscall; ret. */
static long (*reader)(int, void*, size_t);

static void read_line(void) {
  char c;
  if (reader) {
    while (reader(0, &c, 1) == 1 && c != '\n') {
    }
    return;
  }
  while (read(0, &c, 1) == 1 && c != '\n') {
  }
}

static void rounds_and_expect(long rounds) {
  long bytes = 0;
  for (long i = 0; i < rounds; i++) {
    size_t n = 100 + (size_t)(i % 50);
    char* volatile p = malloc(n);
    p[0] = 1;
    free(p);
    bytes += (long)n;
  }
  printf("expect allocs=%ld frees=%ld bytes=%ld\n", rounds, rounds, bytes);
  fflush(stdout);
}

/* --- inside the allocator ---------------------------------------------- */

static void on_usr1(int sig) {
  (void)sig;
  read_line();
}

static int in_signal;

static ssize_t cookie_write(void* c, const char* buf, size_t n) {
  (void)c, (void)buf;
  static int once;
  if (!once++) {
    if (in_signal) raise(SIGUSR1);
    else read_line();
  }
  return (ssize_t)n;
}

/* --- mt ---------------------------------------------------------------- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int go, done;
static long mt_rounds;
static long mt_bytes;

static void* worker(void* arg) {
  unsigned long x = (unsigned long)(size_t)arg * 2654435761u + 1;
  free(malloc(64)); /* the thread's arena and cache, before the tracer */
  pthread_mutex_lock(&mu);
  while (!go) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  long bytes = 0;
  for (long i = 0; i < mt_rounds; i++) {
    x = x * 6364136223846793005ul + 1442695040888963407ul;
    size_t n = 16 + ((x >> 20) & 2047);
    char* volatile p = malloc(n);
    p[0] = 1;
    free(p);
    bytes += (long)n;
  }
  pthread_mutex_lock(&mu);
  mt_bytes += bytes;
  done++;
  pthread_cond_broadcast(&cv);
  for (;;) pthread_cond_wait(&cv, &mu); /* never exits: exit() ends it */
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: busy_target stale|inmalloc|insignal|injit ROUNDS | mt THREADS ROUNDS\n");
    return 2;
  }
  const char* mode = argv[1];
  long rounds = atol(argv[argc - 1]);
  if (!strcmp(mode, "stale")) {
    dl_iterate_phdr(on_object, NULL);
    /* The words sit in a slot of main's frame no code reads: stale, as a
     * dead callee's return address left in an unused local is. */
    volatile uintptr_t slots[8] = {0};
    slots[3] = from_ld_so;
    slots[5] = from_iterate;
    printf("ready %d stale %d answer %d\n", (int)getpid(), (from_ld_so != 0) + (from_iterate != 0), ifunc_answer());
    fflush(stdout);
    read_line();
    rounds_and_expect(rounds);
    return slots[3] == from_ld_so ? 0 : 1;
  }
  if (!strcmp(mode, "inmalloc") || !strcmp(mode, "insignal") || !strcmp(mode, "injit")) {
    in_signal = !strcmp(mode, "insignal");
    if (!strcmp(mode, "injit")) {
      static const unsigned char stub[] = {0xb8, 0, 0, 0, 0, 0x0f, 0x05, 0xc3};
      void* page = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (page == MAP_FAILED) return 4;
      memcpy(page, stub, sizeof stub);
      reader = (long (*)(int, void*, size_t))page;
    }
    signal(SIGUSR1, on_usr1);
    cookie_io_functions_t io = {.write = cookie_write};
    FILE* f = fopencookie(NULL, "w", io);
    setvbuf(f, NULL, _IONBF, 0);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    malloc_info(0, f); /* blocks in cookie_write, the arena locked */
    reader = NULL;     /* the second wait in read(2) itself: unwound to its end */
    printf("free %d\n", (int)getpid());
    fflush(stdout);
    read_line();
    rounds_and_expect(rounds);
    return 0;
  }
  if (!strcmp(mode, "mt") && argc == 4) {
    int threads = atoi(argv[2]);
    mt_rounds = rounds;
    if (threads < 1 || threads > 64) return 2;
    /* As mt_stress: an array of 256 ids, most of it never written: its
     * slots keep what ld.so's start-up left on this part of the stack. */
    pthread_t t[256];
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void*)(size_t)i);
    char line[64];
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 3;
    pthread_mutex_lock(&mu);
    go = 1;
    pthread_cond_broadcast(&cv);
    while (done < threads) pthread_cond_wait(&cv, &mu);
    long bytes = mt_bytes;
    pthread_mutex_unlock(&mu);
    printf("expect allocs=%ld frees=%ld bytes=%ld\n", threads * rounds, threads * rounds, bytes);
    fflush(stdout);
    exit(0);
  }
  fprintf(stderr, "busy_target: unknown mode %s\n", mode);
  return 2;
}
