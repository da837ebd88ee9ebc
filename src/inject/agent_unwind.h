/* The agent's own stack walk (issue 33): the loader's CFI rows (ring.h,
 * MT_INJ_STACK_CFI), the BPF unwinder's rules (bpf/unwind_step.bpf.h) run
 * in the process, with a memo of return address -> row so that a call
 * site seen before unwinds in one table lookup. Plain C, nothing but what
 * the agent has (no allocation, no locks). x86-64 only. */
#ifndef MEMTRACE_INJECT_AGENT_UNWIND_H
#define MEMTRACE_INJECT_AGENT_UNWIND_H

#include <stdint.h>

#include "memtrace.h"
#include "inject/ring.h"

#define MT_CFI_MEMO_BITS 12 /* 32 KiB */

struct mt_cfi {
  const struct mt_inj_cfi_mod* mods;
  uint32_t nmods;
  const struct mt_unwind_row* rows;
  uint32_t nrows;
  uint64_t* memo; /* 1 << MT_CFI_MEMO_BITS words (mt_cfi_memo_bytes), zeroed; NULL: none */
  /* The agent's own code (mapped after the loader built the rows; built
   * with frame pointers: CFA = rbp + 16 at every call in it), [lo, hi). */
  uint64_t self_lo, self_hi;
};

enum mt_cfi_walk_result {
  MT_CFI_DONE = 0, /* the outermost frame (its return address undefined) or a 0 return address */
  MT_CFI_FULL = 1, /* max frames taken, more above */
  MT_CFI_SLOW = 2, /* cannot go on: a pc without a row, a rule the rows lack, a read outside [lo, hi) */
};

static inline uint64_t mt_cfi_memo_bytes(void) { return sizeof(uint64_t) << MT_CFI_MEMO_BITS; }

/* From a hook's frame (bp: its frame pointer, ret: its return address) up:
 * ips[0] = ret, then each caller's return address, at most max; *n the
 * frames taken. Reads only [lo, hi) (the thread's stack above the hook's
 * frame). */
enum mt_cfi_walk_result mt_cfi_walk(const struct mt_cfi* c, uint64_t* ips, int max, int* n, uintptr_t ret,
                                    uintptr_t bp, uintptr_t lo, uintptr_t hi);

#endif
