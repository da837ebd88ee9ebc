/* CFI unwinder, part 3 of 4 (included by unwind.bpf.h): one frame step
 * (x86-64 and arm64 register rules, frame-pointer fallback), recording into
 * the walk memo the stack words it used. */
#ifndef MT_UNWIND_STEP_BPF_H
#define MT_UNWIND_STEP_BPF_H

/* Memo: the walk used the stack word val at addr. is_ra: it is the return
 * address the step will append (if it does: see mt_memo_frame). */
static __always_inline void mt_memo_rec(struct mt_unwind_ctx *c, __u64 addr, __u64 val,
					__u32 is_ra)
{
	struct mt_memo_ent *e = c->me;
	__u32 k;

	/* The word count lives in the entry, not in c: loaded from map
	 * memory it is an unknown number to the verifier, which otherwise
	 * verified the step once per count (it indexes memory, so the
	 * verifier tracks it exactly) and ran out of its 1M instructions. */
	if (!e)
		return;
	k = e->nw;
	if (k < MT_MEMO_WORDS) {
		e->addr[k] = addr;
		e->val[k] = val;
		e->oi[k] = 0;
	}
	if (is_ra)
		e->ra_k = k;
	e->nw = k + 1;
}

/* Memo: the step appended its return address (word c->ra_k) as frame
 * c->n - 1. */
static __always_inline void mt_memo_frame(struct mt_unwind_ctx *c)
{
	struct mt_memo_ent *e = c->me;
	__u32 k;

	if (!e)
		return;
	k = e->ra_k;
	if (k < MT_MEMO_WORDS)
		e->oi[k] = c->n - 1;
}

/* Memo: the walk is about to use c->bp. A saved rbp only counts as an
 * input of the walk when it is used: in code without frame pointers rbp is
 * an ordinary register, and the values frames saved (object pointers,
 * counters) would otherwise make every stack look new. */
static __always_inline void mt_memo_use_bp(struct mt_unwind_ctx *c)
{
	struct mt_memo_ent *e = c->me;

	if (!e)
		return;
	if (!e->bp_mem) {
		e->bp0_used = 1;
	} else if (!e->bp_rec) {
		mt_memo_rec(c, e->bp_addr, c->bp, 0);
		e->bp_rec = 1;
	}
}

/* The caller's rbp was read from the stack at addr (recorded if used). */
static __always_inline void mt_memo_bp_read(struct mt_unwind_ctx *c, __u64 addr)
{
	struct mt_memo_ent *e = c->me;

	if (!e)
		return;
	e->bp_mem = 1;
	e->bp_rec = 0;
	e->bp_addr = addr;
}

/* The step found the caller: ra its return address (0: the stack ends),
 * cfa its sp, bp its rbp/x29. Appends ra; 0, or 1 to end the walk. */
static __always_inline long mt_unwind_push(struct mt_unwind_ctx *c, __u64 ra, __u64 cfa, __u64 bp,
					   int from_fp)
{
	if (ra == 0) {
		c->reason = MT_UC_END_ZERO;
		return 1;
	}
	if (c->n >= MT_MAX_FRAMES) {
		c->reason = MT_UC_TRUNC_DEPTH;
		return 1;
	}
	{
		__u32 i = c->n;
#ifdef MT_COMPAT
		/* (else clang drops the mask after the check above and forms
		 * the address before it: "unbounded memory access") */
		asm volatile("" : "+r"(i));
#endif
		c->out->ips[i & (MT_MAX_FRAMES - 1)] = ra;
	}
	c->n++;
	mt_memo_frame(c);
	c->h = mt_hash_step(c->h, ra);
	c->frames_fp += from_fp;
	c->pc = ra;
	c->sp = cfa;
	c->bp = bp;
	c->exact_pc = 0;
	return 0;
}

