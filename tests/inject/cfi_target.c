/* The agent's CFI walk against libunwind (issue 33): a program built
 * without frame pointers (-O2 -fomit-frame-pointer: rbp is a general
 * register in spin_regs), whose allocations come from known call chains:
 *   main > run > chain_a > chain_b > leaf_malloc    (leaks 1001 bytes)
 *   main > run > chain_alloca > leaf_calloc          (1002: a frame on rbp, alloca)
 *   main > run > spin_regs > leaf_realloc            (1003: rbp clobbered)
 *   main > run > deep(200) > leaf_malloc             (1004: deeper than a stack's 128 frames)
 *   thread > run > ...                               (the same four, 2001-2004: a thread's stack ends in clone3)
 *   main > cfi_lib_alloc                             (1005: argv[1], a library dlopen'd after the attach)
 * and blocks freed on the way (exact counts: "expect ..." as inject_target).
 * Address space not randomized (re-executes itself under ADDR_NO_RANDOMIZE):
 * two runs have the same addresses, so their stacks compare as numbers.
 * Prints "ready PID", waits until the agent records, then works. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/personality.h>
#include <time.h>
#include <unistd.h>

static void* volatile sink;
static volatile int zero;

__attribute__((noinline)) static void leaf_malloc(size_t n) { sink = malloc(n); }
__attribute__((noinline)) static void leaf_calloc(size_t n) { sink = calloc(1, n); }
__attribute__((noinline)) static void leaf_realloc(size_t n) {
  void* p = malloc(8);
  sink = realloc(p, n);
}

__attribute__((noinline)) static void chain_b(size_t n) {
  volatile char pad[40];
  pad[zero] = 1;
  leaf_malloc(n);
  free(malloc(16)); /* freed: counts only */
  if (pad[zero] == 99) sink = 0;
}
__attribute__((noinline)) static void chain_a(size_t n) {
  volatile long pad[9];
  pad[zero] = 1;
  chain_b(n);
  if (pad[zero] == 99) sink = 0;
}
__attribute__((noinline)) static void chain_alloca(size_t n) {
  char* a = __builtin_alloca(n / 8 + zero);
  a[0] = 1;
  sink = a;
  leaf_calloc(n);
  ((volatile char*)a)[zero] = 2;
}
/* Every callee-saved register live across the call, rbp among them. */
__attribute__((noinline)) static void spin_regs(size_t n) {
  long a = zero + 1, b = zero + 2, c = zero + 3, d = zero + 4, e = zero + 5, f = zero + 6, g = zero + 7;
  leaf_realloc(n);
  sink = (void*)(a * b + c * d + e * f + g + (long)zero * a * b * c * d * e * f * g);
  __asm__ volatile("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d), "+r"(e), "+r"(f), "+r"(g));
  zero = (int)(a + b + c + d + e + f + g) * 0;
}
__attribute__((noinline)) static void deep(int k, size_t n) {
  volatile int pad[3];
  pad[zero] = k;
  if (k > 0) deep(k - 1, n);
  else leaf_malloc(n);
  if (pad[zero] == 999) sink = 0;
}

__attribute__((noinline)) static void run(size_t base) {
  chain_a(base + 1);
  chain_alloca(base + 2);
  spin_regs(base + 3);
  deep(200, base + 4);
}

static void* thread_main(void* arg) {
  (void)arg;
  run(2000);
  return NULL;
}

static int agent_path_of(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  if (info->dlpi_name && strstr(info->dlpi_name, "libmemtrace_agent")) {
    *(const char**)data = info->dlpi_name;
    return 1;
  }
  return 0;
}

static int recording(void) {
  const char* path = NULL;
  dl_iterate_phdr(agent_path_of, &path);
  if (!path) return 0;
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  int (*fn)(void) = (int (*)(void))dlsym(h, "memtrace_agent_recording");
  int r = fn ? fn() : 0;
  dlclose(h);
  return r;
}

int main(int argc, char** argv) {
  int p = personality(0xffffffff);
  if (p != -1 && !(p & ADDR_NO_RANDOMIZE) && personality((unsigned long)p | ADDR_NO_RANDOMIZE) != -1) {
    execv("/proc/self/exe", argv);
    return 5;
  }
  pthread_t t;
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  for (int waited = 0; !recording(); waited += 5) {
    if (waited > 60000) return 3;
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  run(1000);
  if (pthread_create(&t, NULL, thread_main, NULL) != 0 || pthread_join(t, NULL) != 0) return 4;
  if (argc > 1) {
    void* lib = dlopen(argv[1], RTLD_NOW);
    void (*lib_alloc)(size_t) = lib ? (void (*)(size_t))dlsym(lib, "cfi_lib_alloc") : NULL;
    if (!lib_alloc) return 6;
    lib_alloc(1005);
    printf("lib %p\n", (void*)lib_alloc); /* where it went (the runs' later mappings differ) */
  }
  printf("done\n");
  fflush(stdout);
  return 0;
}
