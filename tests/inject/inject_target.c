/* A target for --inject that knows its own counts (STYLE.md #8).
 *
 *   inject_target ROUNDS [MODE]
 *
 * Prints "ready PID" and sleeps (in nanosleep: the injector interrupts a
 * syscall) until libmemtrace_agent.so records in this process, then runs
 * ROUNDS rounds of allocator calls and prints what a tracer must count:
 *
 *   per round: malloc(64), calloc(10, 8), malloc(32) realloc'd to 128,
 *   posix_memalign(64, 256), aligned_alloc(64, 512), memalign(32, 96), all
 *   freed: 7 allocations, 7 frees, 1168 bytes; every 10th round one more
 *   malloc(1000) from leak_here() that is never freed; in round 0 one
 *   malloc(24), freed, called with rbp = -16 (malloc_bad_rbp).
 *
 * MODE "exit" (default): exits 0 after the rounds.
 * MODE "stdin": waits for a line on stdin instead of the agent (a process
 * the agent cannot go into is traced by uprobes: its counts are the same).
 * MODE "seccomp": the same, under a seccomp filter that allows everything.
 * MODE "again": as "outlive", but the second rounds wait for a line on
 * stdin (another tool attaches meanwhile) and print their own expect line.
 * MODE "outlive": after the rounds, waits until the agent stops recording
 * (the tool detached, or was killed and its heartbeat went stale), then
 * runs ROUNDS more rounds (the hooks call straight through) and exits 0:
 * its memory is intact after the tool is gone. Exit 3: never injected, 4:
 * the agent kept recording.
 *
 * No stdio after "ready": stdout's buffer is allocated before. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#ifndef INJECT_TARGET_STATIC
/* The agent's path as ld.so keeps it (dl_iterate_phdr allocates nothing). */
static int agent_path_of(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  if (info->dlpi_name && strstr(info->dlpi_name, "libmemtrace_agent")) {
    *(const char**)data = info->dlpi_name;
    return 1;
  }
  return 0;
}
#endif

static int recording(void) {
#ifdef INJECT_TARGET_STATIC
  return 0; /* no dlopen: the agent cannot go into a static program */
#else
  /* dlopen by the exact path ld.so has: by its file name alone, ld.so adds
   * that name to the agent's link map (malloc of 45 bytes, for good), which
   * the entry trampolines see (ld.so's own malloc pointer) and the expect
   * line does not count. */
  const char* path = NULL;
  dl_iterate_phdr(agent_path_of, &path);
  if (!path) return 0;
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  int (*fn)(void) = (int (*)(void))dlsym(h, "memtrace_agent_recording");
  int r = fn ? fn() : 0;
  dlclose(h);
  return r;
#endif
}

static int line_on_stdin(void) {
  char c = 0;
  while (read(0, &c, 1) == 1)
    if (c == '\n') return 1;
  return 0;
}

static void allow_all_seccomp(void) {
  struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
  struct sock_fprog prog = {1, allow};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) _exit(6);
}

static void nap_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void* volatile sink;

__attribute__((noinline)) static void leak_here(void) { sink = malloc(1000); }

/* malloc called with rbp = -16, as code built without frame pointers may
 * leave it: a frame-pointer walk must stop there, not wrap around. Through
 * the GOT, like any call of the program's. */
__attribute__((noinline)) static void* malloc_bad_rbp(size_t n) {
  void* r;
  __asm__ volatile(
      "push %%rbp\n\t"
      "push %%rbx\n\t"
      "mov %%rsp, %%rbx\n\t"
      "and $-16, %%rsp\n\t"
      "mov $-16, %%rbp\n\t"
      "call *malloc@GOTPCREL(%%rip)\n\t"
      "mov %%rbx, %%rsp\n\t"
      "pop %%rbx\n\t"
      "pop %%rbp\n\t"
      : "=a"(r), "+D"(n)
      :
      : "rcx", "rdx", "rsi", "r8", "r9", "r10", "r11", "memory", "cc");
  return r;
}

__attribute__((noinline)) static void one_round(int i) {
  void* a = malloc(64);
  void* b = calloc(10, 8);
  void* c = malloc(32);
  c = realloc(c, 128);
  void* d = NULL;
  if (posix_memalign(&d, 64, 256) != 0) abort();
  void* e = aligned_alloc(64, 512);
  void* f = memalign(32, 96);
  /* Through a volatile: the compiler may not drop an unused pair. */
  sink = a;
  sink = b;
  sink = c;
  sink = d;
  sink = e;
  sink = f;
  free(a);
  free(b);
  free(c);
  free(d);
  free(e);
  free(f);
  if (i % 10 == 9) leak_here();
  if (i == 0) {
    void* g = malloc_bad_rbp(24);
    sink = g;
    free(g);
  }
}

static void say(const char* s) {
  if (write(1, s, strlen(s)) < 0) _exit(5);
}

static void say_expect(int rounds) {
  char line[128];
  snprintf(line, sizeof line, "expect allocs=%d frees=%d bytes=%lld leaked_blocks=%d leaked_bytes=%d\n",
           7 * rounds + rounds / 10 + 1, 7 * rounds + 1, 1168LL * rounds + 1000LL * (rounds / 10) + 24, rounds / 10,
           1000 * (rounds / 10));
  say(line);
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 1000;
  const char* mode = argc > 2 ? argv[2] : "exit";
  int outlive = strcmp(mode, "outlive") == 0, again = strcmp(mode, "again") == 0;
  int on_stdin = strcmp(mode, "stdin") == 0 || strcmp(mode, "seccomp") == 0;
  if (strcmp(mode, "seccomp") == 0) allow_all_seccomp();
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  if (on_stdin) {
    if (!line_on_stdin()) return 3;
  } else {
    for (int waited = 0; !recording(); waited += 5) {
      if (waited > 60000) return 3;
      nap_ms(5);
    }
  }
  for (int i = 0; i < rounds; i++) one_round(i);
  say_expect(rounds);
  if (!outlive && !again) return 0;
  say("outliving\n");
  for (int waited = 0; recording(); waited += 5) {
    if (waited > 60000) return 4;
    nap_ms(5);
  }
  if (again && !line_on_stdin()) return 3;
  for (int i = 0; i < rounds; i++) one_round(i);
  if (again) say_expect(rounds);
  say("done\n");
  return 0;
}
