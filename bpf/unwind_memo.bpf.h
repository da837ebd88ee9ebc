/* CFI unwinder, part 4 of 4 (included by unwind.bpf.h): the walk memo's
 * planned refills and its replay (a memo hit re-reads the recorded words
 * and rebuilds the stack from them). */
#ifndef MT_UNWIND_MEMO_BPF_H
#define MT_UNWIND_MEMO_BPF_H

/* A planned refill: len bytes of user memory at start into the window
 * (0; -1: unreadable, the window is empty). A global function: one copy of
 * its checks for every word of the replay loop. */
__attribute__((noinline)) int mt_urefill(struct mt_unwind_win *w, __u64 start, __u32 len)
{
	len &= MT_UNWIND_BUF_BYTES - 1; /* (plans stay below it) */
	if (!w || len == 0)
		return -1;
#ifdef MT_UNWIND_CACHE_STATS
	mt_unwind_count(MT_UC_COUNT + 3);
#endif
	if (bpf_probe_read_user(w->w, len, (void *)start)) {
		w->len = 0;
		return -1;
	}
	w->base = start;
	w->len = len;
	return 0;
}

/* Refill plan of a memo entry, made once when the walk is recorded: how
 * much the first read needs, which words a replay will find outside its
 * window after it, and how much to read there. The first read starts at
 * b (mt_win_start of the entry probe's return address, the same for every
 * stack taken at this rsp) and covers the return address the memo key needs
 * (key_end bytes) and then the first cluster of recorded words: a stack's
 * return addresses come in clusters (python3's eval frames ~300 bytes apart,
 * sqlite3's at 0-3, 5, 9-11 and 15-17 KiB), and each later refill reads from
 * its word up to the last of the following words that lie within
 * MT_MEMO_PLAN_GAP of each other. (The walk itself read fixed 2 KiB windows.)
 * floor: rsp at the probe (the stack is readable from there up).
 * A copy costs ~75 ns whatever its size (bench/unwind/copy_cost: a
 * bpf_probe_read_user of 8 bytes) and ~6 ns per KiB of hot stack, so words
 * up to 8 KiB apart are read with one copy (sqlite3: 3 copies per stack
 * -> 2, W3 ns/call 0.91x against a 4 KiB gap; W1 the same; docs/unwind-perf.md
 * round 6). Reads stay below MT_UNWIND_BUF_BYTES. */
#ifndef MT_MEMO_PLAN_GAP
#define MT_MEMO_PLAN_GAP 8192
#endif
#define MT_PLAN_NONE MT_MEMO_WORDS       /* plan_cur: no refill to extend */
#define MT_PLAN_FIRST (MT_MEMO_WORDS + 1) /* plan_cur: extend the first read */
struct mt_plan_ctx {
	struct mt_memo_ent *e;
	__u64 b, l, floor;
	__u32 nw;
};

/* One recorded word of the plan: a bpf_loop step (as a bounded loop of
 * MT_MEMO_WORDS iterations the verifier walked each one: a sixth of a
 * program's load on 6.18). */
static long mt_memo_plan_step(__u32 i, void *data)
{
	struct mt_plan_ctx *c = data;
	struct mt_memo_ent *e = c->e;
	__u64 a, s;
	__u32 cur, k;

	if (!e || i >= c->nw)
		return 1;
	k = i & (MT_MEMO_WORDS - 1);
	if (k != i)
		return 1;
	a = e->addr[k];
	e->rlen[k] = 0;
	e->rback[k] = 0;
	if (a >= c->b && a - c->b <= c->l && c->l - (a - c->b) >= 16)
		return 0; /* in the window */
	cur = *(volatile __u32 *)&e->plan_cur; /* (not the value clang knows) */
	if (cur != MT_PLAN_NONE && a >= c->b && a + 16 - c->b < MT_UNWIND_BUF_BYTES &&
	    a - c->b < c->l + MT_MEMO_PLAN_GAP) {
		c->l = a + 16 - c->b; /* the planned read reaches up to here */
		if (cur < MT_MEMO_WORDS)
			e->rlen[cur] = c->l;
		else
			e->first_len = c->l;
		return 0;
	}
	s = mt_win_start(c->floor, a);
	c->b = s;
	c->l = a + 16 - s;
	e->plan_cur = k;
	e->rlen[k] = c->l;
	e->rback[k] = (a - s) >> 3;
	return 0;
}

__attribute__((noinline)) int mt_memo_plan(struct mt_memo_ent *e, __u64 b, __u32 key_end,
					   __u64 floor)
{
	struct mt_plan_ctx c = {.e = e, .b = b, .l = key_end, .floor = floor};

	if (!e)
		return 0;
	c.nw = e->nw;
	e->first_len = key_end;
	/* The refill being extended lives in the entry: a counter that
	 * indexes memory, kept in a register, is tracked exactly by the
	 * verifier (every value of it, in every iteration). */
	e->plan_cur = key_end ? MT_PLAN_FIRST : MT_PLAN_NONE;
	bpf_loop(MT_MEMO_WORDS, mt_memo_plan_step, &c, 0);
	return 0;
}

/* The first read of an entry probe's stack: len bytes from the window start
 * for addr (the probed function's return address), as the hint for this
 * rsp says; 0: done (the window holds addr), -1: not done (no hint, or the
 * read failed: the caller reads the usual 2 KiB window). */
__attribute__((noinline)) int mt_first_read(struct mt_unwind_win *w, __u64 addr, __u32 len)
{
	__u64 start;

	if (!w || len == 0)
		return -1;
	start = mt_win_start(w->floor, addr);
	if (w->top > start && w->top - start < len)
		len = w->top - start; /* the main thread's stack ends there */
	if (addr - start + 16 > len)
		return -1;
	return mt_urefill(w, start, len);
}

/* Memo hit check: e was recorded from the same registers and rows; re-read
 * its words and rebuild out->ips from them. 0: out holds the stack; -1: a
 * word differs (or cannot be read): walk. A global function: verified once,
 * so that each way its loop can end does not make the verifier check the
 * walk after it again. */
__attribute__((noinline)) int mt_memo_replay(struct mt_unwind_win *w, struct mt_memo_ent *e,
					     __u64 ip, struct mt_stack *out)
{
	__u32 nw;

	if (!w || !e || !out || e->nr == 0 || e->nr > MT_MAX_FRAMES)
		return -1;
	nw = e->nw;
	out->ips[0] = ip; /* the first frame is part of the key */
	/* (No frame counter: the verifier would tell its values apart in
	 * every iteration. Each word knows its frame index.) */
	for (int i = 0; i < MT_MEMO_WORDS; i++) {
		struct mt_unwind_pair p;
		__u64 a, off;
		__u32 k;

		if (i >= nw)
			break;
		a = e->addr[i];
		off = a - w->base;
		if (a < w->base || off > w->len || w->len - off < 16) {
			__u32 rl = e->rlen[i];
			/* (a failed planned read leaves the window empty: the
			 * next read takes the walk's way) */
			if (rl)
				mt_urefill(w, a - ((__u64)e->rback[i] << 3), rl);
		}
		if (mt_uread16_fast(w, a, &p) || p.a != e->val[i])
			return -1;
		k = e->oi[i] & (MT_MAX_FRAMES - 1); /* (frame indexes are below it) */
		if (k)
			out->ips[k] = p.a;
	}
	out->nr = e->nr;
	out->stack_id = e->stack_id;
	return 0;
}

#endif /* MT_UNWIND_MEMO_BPF_H */
