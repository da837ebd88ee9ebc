// Target for the single-step helper tests: performs a scripted sequence of
// accesses to ss_region (1/2/4/8/16/32 bytes: plain moves, SSE/AVX, rep
// stosb/movsb, lock add, xchg, a read(2) and a write(2) on the region) plus
// accesses just outside the region on the same page, and prints the exact list
// of region accesses it made, as offsets from ss_region (the same text traced
// or not). Usage: access_script [--threads N] [--rounds R] [--wait-stdin]
//
// Every access to the region is an inline-asm instruction, so the compiler
// adds none. Lines: "T<thread> <+off|-off> <size> <read|write|read-write>".
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define REGION 1024
// Same page, in this order (built with -fno-toplevel-reorder).
__attribute__((section(".data.ss_page"), aligned(4096))) unsigned char ss_before[256] = {1};
__attribute__((section(".data.ss_page"))) unsigned char ss_region[REGION] = {2};
__attribute__((section(".data.ss_page"))) unsigned char ss_after[256] = {3};

#define MAXLOG 100000
struct Log {
  int n;
  struct { int off, size; const char* kind; } e[MAXLOG];
};
static struct Log logs[8];

static void expect(int t, unsigned char* p, int size, const char* kind) {
  struct Log* l = &logs[t];
  if (l->n < MAXLOG) {
    l->e[l->n].off = (int)(p - ss_region);
    l->e[l->n].size = size;
    l->e[l->n].kind = kind;
    l->n++;
  }
}

