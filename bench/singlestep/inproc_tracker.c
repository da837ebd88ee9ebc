// Reference for the benchmark: seed 000's in-process design, rebuilt here.
// mprotect the region's pages; SIGSEGV handler logs the fault address,
// unprotects the page and sets the trap flag; SIGTRAP handler re-protects and
// clears it. One region, addresses only, and NOT exact with several threads
// (a thread may touch the page while another has it unprotected, and the
// counters race) - which is what the benchmark shows next to the helper.
#define _GNU_SOURCE
#include "inproc_tracker.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

static uintptr_t g_page_lo, g_page_hi, g_lo, g_hi;
static volatile uint64_t g_count;
static uintptr_t* g_addrs;
static uint64_t g_max;

static void on_segv(int sig, siginfo_t* si, void* uc_) {
  ucontext_t* uc = uc_;
  uintptr_t a = (uintptr_t)si->si_addr;
  if (a < g_page_lo || a >= g_page_hi) {
    signal(SIGSEGV, SIG_DFL);
    return;
  }
  if (a >= g_lo && a < g_hi) {
    uint64_t n = __atomic_fetch_add(&g_count, 1, __ATOMIC_RELAXED);
    if (n < g_max) g_addrs[n] = a;
  }
  mprotect((void*)g_page_lo, g_page_hi - g_page_lo, PROT_READ | PROT_WRITE);
  uc->uc_mcontext.gregs[REG_EFL] |= 0x100;  // TF: trap after the faulting instruction
}

static void on_trap(int sig, siginfo_t* si, void* uc_) {
  ucontext_t* uc = uc_;
  mprotect((void*)g_page_lo, g_page_hi - g_page_lo, PROT_NONE);
  uc->uc_mcontext.gregs[REG_EFL] &= ~0x100ull;
}

int inproc_start(void* addr, size_t len, uintptr_t* addrs, uint64_t max) {
  g_lo = (uintptr_t)addr;
  g_hi = g_lo + len;
  g_page_lo = g_lo & ~4095ul;
  g_page_hi = (g_hi + 4095) & ~4095ul;
  g_addrs = addrs;
  g_max = max;
  g_count = 0;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_flags = SA_SIGINFO;
  sa.sa_sigaction = on_segv;
  sigaction(SIGSEGV, &sa, NULL);
  sa.sa_sigaction = on_trap;
  sigaction(SIGTRAP, &sa, NULL);
  return mprotect((void*)g_page_lo, g_page_hi - g_page_lo, PROT_NONE);
}

uint64_t inproc_end(void) {
  mprotect((void*)g_page_lo, g_page_hi - g_page_lo, PROT_READ | PROT_WRITE);
  signal(SIGSEGV, SIG_DFL);
  signal(SIGTRAP, SIG_DFL);
  return g_count;
}