/* One frame: from (pc, sp, bp) to the caller's; appends the return address. */
static __always_inline long mt_unwind_step(struct mt_unwind_ctx *c)
{
	struct mt_unwind_row row = {};
	__u64 cfa, ra = 0, bp = c->bp, lookup;
	__u32 type, rule;
	int from_fp = 0;

	if (!c->proc || !c->out)
		return 1;
	lookup = c->exact_pc ? c->pc : c->pc - 1; /* return address: the call is before it */
	if (!c->win || !c->rc)
		return 1;
	{
		__u32 slot = (__u32)(((lookup ^ ((__u64)c->gen << 32)) * 0x9E3779B97F4A7C15ULL) >> 40) &
			     (MT_UNWIND_RC_ENTRIES - 1);
		struct mt_unwind_cache_ent *ce = &c->rc->e[slot];
		if (ce->pc == lookup && ce->gen == c->gen) {
			row = ce->row;
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 1);
#endif
		} else {
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 2);
#endif
			int rm = mt_unwind_row_miss(c->proc, lookup, c->gen, &row);
#ifndef MT_COMPAT /* (bpf_find_vma is 5.17: a pc of no published mapping has no row) */
			if (rm == 1)
				rm = mt_unwind_vma_miss(lookup, c->gen, &row);
#endif
			if (rm != 0)
				row.kind = MT_CFA_NONE;
			ce->pc = lookup;
			ce->gen = c->gen;
			ce->row = row;
		}
	}
	type = MT_ROW_CFA(&row);
	rule = MT_ROW_RBP(&row);

	switch (type) {
	case MT_CFA_RSP:
		cfa = c->sp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_RBP:
		if (c->bp_lost) {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		mt_memo_use_bp(c);
		cfa = c->bp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_RBP_DEREF:
		{
			struct mt_unwind_pair p;
			__u64 at = c->bp + (__s64)row.cfa_off * 8;
			if (c->bp_lost || mt_uread16_fast(c->win, at, &p)) {
				c->reason = c->bp_lost ? MT_UC_TRUNC_UNSUPPORTED : MT_UC_TRUNC_READ;
				return 1;
			}
			mt_memo_use_bp(c);
			mt_memo_rec(c, at, p.a, 0);
			cfa = p.a;
		}
		break;
	case MT_CFA_PLT:
		cfa = c->sp + 8 + ((c->pc & 15) >= (__u64)row.cfa_off ? 8 : 0);
		break;
	case MT_CFA_END:
		c->reason = MT_UC_END_OUTERMOST;
		return 1;
	case MT_CFA_NONE: {
		/* No CFI here: frame-pointer step. */
		struct mt_unwind_pair p;
		if (c->bp_lost) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_use_bp(c);
		if (c->bp == 0) {
			c->reason = MT_UC_END_ZERO;
			return 1;
		}
		if ((c->bp & 7) || c->bp < c->sp || mt_uread16_fast(c->win, c->bp, &p)) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_rec(c, c->bp + 8, p.b, 1);
		mt_memo_bp_read(c, c->bp);
		bp = p.a;
		ra = p.b;
		cfa = c->bp + 16;
		from_fp = 1;
		break;
	}
	default:
		c->reason = MT_UC_TRUNC_UNSUPPORTED;
		return 1;
	}
	if (cfa <= c->sp) {
		c->reason = MT_UC_TRUNC_BAD_FRAME;
		return 1;
	}
	if (!from_fp && rule == MT_RBP_AT_CFA && row.rbp_off == -2) {
		/* push %rbp right after the call: saved rbp and return address
		 * are adjacent, one read. */
		struct mt_unwind_pair p;
		if (mt_uread16_fast(c->win, cfa - 16, &p)) {
			c->reason = MT_UC_TRUNC_READ;
			return 1;
		}
		mt_memo_rec(c, cfa - 8, p.b, 1);
		mt_memo_bp_read(c, cfa - 16);
		bp = p.a;
		ra = p.b;
		c->bp_lost = 0;
	} else if (!from_fp) {
		struct mt_unwind_pair p;
		if (mt_uread16_fast(c->win, cfa - 8, &p)) {
			c->reason = MT_UC_TRUNC_READ;
			return 1;
		}
		mt_memo_rec(c, cfa - 8, p.a, 1);
		ra = p.a;
		if (rule == MT_RBP_AT_CFA || rule == MT_RBP_AT_RBP) {
			__u64 at = rule == MT_RBP_AT_CFA ? cfa : c->bp;
			if (rule == MT_RBP_AT_RBP && c->bp_lost) {
				c->bp_lost = 1;
			} else {
				if (rule == MT_RBP_AT_RBP)
					mt_memo_use_bp(c);
				at += (__s64)row.rbp_off * 8;
				if (mt_uread16_fast(c->win, at, &p)) {
					c->reason = MT_UC_TRUNC_READ;
					return 1;
				}
				mt_memo_bp_read(c, at);
				bp = p.a;
				c->bp_lost = 0;
			}
		} else if (rule == MT_RBP_UNKNOWN) {
			c->bp_lost = 1;
		}
	}
	return mt_unwind_push(c, ra, cfa, bp, from_fp);
}

#ifdef __TARGET_ARCH_arm64
/* One arm64 frame (issue 20): the row read as bpf/memtrace.h's arm64 rows
 * say. The CFA is the caller's sp, on sp or x29; the return address is
 * x30: in its register (the first frame only: an exact pc in a leaf, a
 * .plt stub, a function's entry), or saved in the frame, usually next to
 * x29 (stp x29, x30), the slot k words from the CFA (a row keeps it from
 * the CFA or from the CFA's register: memtrace.h). No row: the frame record ([x29] = the caller's x29,
 * [x29+8] = x30), which does not tell the caller's sp: c->bp_lost bit 1
 * (bit 0: x29 lost) until a row gives it back. Return addresses lose
 * their PAC bits (MT_ARM64_VA_MASK). */
