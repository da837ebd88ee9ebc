/* The agent's CFI walk (agent_unwind.h): bpf/unwind_step.bpf.h's x86-64
 * step on the loader's rows, in the traced process. A frame: the row of
 * its return address - 1 (the call), the CFA on rsp or rbp, the return
 * address at CFA - 8, rbp restored from its save slot. Anything the BPF
 * walk would fall back on frame pointers for (no row) or give up on is
 * MT_CFI_SLOW here: the caller redoes the stack with libunwind, so that a
 * stack is either the rows' walk or libunwind's, never a guess. The
 * agent's own frames (allocations inside dlopen's hook) are frame-pointer
 * frames, the rule its CFI says at each call. */
#include "inject/agent_unwind.h"

#include <stddef.h>

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* The memo: direct-mapped on the return address's low MT_CFI_MEMO_BITS
 * bits, one word an entry (no torn reads between threads), small enough
 * to stay in the cache (perf: a 512 KiB memo's load was 40% of the walk):
 * the rest of the address + 1 above bit 28, the row's rule below it
 * (cfa_off in 13 bits, the CFA and rbp rules in 6, rbp_off in 8; a
 * cfa_off beyond 13 bits is not memoized). No row: MT_CFA_NONE. */
#define RULE_BITS 28
static inline int pack_rule(const struct mt_unwind_row* r, uint32_t* out) {
  if (r->cfa_off < -4096 || r->cfa_off > 4095) return 0;
  *out = ((uint32_t)r->cfa_off & 0x1fff) | (uint32_t)(r->kind & 0x3f) << 13 | (uint32_t)(uint8_t)r->rbp_off << 19;
  return 1;
}
static inline void unpack_rule(uint32_t w, int16_t* cfa_off, uint8_t* kind, int8_t* rbp_off) {
  *cfa_off = (int16_t)((int32_t)(w << 19) >> 19);
  *kind = (uint8_t)((w >> 13) & 0x3f);
  *rbp_off = (int8_t)(uint8_t)(w >> 19);
}

static const struct mt_unwind_row* find_row(const struct mt_cfi* c, uint64_t pc) {
  uint32_t lo = 0, hi = c->nmods;
  while (lo < hi) { /* the first module starting above pc */
    uint32_t mid = (lo + hi) / 2;
    if (c->mods[mid].start <= pc) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return NULL;
  const struct mt_inj_cfi_mod* m = &c->mods[lo - 1];
  if (pc >= m->end || pc < m->bias || pc - m->bias > UINT32_MAX || !m->count) return NULL;
  if ((uint64_t)m->first + m->count > c->nrows) return NULL;
  uint32_t rpc = (uint32_t)(pc - m->bias);
  const struct mt_unwind_row* rows = c->rows + m->first;
  uint32_t a = 0, b = m->count;
  while (a < b) { /* the first row above rpc */
    uint32_t mid = (a + b) / 2;
    if (rows[mid].pc <= rpc) a = mid + 1;
    else b = mid;
  }
  return a ? &rows[a - 1] : NULL;
}

/* The rule of the frame whose return address is ra. */
static inline void rule_of(const struct mt_cfi* c, uint64_t ra, int16_t* cfa_off, uint8_t* kind, int8_t* rbp_off) {
  uint64_t tag = ((ra >> MT_CFI_MEMO_BITS) + 1) << RULE_BITS;
  uint64_t* slot = c->memo ? &c->memo[ra & ((1u << MT_CFI_MEMO_BITS) - 1)] : NULL;
  if (LIKELY(slot != NULL)) {
    uint64_t w = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (LIKELY((w & ~((1ull << RULE_BITS) - 1)) == tag)) {
      unpack_rule((uint32_t)(w & ((1ull << RULE_BITS) - 1)), cfa_off, kind, rbp_off);
      return;
    }
  }
  const struct mt_unwind_row* r = find_row(c, ra - 1); /* a return address: the call is before it */
  if (!r) {
    *cfa_off = 0;
    *kind = MT_CFA_NONE;
    *rbp_off = 0;
  } else {
    *cfa_off = r->cfa_off;
    *kind = r->kind;
    *rbp_off = r->rbp_off;
  }
  uint32_t rule = (uint32_t)MT_CFA_NONE << 13;
  if (slot && (!r || pack_rule(r, &rule))) __atomic_store_n(slot, tag | rule, __ATOMIC_RELAXED);
}

/* A word of the stack at a, inside [lo, hi). */
static inline int read_word(uintptr_t a, uintptr_t lo, uintptr_t hi, uint64_t* out) {
  if (UNLIKELY(a < lo || a > hi - 8 || (a & 7))) return 0;
  *out = *(const uint64_t*)a;
  return 1;
}

enum mt_cfi_walk_result mt_cfi_walk(const struct mt_cfi* c, uint64_t* ips, int max, int* n, uintptr_t ret,
                                    uintptr_t bp, uintptr_t lo, uintptr_t hi) {
  *n = 0;
  if (hi < lo + 16 || max <= 0) return MT_CFI_SLOW;
  /* The hook's frame (built with frame pointers): its caller's rbp at bp,
   * ret at bp + 8, the caller's rsp after the return bp + 16. */
  uint64_t rbp, sp = (uint64_t)bp + 16, pc = (uint64_t)ret;
  if (!read_word(bp, lo, hi, &rbp)) return MT_CFI_SLOW;
  int bp_lost = 0, k = 0;
  ips[k++] = pc;
  for (;;) {
    int16_t cfa_off;
    uint8_t kind;
    int8_t rbp_off;
    if (pc >= c->self_lo && pc < c->self_hi) { /* the agent's hook_dlopen: its frame pointer */
      cfa_off = 2;
      kind = MT_CFA_RBP | MT_RBP_AT_CFA << 4;
      rbp_off = -2;
    } else {
      rule_of(c, pc, &cfa_off, &kind, &rbp_off);
    }
    uint64_t cfa, ra;
    switch (kind & 15) {
      case MT_CFA_RSP:
        cfa = sp + (int64_t)cfa_off * 8;
        break;
      case MT_CFA_RBP:
        if (bp_lost) goto slow;
        cfa = rbp + (int64_t)cfa_off * 8;
        break;
      case MT_CFA_RBP_DEREF:
        if (bp_lost || !read_word(rbp + (int64_t)cfa_off * 8, lo, hi, &cfa)) goto slow;
        break;
      case MT_CFA_END:
        *n = k;
        return MT_CFI_DONE;
      default: /* MT_CFA_NONE (no row), MT_CFA_PLT (not at a return address), MT_CFA_UNSUPPORTED */
        goto slow;
    }
    if (cfa <= sp || !read_word(cfa - 8, sp, hi, &ra)) goto slow;
    switch (kind >> 4) {
      case MT_RBP_AT_CFA:
        if (!read_word(cfa + (int64_t)rbp_off * 8, lo, hi, &rbp)) goto slow;
        bp_lost = 0;
        break;
      case MT_RBP_AT_RBP:
        if (!bp_lost && !read_word(rbp + (int64_t)rbp_off * 8, lo, hi, &rbp)) goto slow;
        break;
      case MT_RBP_UNKNOWN:
        bp_lost = 1;
        break;
      default: /* MT_RBP_SAME */
        break;
    }
    if (ra == 0) {
      *n = k;
      return MT_CFI_DONE;
    }
    if (k == max) {
      *n = k;
      return MT_CFI_FULL;
    }
    ips[k++] = ra;
    pc = ra;
    sp = cfa;
  }
slow:
  *n = k;
  return MT_CFI_SLOW;
}
