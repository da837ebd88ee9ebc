// access_script.c for aarch64: a scripted sequence of accesses to ss_region
// (byte, half, word and doubleword loads and stores, LDP/STP with pre-index,
// post-index and register-offset addressing, an LDR literal, SIMD LDR/STR q
// and LD1/ST1 of two registers, LSE atomics, DC ZVA, a read(2) and a write(2)
// on the region) plus accesses just outside the region on the same page; it
// prints the exact list of region accesses it made, as offsets from
// ss_region, the same text traced or not. The same output format and options
// as access_script.c, which the x86-64 tests run (tests/singlestep), so
// tests/kernels/arm64_test.py checks the helper's log against it as
// singlestep_test.cpp does. Every access to the region is an inline-asm
// instruction, so the compiler adds none.
//
// Usage: access_script_arm64 [--threads N (at most 4)] [--rounds R] [--exclusive]
//        [--wait-stdin] [--hw N] [--signals] [--spin N]
// Lines: "T<thread> <+off|-off> <size> <read|write|read-write>"; exit 7.
// --wait-stdin: print "ready" and wait for a line first (attach tests).
// --hw N: N rounds of a store and two loads on ss_word alone, "W +0 8 ..."
// lines (the hardware watchpoint path: the watched word's size).
// --spin N: N more rounds of region accesses after the script, not logged
// (the interrupt tests).
// --signals: access_script.c's signals_script (its own signals, genuine
// SIGSEGVs its handler recovers from, a region access in a handler).
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define REGION 1024
// Same page, in this order (built with -fno-toplevel-reorder).
__attribute__((section(".data.ss_page"), aligned(4096))) unsigned char ss_before[256] = {1};
__attribute__((section(".data.ss_page"))) unsigned char ss_region[REGION] = {2};
__attribute__((section(".data.ss_page"))) unsigned char ss_after[256] = {3};