static __always_inline long mt_unwind_step_arm64(struct mt_unwind_ctx *c)
{
	struct mt_unwind_row row = {};
	struct mt_unwind_pair p = {};
	__u64 cfa, ra = 0, bp = c->bp, lookup, slot;
	__u32 type, rule, ra_rule, x29_saved;
	__s64 k; /* the save slot, in words from the CFA */
	int from_fp = 0;

	if (!c->proc || !c->out || !c->win || !c->rc)
		return 1;
	lookup = c->exact_pc ? c->pc : c->pc - 1; /* return address: the bl is before it */
	mt_unwind_row_of(c, lookup, &row);
	type = MT_ROW_CFA(&row);
	rule = MT_ROW_X29_ARM64(&row);
	ra_rule = MT_ROW_RA_ARM64(&row);
	x29_saved = rule == MT_RBP_AT_CFA || rule == MT_X29_AT_BASE_ARM64;
	k = row.rbp_off;
	if (rule == MT_X29_AT_BASE_ARM64 || ra_rule == MT_RA_AT_BASE)
		k -= row.cfa_off; /* kept from sp or x29, the CFA's register */

	switch (type) {
	case MT_CFA_RSP:
		if (c->bp_lost & 2) {
			/* sp unknown past a frame record; a function that saved
			 * x29 at CFA + k and keeps a frame record has x29 =
			 * CFA + k (stp x29, x30, [sp, #-N]!; mov x29, sp) */
			if ((c->bp_lost & 1) || !x29_saved) {
				c->reason = MT_UC_TRUNC_UNSUPPORTED;
				return 1;
			}
			mt_memo_use_bp(c);
			cfa = c->bp - k * 8;
		} else {
			cfa = c->sp + (__s64)row.cfa_off * 8;
		}
		break;
	case MT_CFA_RBP:
		if (c->bp_lost & 1) {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		mt_memo_use_bp(c);
		cfa = c->bp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_END:
		c->reason = MT_UC_END_OUTERMOST;
		return 1;
	case MT_CFA_NONE:
		/* No CFI here: the frame record at x29. */
		if (c->bp_lost & 1) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_use_bp(c);
		if (c->bp == 0) {
			c->reason = MT_UC_END_ZERO;
			return 1;
		}
		if ((c->bp & 7) || c->bp < c->sp || mt_uread16_fast(c->win, c->bp, &p)) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_rec(c, c->bp + 8, p.b, 1);
		mt_memo_bp_read(c, c->bp);
		bp = p.a;
		ra = p.b;
		cfa = c->bp + 16; /* at least: the caller's sp is unknown */
		from_fp = 1;
		break;
	default:
		c->reason = MT_UC_TRUNC_UNSUPPORTED;
		return 1;
	}
	/* (at an entry or in a leaf nothing was pushed: CFA = sp) */
	if (cfa < c->sp || (cfa == c->sp && ra_rule != MT_RA_REG)) {
		c->reason = MT_UC_TRUNC_BAD_FRAME;
		return 1;
	}
	if (from_fp) {
		c->bp_lost |= 2;
	} else {
		slot = cfa + k * 8;
		if (ra_rule != MT_RA_REG || x29_saved) {
			if (mt_uread16_fast(c->win, slot, &p)) {
				c->reason = MT_UC_TRUNC_READ;
				return 1;
			}
		}
		if (ra_rule == MT_RA_PAIR) {
			mt_memo_rec(c, slot + 8, p.b, 1);
			ra = p.b;
		} else if (ra_rule == MT_RA_AT_CFA || ra_rule == MT_RA_AT_BASE) {
			mt_memo_rec(c, slot, p.a, 1);
			ra = p.a;
		} else if (c->exact_pc && c->win->io.lr) {
			/* x30 itself: known at the probe only. The memo is not
			 * keyed by it: this walk is not kept (nw past the limit). */
			ra = c->win->io.lr;
			if (c->me)
				c->me->nw = MT_MEMO_WORDS + 1;
		} else {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		if (x29_saved) {
			mt_memo_bp_read(c, slot);
			bp = p.a;
			c->bp_lost = 0;
		} else if (rule == MT_RBP_UNKNOWN) {
			c->bp_lost = 1;
		} else {
			c->bp_lost &= 1;
		}
	}
	return mt_unwind_push(c, ra & MT_ARM64_VA_MASK, cfa, bp, from_fp);
}
#endif

/* bpf_loop callback: one frame. (Two or four inlined frames per call save
 * a call and a thunked return each, ~3% of W1's probe time, but double or
 * quadruple the verifier's work: 170k -> 300k / 670k instructions.) */
static long mt_unwind_step_cb(__u64 i, void *arg)
{
#ifdef __TARGET_ARCH_arm64
	return mt_unwind_step_arm64(arg);
#else
	return mt_unwind_step(arg);
#endif
}

/* User registers at the probe, as plain values. */
struct mt_uregs {
	__u64 ip, sp, bp;
	__u32 tgid; /* of the current task */
	__u32 pad;
	__u64 start_stack; /* current->mm->start_stack (0: unknown), read by
			    * the caller from the task it has (no helper call) */
#ifdef __TARGET_ARCH_arm64
	__u64 lr; /* x30: the return address at a function's entry */
#endif
};
#endif /* MT_UNWIND_STEP_BPF_H */