static inline uint8_t ld8(unsigned char* p) { uint8_t v; __asm__ volatile("movb (%1), %0" : "=q"(v) : "r"(p) : "memory"); return v; }
static inline void st16(unsigned char* p, uint16_t v) { __asm__ volatile("movw %w1, (%0)" :: "r"(p), "r"(v) : "memory"); }
static inline uint32_t ld32(unsigned char* p) { uint32_t v; __asm__ volatile("movl (%1), %0" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline void st64(unsigned char* p, uint64_t v) { __asm__ volatile("movq %1, (%0)" :: "r"(p), "r"(v) : "memory"); }
static inline uint64_t ld64(unsigned char* p) { uint64_t v; __asm__ volatile("movq (%1), %0" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline void st32imm(unsigned char* p) { __asm__ volatile("movl $0x11223344, (%0)" :: "r"(p) : "memory"); }
static inline uint32_t ldzx8(unsigned char* p) { uint32_t v; __asm__ volatile("movzbl (%1), %0" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline void sse_copy(unsigned char* dst, unsigned char* src) {
  __asm__ volatile("movdqu (%1), %%xmm0\n\tmovdqu %%xmm0, (%0)" :: "r"(dst), "r"(src) : "xmm0", "memory");
}
static inline void avx_copy(unsigned char* dst, unsigned char* src) {
  __asm__ volatile("vmovdqu (%1), %%ymm1\n\tvmovdqu %%ymm1, (%0)\n\tvzeroupper" :: "r"(dst), "r"(src) : "xmm1", "memory");
}
static inline void rep_stosb(unsigned char* p, size_t n, int c) {
  __asm__ volatile("rep stosb" : "+D"(p), "+c"(n) : "a"(c) : "memory");
}
static inline void rep_movsb(unsigned char* d, unsigned char* s, size_t n) {
  __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) :: "memory");
}
static inline void lock_add(unsigned char* p, uint64_t v) { __asm__ volatile("lock addq %1, (%0)" :: "r"(p), "r"(v) : "memory"); }
static inline void add32(unsigned char* p, uint32_t v) { __asm__ volatile("addl %1, (%0)" :: "r"(p), "r"(v) : "memory"); }
static inline uint64_t xchg64(unsigned char* p, uint64_t v) { __asm__ volatile("xchgq %0, (%1)" : "+r"(v) : "r"(p) : "memory"); return v; }

static volatile uint64_t sink;
// p, its origin hidden from the compiler: p - 4 below the region is meant
// (no -Warray-bounds on it).
static inline unsigned char* opaque(unsigned char* p) { __asm__("" : "+r"(p)); return p; }
// For the hardware-watchpoint test: an aligned word on its own.
__attribute__((aligned(64))) uint64_t ss_word;

__attribute__((noinline)) static void hw_script(int n) {
  for (int i = 0; i < n; i++) {
    st64((unsigned char*)&ss_word, (uint64_t)i); printf("W +0 8 write\n");
    sink += ld64((unsigned char*)&ss_word);      printf("W +0 8 read\n");
    sink += ld32((unsigned char*)&ss_word + 4);  printf("W +0 8 read\n");
  }
}

__attribute__((noinline)) static void script_single(void) {
  unsigned char* r = ss_region;
  ld8(r + 0);            expect(0, r + 0, 1, "read");
  st16(r + 2, 0xbeef);   expect(0, r + 2, 2, "write");
  sink += ld32(r + 4);   expect(0, r + 4, 4, "read");
  st64(r + 8, 42);       expect(0, r + 8, 8, "write");
  st32imm(r + 16);       expect(0, r + 16, 4, "write");
  sink += ldzx8(r + 17); expect(0, r + 17, 1, "read");
  sse_copy(r + 32, r + 48);  expect(0, r + 48, 16, "read"); expect(0, r + 32, 16, "write");
  avx_copy(r + 64, r + 96);  expect(0, r + 96, 32, "read"); expect(0, r + 64, 32, "write");
  rep_stosb(r + 128, 5, 0x5a);
  for (int i = 0; i < 5; i++) expect(0, r + 128 + i, 1, "write");
  rep_movsb(r + 140, r + 128, 3);
  for (int i = 0; i < 3; i++) { expect(0, r + 128 + i, 1, "read"); expect(0, r + 140 + i, 1, "write"); }
  lock_add(r + 160, 7);  expect(0, r + 160, 8, "read-write");
  add32(r + 168, 3);     expect(0, r + 168, 4, "read-write");
  xchg64(r + 176, 9);    expect(0, r + 176, 8, "read-write");
  // Straddles the start of the region: recorded (it touches region bytes).
  sink += ld64(opaque(r) - 4);   expect(0, opaque(r) - 4, 8, "read");
  // Same page, outside the region: executed, not recorded.
  st64(ss_before + 200, 1);
  sink += ld64(ss_after + 8);
  st16(ss_after + 100, 7);
  sink += ld8(ss_before + 255);
  // A read(2) into the region and a write(2) from it (the kernel accesses them).
  int p[2];
  if (pipe(p) != 0) abort();
  if (write(p[1], "0123456789", 10) != 10) abort();
  ssize_t n = read(p[0], r + 300, 10);
  if (n != 10) { printf("read into region failed: %zd\n", n); exit(3); }
  expect(0, r + 300, 10, "write");
  uint64_t v = ld64(r + 300); expect(0, r + 300, 8, "read");
  printf("read(2) into region ok: %.8s\n", (char*)&v);
  if (write(p[1], r + 300, 10) != 10) abort();
  expect(0, r + 300, 10, "read");
  char back[16] = {0};
  if (read(p[0], back, 10) != 10 || memcmp(back, "0123456789", 10) != 0) { printf("write from region failed\n"); exit(3); }
  close(p[0]);
  close(p[1]);
  // Other system calls with a pointer into the region must not fail with EFAULT
  // (the helper opens the pages around them; the kernel's own accesses are not recorded).
  if (syscall(SYS_clock_gettime, CLOCK_MONOTONIC, (struct timespec*)(r + 400)) != 0) { printf("clock_gettime EFAULT\n"); exit(3); }
  sink += ld64(r + 400); expect(0, r + 400, 8, "read");
  st32imm(r + 416);      expect(0, r + 416, 4, "write");
  long fr = syscall(SYS_futex, (uint32_t*)(r + 416), FUTEX_WAIT, 0, NULL, NULL, 0);  // value differs: EAGAIN
  printf("futex on region: %s\n", fr == -1 && errno == EAGAIN ? "EAGAIN" : "unexpected");
}

static int rounds = 50;

__attribute__((noinline)) static void* thread_script(void* arg) {
  int t = (int)(intptr_t)arg;
  unsigned char* s = ss_region + 512 + 128 * t;
  for (int k = 0; k < rounds; k++) {
    st64(s + 0, (uint64_t)k);      expect(t + 1, s + 0, 8, "write");
    sink += ld32(s + 8);           expect(t + 1, s + 8, 4, "read");
    sse_copy(s + 16, s + 32);      expect(t + 1, s + 32, 16, "read"); expect(t + 1, s + 16, 16, "write");
    lock_add(s + 64, 1);           expect(t + 1, s + 64, 8, "read-write");
    rep_stosb(s + 80, 2, t);       expect(t + 1, s + 80, 1, "write"); expect(t + 1, s + 81, 1, "write");
    st64(ss_after + 16 * t, 1);    // same page, outside: not recorded
  }
  return NULL;
}

// --signals: the program's own signals must reach it as if untraced, including
// genuine SIGSEGVs (a NULL read, a store to its own read-only page) that its
// handler recovers from, while the region is tracked.
static volatile int usr1, usr2, segv;
static sigjmp_buf jb;
static void on_usr(int sig) {
  if (sig == SIGUSR1) usr1++;
  else usr2++;
  sink += ld8(ss_region + 1000);  // a region access inside a signal handler
}
static void on_segv(int sig) { segv++; siglongjmp(jb, 1); }
static int signals_script(void) {
  signal(SIGUSR1, on_usr);
  signal(SIGUSR2, on_usr);
  signal(SIGSEGV, on_segv);
  for (int i = 0; i < 3; i++) {
    raise(SIGUSR1);
    expect(0, ss_region + 1000, 1, "read");
    st64(ss_region + 8, (uint64_t)i);
    expect(0, ss_region + 8, 8, "write");
  }
  kill(getpid(), SIGUSR2);
  expect(0, ss_region + 1000, 1, "read");
  if (sigsetjmp(jb, 1) == 0) sink += ld64((unsigned char*)(uintptr_t)8);  // genuine fault
  unsigned char* ro = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (sigsetjmp(jb, 1) == 0) st64(ro, 1);  // genuine fault on a page of its own
  st16(ss_region + 2, 1);
  expect(0, ss_region + 2, 2, "write");
  printf("usr1 %d usr2 %d segv %d\n", usr1, usr2, segv);
  for (int i = 0; i < logs[0].n; i++) printf("T0 %+d %d %s\n", logs[0].e[i].off, logs[0].e[i].size, logs[0].e[i].kind);
  printf("done\n");
  return 7;
}

int main(int argc, char** argv) {
  int threads = 0;
  int wait_stdin = 0;
  int spin = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--wait-stdin")) wait_stdin = 1;
    else if (!strcmp(argv[i], "--signals")) return signals_script();
    else if (!strcmp(argv[i], "--hw") && i + 1 < argc) { hw_script(atoi(argv[++i])); printf("done\n"); return 7; }
    else if (!strcmp(argv[i], "--spin") && i + 1 < argc) spin = atoi(argv[++i]);
  }
  volatile uintptr_t b = (uintptr_t)ss_before, r = (uintptr_t)ss_region, a = (uintptr_t)ss_after;
  if (b + 256 != r || r + REGION != a || (b >> 12) != ((a + 255) >> 12)) {
    printf("layout wrong\n");
    return 4;
  }
  if (wait_stdin) {  // attach mode: the test attaches, then writes a line
    printf("ready\n");
    fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 5;
  }
  script_single();
  // --spin N: N more rounds of region accesses, for the interrupt tests (not logged).
  for (int k = 0; k < spin; k++) { st64(ss_region + 900, (uint64_t)k); sink += ld32(ss_region + 904); lock_add(ss_region + 912, 1); }
  if (threads > 0) {
    pthread_t th[8];
    for (int t = 0; t < threads && t < 4; t++) pthread_create(&th[t], NULL, thread_script, (void*)(intptr_t)t);
    for (int t = 0; t < threads && t < 4; t++) pthread_join(th[t], NULL);
    uint64_t total = 0;
    for (int t = 0; t < threads && t < 4; t++) { total += ld64(ss_region + 512 + 128 * t + 64); expect(0, ss_region + 512 + 128 * t + 64, 8, "read"); }
    printf("lock add total %llu\n", (unsigned long long)total);
  }
  for (int t = 0; t <= threads && t < 5; t++)
    for (int i = 0; i < logs[t].n; i++)
      printf("T%d %+d %d %s\n", t, logs[t].e[i].off, logs[t].e[i].size, logs[t].e[i].kind);
  printf("done\n");
  return 7;  // a distinctive exit status: the helper must return it
}