#define MAXLOG 100000
struct Log {
  int n;
  struct {
    int off, size;
    const char* kind;
  } e[MAXLOG];
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

typedef unsigned char u8;
static inline uint32_t ld8(u8* p) { uint32_t v; __asm__ volatile("ldrb %w0, [%1]" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline void st16(u8* p, uint32_t v) { __asm__ volatile("strh %w1, [%0]" :: "r"(p), "r"(v) : "memory"); }
static inline uint32_t ld32(u8* p) { uint32_t v; __asm__ volatile("ldr %w0, [%1]" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline void st64(u8* p, uint64_t v) { __asm__ volatile("str %1, [%0]" :: "r"(p), "r"(v) : "memory"); }
static inline uint64_t ld64(u8* p) { uint64_t v; __asm__ volatile("ldr %0, [%1]" : "=r"(v) : "r"(p) : "memory"); return v; }
static inline uint64_t ldp64(u8* p) {
  uint64_t a, b;
  __asm__ volatile("ldp %0, %1, [%2]" : "=r"(a), "=r"(b) : "r"(p) : "memory");
  return a + b;
}
// stp x, x, [p, #16]!: 16 bytes at p+16, p moves there.
static inline u8* stp_pre16(u8* p, uint64_t v) {
  __asm__ volatile("stp %1, %1, [%0, #16]!" : "+r"(p) : "r"(v) : "memory");
  return p;
}
// ldr x, [p], #8: 8 bytes at p, p moves on.
static inline u8* ldr_post8(u8* p, uint64_t* v) {
  __asm__ volatile("ldr %1, [%0], #8" : "+r"(p), "=r"(*v) :: "memory");
  return p;
}
static inline uint64_t ldr_lsl3(u8* base, uint64_t i) {
  uint64_t v;
  __asm__ volatile("ldr %0, [%1, %2, lsl #3]" : "=r"(v) : "r"(base), "r"(i) : "memory");
  return v;
}
static inline uint32_t ldr_sxtw2(u8* base, int32_t i) {
  uint32_t v;
  __asm__ volatile("ldr %w0, [%1, %w2, sxtw #2]" : "=r"(v) : "r"(base), "r"(i) : "memory");
  return v;
}
// ldr x, <literal>: 8 bytes at ss_region+272 (PC-relative, within 1 MiB of the code).
static inline uint64_t ldr_literal(void) {
  uint64_t v;
  __asm__ volatile("ldr %0, ss_region+272" : "=r"(v) :: "memory");
  return v;
}
static inline void simd_q_copy(u8* dst, u8* src) {
  __asm__ volatile("ldr q0, [%1]\n\tstr q0, [%0]" :: "r"(dst), "r"(src) : "v0", "memory");
}
static inline void ld1_st1_copy(u8* dst, u8* src) {
  __asm__ volatile("ld1 {v0.16b, v1.16b}, [%1]\n\tst1 {v0.16b, v1.16b}, [%0]" :: "r"(dst), "r"(src)
                   : "v0", "v1", "memory");
}
static inline uint64_t ldadd64(u8* p, uint64_t v) {
  uint64_t old;
  __asm__ volatile(".arch_extension lse\n\tldadd %1, %0, [%2]" : "=r"(old) : "r"(v), "r"(p) : "memory");
  return old;
}
static inline uint32_t swp32(u8* p, uint32_t v) {
  uint32_t old;
  __asm__ volatile(".arch_extension lse\n\tswp %w1, %w0, [%2]" : "=r"(old) : "r"(v), "r"(p) : "memory");
  return old;
}
static inline uint64_t cas64(u8* p, uint64_t expect_v, uint64_t v) {
  __asm__ volatile(".arch_extension lse\n\tcas %0, %1, [%2]" : "+r"(expect_v) : "r"(v), "r"(p) : "memory");
  return expect_v;
}
// ldxr/stxr until the store succeeds. Returns the attempts.
static inline int exclusive_add(u8* p, uint64_t v) {
  int tries = 0;
  uint32_t fail;
  do {
    uint64_t old;
    __asm__ volatile("ldxr %0, [%1]" : "=r"(old) : "r"(p) : "memory");
    old += v;
    __asm__ volatile("stxr %w0, %1, [%2]" : "=&r"(fail) : "r"(old), "r"(p) : "memory");
    tries++;
  } while (fail && tries < 1000);
  return tries;
}
static inline void dc_zva(u8* p) { __asm__ volatile("dc zva, %0" :: "r"(p) : "memory"); }
static unsigned zva_bytes(void) {
  uint64_t v;
  __asm__ volatile("mrs %0, dczid_el0" : "=r"(v));
  return (v & 16) ? 0 : 4u << (v & 15);
}

static volatile uint64_t sink;
static int exclusive;
// For the hardware-watchpoint test: an aligned word on its own.
__attribute__((aligned(64))) uint64_t ss_word;

__attribute__((noinline)) static void hw_script(int n) {
  for (int i = 0; i < n; i++) {
    st64((u8*)&ss_word, (uint64_t)i);      printf("W +0 8 write\n");
    sink += ld64((u8*)&ss_word);           printf("W +0 8 read\n");
    sink += ld32((u8*)&ss_word + 4);       printf("W +0 8 read\n");
  }
}

__attribute__((noinline)) static void script_single(void) {
  u8* r = ss_region;
  uint64_t v;
  sink += ld8(r + 0);            expect(0, r + 0, 1, "read");
  st16(r + 2, 0xbeef);           expect(0, r + 2, 2, "write");
  sink += ld32(r + 4);           expect(0, r + 4, 4, "read");
  st64(r + 8, 42);               expect(0, r + 8, 8, "write");
  sink += ldp64(r + 16);         expect(0, r + 16, 16, "read");
  u8* q = stp_pre16(r + 16, 7);  expect(0, r + 32, 16, "write");
  q = ldr_post8(q, &v);          expect(0, r + 32, 8, "read");
  sink += v + (uint64_t)(q - r);
  sink += ldr_lsl3(r, 6);        expect(0, r + 48, 8, "read");
  sink += ldr_sxtw2(r + 64, -2); expect(0, r + 56, 4, "read");
  simd_q_copy(r + 64, r + 80);   expect(0, r + 80, 16, "read"); expect(0, r + 64, 16, "write");
  ld1_st1_copy(r + 96, r + 128); expect(0, r + 128, 32, "read"); expect(0, r + 96, 32, "write");
  sink += ldadd64(r + 160, 7);   expect(0, r + 160, 8, "read-write");
  sink += swp32(r + 168, 9);     expect(0, r + 168, 4, "read-write");
  sink += cas64(r + 176, 0, 5);  expect(0, r + 176, 8, "read-write");
  sink += ldr_literal();         expect(0, r + 272, 8, "read");
  if (exclusive) {
    int tries = exclusive_add(r + 184, 3);
    // A failed stxr stores nothing: one read per try, one write.
    for (int i = 0; i < tries; i++) expect(0, r + 184, 8, "read");
    expect(0, r + 184, 8, "write");
    printf("exclusive add: %s\n", tries < 1000 ? "stored" : "never stored");
  }
  // dc zva: the whole block that holds the address (DCZID_EL0), if it fits the region.
  unsigned zb = zva_bytes();
  if (zb && zb <= 128) {
    u8* z = (u8*)(((uintptr_t)(r + 192 + zb - 1)) & ~(uintptr_t)(zb - 1));
    dc_zva(z + 3);               expect(0, z, (int)zb, "write");
  }
  // Straddles the start of the region: recorded (it touches region bytes).
  sink += ld64(r - 4);           expect(0, r - 4, 8, "read");
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
  v = ld64(r + 296);             expect(0, r + 296, 8, "read");
  printf("read(2) into region ok: %.4s\n", (char*)&v + 4);
  if (write(p[1], r + 300, 10) != 10) abort();
  expect(0, r + 300, 10, "read");
  char back[16] = {0};
  if (read(p[0], back, 10) != 10 || memcmp(back, "0123456789", 10) != 0) { printf("write from region failed\n"); exit(3); }
  close(p[0]);
  close(p[1]);
  // Other system calls with a pointer into the region must not fail with EFAULT
  // (the helper opens the pages around them; the kernel's own accesses are not recorded).
  if (syscall(SYS_clock_gettime, CLOCK_MONOTONIC, (struct timespec*)(r + 400)) != 0) { printf("clock_gettime EFAULT\n"); exit(3); }
  sink += ld64(r + 400);         expect(0, r + 400, 8, "read");
  st16(r + 416, 0x3344);         expect(0, r + 416, 2, "write");
  long fr = syscall(SYS_futex, (uint32_t*)(r + 416), FUTEX_WAIT, 0, NULL, NULL, 0);  // value differs: EAGAIN
  printf("futex on region: %s\n", fr == -1 && errno == EAGAIN ? "EAGAIN" : "unexpected");
}

static int rounds = 50;

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
static void on_segv(int sig) {
  (void)sig;
  segv++;
  siglongjmp(jb, 1);
}
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
  if (sigsetjmp(jb, 1) == 0) sink += ld64((u8*)(uintptr_t)8);  // genuine fault
  u8* ro = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (sigsetjmp(jb, 1) == 0) st64(ro, 1);  // genuine fault on a page of its own
  st16(ss_region + 2, 1);
  expect(0, ss_region + 2, 2, "write");
  printf("usr1 %d usr2 %d segv %d\n", usr1, usr2, segv);
  for (int i = 0; i < logs[0].n; i++) printf("T0 %+d %d %s\n", logs[0].e[i].off, logs[0].e[i].size, logs[0].e[i].kind);
  printf("done\n");
  return 7;
}

__attribute__((noinline)) static void* thread_script(void* arg) {
  int t = (int)(intptr_t)arg;
  u8* s = ss_region + 512 + 128 * t;
  for (int k = 0; k < rounds; k++) {
    st64(s + 0, (uint64_t)k);    expect(t + 1, s + 0, 8, "write");
    sink += ld32(s + 8);         expect(t + 1, s + 8, 4, "read");
    simd_q_copy(s + 16, s + 32); expect(t + 1, s + 32, 16, "read"); expect(t + 1, s + 16, 16, "write");
    sink += ldadd64(s + 64, 1);  expect(t + 1, s + 64, 8, "read-write");
    stp_pre16(s + 64, (uint64_t)t); expect(t + 1, s + 80, 16, "write");
    sink += ldp64(s + 96);       expect(t + 1, s + 96, 16, "read");
    st64(ss_after + 16 * t, 1);  // same page, outside: not recorded
  }
  return NULL;
}

int main(int argc, char** argv) {
  int threads = 0, wait_stdin = 0, spin = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--wait-stdin")) wait_stdin = 1;
    else if (!strcmp(argv[i], "--signals")) return signals_script();
    else if (!strcmp(argv[i], "--spin") && i + 1 < argc) spin = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--hw") && i + 1 < argc) { hw_script(atoi(argv[++i])); printf("done\n"); return 7; }
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--exclusive")) exclusive = 1;
  }
  if (threads > 4) threads = 4;
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
  for (int k = 0; k < spin; k++) { st64(ss_region + 900, (uint64_t)k); sink += ld32(ss_region + 904); sink += ldadd64(ss_region + 912, 1); }
  if (threads > 0) {
    pthread_t th[4];
    for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, thread_script, (void*)(intptr_t)t);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    // Every ldadd of every thread happened once: the traced program computes what it does untraced.
    uint64_t total = 0;
    for (int t = 0; t < threads; t++) { total += ld64(ss_region + 512 + 128 * t + 64); expect(0, ss_region + 512 + 128 * t + 64, 8, "read"); }
    printf("ldadd total %llu\n", (unsigned long long)total);
  }
  for (int t = 0; t <= threads; t++)
    for (int i = 0; i < logs[t].n; i++)
      printf("T%d %+d %d %s\n", t, logs[t].e[i].off, logs[t].e[i].size, logs[t].e[i].kind);
  printf("done\n");
  return 7;  // a distinctive exit status: the helper must return it
}
