/* CFI unwinding of user stacks (issue 5). Included by stack.bpf.h.
 *
 * User space (src/unwind) turns each executable file's .eh_frame/.debug_frame
 * into pc-sorted rows (struct mt_unwind_row, bpf/memtrace.h) in the shards
 * of unwind_shards, and records per process the executable mappings and which rows they use
 * (unwind_procs). Here, per frame: find the mapping of the pc (binary search
 * over the process's mappings), find the row (binary search over the file's
 * rows), compute the CFA, read the return address at CFA-8 and the caller's
 * rbp where the row says it was saved. No row for a pc: frame-pointer step.
 * Frames are walked by bpf_loop, so the verifier sees one step.
 *
 * Loader side: skel->maps.unwind_shards (BPF_F_MMAPABLE arrays, written
 * through mmap), skel->maps.unwind_procs; see src/unwind/unwind_maps.h.
 *
 * In parts, each building on the one before: unwind_state.bpf.h (maps,
 * window, memo entry), unwind_rows.bpf.h (the row of a pc),
 * unwind_step.bpf.h (one frame), unwind_memo.bpf.h (replay); here the walk,
 * the memo lookup and mt_unwind_cfi, the entry point.
 */
#ifndef MT_UNWIND_BPF_H
#define MT_UNWIND_BPF_H

#include "unwind_state.bpf.h"
#include "unwind_rows.bpf.h"
#include "unwind_step.bpf.h"
#include "unwind_memo.bpf.h"

/* Counters and flags of a finished stack (walked or replayed). */
static __always_inline int mt_unwind_done(__u32 n, __u32 frames_fp, __u32 reason)
{
	mt_unwind_count(MT_UC_STACKS);
	mt_unwind_count(reason);
	/* frames past the first (ips[0] is read, not unwound) */
	if (n > 1) {
		__u32 unwound = n - 1;
		if (unwound > frames_fp)
			mt_unwind_add(MT_UC_FRAMES_CFI, unwound - frames_fp);
		if (frames_fp)
			mt_unwind_add(MT_UC_FRAMES_FP, frames_fp);
	}
	return reason >= MT_UC_TRUNC_DEPTH ? MT_F_STACK_TRUNCATED : 0;
}


/* The frame loop. A global function: the verifier checks it once, whatever
 * state its caller is in (inlined, every branch before it -- memo hit or
 * not, entry probe or not -- multiplied its work past the 1M limit). */
__attribute__((noinline)) int mt_unwind_walk(struct mt_walk_io *io, struct mt_stack *out,
					     struct mt_unwind_win *win, struct mt_unwind_proc *proc,
					     struct mt_memo_ent *me)
{
	struct mt_unwind_ctx c = {};
	__u32 zero = 0;

	if (!io || !out || !win || !proc || !me)
		return -1;
	c.rc = bpf_map_lookup_elem(&unwind_rc, &zero);
	if (!c.rc)
		return -1;
	c.out = out;
	c.win = win;
	c.proc = proc;
	c.me = me;
	c.pc = io->pc;
	c.sp = io->sp;
	c.bp = io->bp;
	c.h = io->h;
	c.gen = io->gen;
	c.exact_pc = io->exact_pc;
	c.n = io->n;
	bpf_loop(MT_MAX_FRAMES, mt_unwind_step_cb, &c, 0);
	io->sp = c.sp;
	io->h = c.h;
	io->n = c.n;
	io->reason = c.reason ? c.reason : MT_UC_TRUNC_DEPTH;
	io->frames_fp = c.frames_fp;
	return 0;
}


#define MT_MEMO_WAYS 4 /* power of 2, <= the smallest memo the loader makes (16) */

/* The memo set at k->slot: replays the first way recorded for these
 * registers whose words are unchanged. 0: a hit, out holds the stack; -1: a
 * miss, k->slot is the way to record the walk into (empty, or the least
 * recently used). Four ways: one call site at one depth is often reached
 * from several places further up (sqlite3: 35% of its stacks missed with
 * one way, 20% with two, all of them with the key of a recorded way). A
 * global function: verified once, whatever its caller did before. */
__attribute__((noinline)) int mt_memo_lookup(struct mt_unwind_win *win, struct mt_memo_key *k,
					     struct mt_stack *out)
{
	__u64 oldest = ~0ULL;
	__u32 first, victim;

	if (!win || !k || !out)
		return -1;
	first = k->slot;
	victim = first;
	for (int w = 0; w < MT_MEMO_WAYS; w++) {
		__u32 slot = first + w;
		struct mt_memo_ent *e = bpf_map_lookup_elem(&unwind_memo, &slot);

		if (!e) /* (never: slot is masked by the map's size) */
			return -1;
		if (e->gen == k->epoch && e->tgid == k->tgid && e->sp == k->sp && e->ip == k->pc &&
		    e->ret_at == k->ret_at && (!(e->flags & MT_MEMO_F_BP) || e->bp == k->bp)) {
			__u32 fl = e->first_len;
			/* The first cluster is read as one (the hint was short,
			 * or another way's replay moved the window). */
			if (fl && win->len0 && !(win->base == win->base0 && win->len >= fl))
				mt_urefill(win, win->base0, fl);
			if (mt_memo_replay(win, e, k->pc, out) == 0) {
				e->used = win->clock;
				k->nr = e->nr;
				k->frames_fp = e->frames_fp;
				k->reason = e->reason;
				k->first_len = fl;
				return 0;
			}
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 8);
#endif
		}
		if (e->used < oldest) {
			oldest = e->used;
			victim = slot;
		}
	}
	k->slot = victim;
	return -1;
}

/* The empty value a process without a published one walks with, under its
 * own gen (see unwind_lazy_gen). */
static __always_inline struct mt_unwind_proc *mt_unwind_noproc(__u32 tgid)
{
	struct mt_unwind_noproc *p;
	__u32 zero = 0, *g, gen;

	p = bpf_map_lookup_elem(&unwind_noproc, &zero);
	if (!p)
		return 0;
	g = bpf_map_lookup_elem(&unwind_lazy_gen, &tgid);
	if (g) {
		gen = *g;
	} else {
		p->next++;
		gen = 0x80000000u | (bpf_get_smp_processor_id() & 127) << 24 | (p->next & 0xffffff);
		if (bpf_map_update_elem(&unwind_lazy_gen, &tgid, &gen, BPF_NOEXIST)) {
			g = bpf_map_lookup_elem(&unwind_lazy_gen, &tgid); /* another CPU's */
			if (!g)
				return 0;
			gen = *g;
		}
	}
	p->p.nr = 0;
	p->p.gen = gen;
	return &p->p;
}

/* CFI walk. Returns -1 when the process has no tables (caller falls back to
 * its frame-pointer walk), else the capture flags. */
static __always_inline int mt_unwind_cfi(const struct mt_uregs *r, int ret_at,
					 struct mt_stack *out)
{
	struct mt_walk_io *io;
	struct mt_memo_key *k;
	struct mt_unwind_proc *proc;
	struct mt_unwind_win *win;
	struct mt_memo_ent *e;
	__u32 tgid = r->tgid;
	__u32 zero = 0, slot, n, epoch, hs = 0, key_end = 0;
	__u64 *ep;

	if (unwind_disabled)
		return -1;
	ep = bpf_map_lookup_elem(&unwind_epoch, &zero);
	if (!ep || !*ep) /* no tables anywhere yet */
		return -1;
	epoch = (__u32)*ep;
	win = bpf_map_lookup_elem(&unwind_win, &zero);
	if (!win) /* (never: index 0 of a per-CPU array) */
		return -1;
	io = &win->io;
	k = &win->key;
	__builtin_memset(io, 0, sizeof(*io));
	__builtin_memset(k, 0, sizeof(*k));
	win->len = 0; /* nothing of this stack read yet */
	win->floor = r->sp;
	win->top = r->start_stack > r->sp ? (r->start_stack + 4095) & ~4095ULL : 0;
	io->exact_pc = (__u32)ret_at >> 31; /* not an entry probe: pc is exact */
	io->sp = r->sp;
	io->bp = r->bp;
	io->pc = r->ip;
#ifdef __TARGET_ARCH_arm64
	if (ret_at >= 0) {
		/* Entry probe: bl left the return address in x30, and the
		 * probe's placement moved sp by ret_at (nothing read) */
		io->pc = r->lr & MT_ARM64_VA_MASK;
		io->sp = r->sp + ret_at;
		if (!io->pc) {
			out->nr = 0;
			return MT_F_NO_STACK;
		}
	} else {
		io->lr = r->lr;
	}
#else
	if (ret_at >= 0) {
		/* Entry probe: the return address is at [rsp + ret_at], rbp is
		 * still the caller's. (This read fills the window the memo
		 * replay or the walk go on with.) */
		struct mt_unwind_pair p;
		__u64 ra = io->sp + ret_at;

		hs = (__u32)(((ra ^ ((__u64)tgid << 20)) * 0x9E3779B97F4A7C15ULL) >> 40) &
		     (MT_FIRST_HINTS - 1);
		/* As much as the last stack taken here needed, in one copy
		 * (else the 2 KiB window of mt_uread16) */
		mt_first_read(win, ra, win->first_hint[hs]);
		if (mt_uread16_fast(win, ra, &p) || !p.a) {
			out->nr = 0;
			return MT_F_NO_STACK;
		}
		io->pc = p.a;
		io->sp = ra + 8;
		if (win->len && ra >= win->base && ra + 16 - win->base <= win->len)
			key_end = ra + 16 - win->base; /* (else no window: read directly) */
	}
#endif
	win->base0 = win->base;
	win->len0 = win->len;

	/* Memo key: rsp and the first frame (the call site), so that two
	 * call paths reaching the allocator at the same depth do not take
	 * turns evicting each other. */
	k->sp = r->sp;
	k->bp = r->bp;
	k->pc = io->pc;
	k->ret_at = ret_at;
	k->epoch = epoch;
	k->tgid = tgid;
	k->slot = (__u32)(((r->sp ^ (io->pc * 0xC2B2AE3D27D4EB4FULL) ^ ((__u64)epoch << 40) ^
			   ((__u64)tgid << 20) ^ (__u64)(__u32)ret_at) * 0x9E3779B97F4A7C15ULL) >> 40) &
		 unwind_memo_mask & ~(MT_MEMO_WAYS - 1);
	win->clock++;
	if (mt_memo_lookup(win, k, out) == 0) {
		mt_unwind_count(MT_UC_MEMO_HITS);
		if (key_end)
			win->first_hint[hs & (MT_FIRST_HINTS - 1)] = k->first_len;
		return mt_unwind_done(k->nr, k->frames_fp, k->reason);
	}
	/* A miss: the walk needs this process's tables; none published yet:
	 * an empty value, every row through the pc's VMA (mt_unwind_vma_mapping). */
	proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
	if (!proc) {
		proc = mt_unwind_noproc(tgid);
		if (!proc)
			return -1;
	}
	io->gen = proc->gen;
	slot = k->slot;
	e = bpf_map_lookup_elem(&unwind_memo, &slot);
	if (!e)
		return -1;
	e->used = win->clock;
	e->gen = 0; /* being rewritten by the walk below */
	e->nw = 0;
	e->bp_mem = 0;
	e->bp0_used = 0;
	out->ips[0] = io->pc;
	io->n = 1;
	io->h = mt_hash_step(MT_HASH_SEED, io->pc);
#ifdef MT_UNWIND_CACHE_STATS
	{
		__u64 sp0 = r->sp;
		if (mt_unwind_walk(io, out, win, proc, e))
			return -1;
		mt_unwind_add(MT_UC_COUNT + 4, io->sp - sp0);
	}
#else
	if (mt_unwind_walk(io, out, win, proc, e))
		return -1;
#endif
	n = io->n > MT_MAX_FRAMES ? MT_MAX_FRAMES : io->n;
	out->nr = n;
	out->stack_id = io->h ? io->h : 1; /* = mt_stack_hash(out): no second pass */
	if (io->reason != MT_UC_TRUNC_READ && e->nw <= MT_MEMO_WORDS) {
		e->sp = r->sp;
		e->ip = io->pc;
		e->bp = e->bp0_used ? r->bp : 0;
		e->stack_id = out->stack_id;
		e->ret_at = ret_at;
		e->nr = n;
		e->flags = e->bp0_used ? MT_MEMO_F_BP : 0;
		e->reason = io->reason;
		e->frames_fp = io->frames_fp;
		e->tgid = tgid;
		mt_memo_plan(e, win->base0, key_end, r->sp);
		if (key_end)
			win->first_hint[hs & (MT_FIRST_HINTS - 1)] = e->first_len;
		e->gen = epoch; /* last: the entry is valid from here */
	}
	return mt_unwind_done(n, io->frames_fp, io->reason);
}

#endif
