/* CFI unwinding of user stacks (issue 5). Included by stack.bpf.h.
 *
 * User space (src/unwind) turns each executable file's .eh_frame/.debug_frame
 * into pc-sorted rows (struct mt_unwind_row, bpf/memtrace.h) in unwind_rows,
 * and records per process the executable mappings and which rows they use
 * (unwind_procs). Here, per frame: find the mapping of the pc (binary search
 * over the process's mappings), find the row (binary search over the file's
 * rows), compute the CFA, read the return address at CFA-8 and the caller's
 * rbp where the row says it was saved. No row for a pc: frame-pointer step.
 * Frames are walked by bpf_loop, so the verifier sees one step.
 *
 * Loader side: skel->maps.unwind_rows (BPF_F_MMAPABLE array, written through
 * mmap), skel->maps.unwind_procs; see src/unwind/unwind_maps.h.
 */
#ifndef MT_UNWIND_BPF_H
#define MT_UNWIND_BPF_H

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MT_UNWIND_MAX_ROWS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct mt_unwind_row);
} unwind_rows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MT_UNWIND_MAX_PROCS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* tgid */
	__type(value, struct mt_unwind_proc);
} unwind_procs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MT_UC_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} unwind_counters SEC(".maps");

/* Set through skel->rodata before load: 1 = frame pointers only. */
const volatile __u32 unwind_disabled = 0;

/* Binary-search bounds: log2 of the most rows of one file / mappings. */
#define MT_UNWIND_ROW_STEPS 24
#define MT_UNWIND_MAP_STEPS 9 /* > log2(MT_UNWIND_MAX_MAPPINGS) */

static __always_inline void mt_unwind_count(__u32 c)
{
	__u64 *v = bpf_map_lookup_elem(&unwind_counters, &c);
	if (v)
		*v += 1;
}

struct mt_unwind_ctx {
	__u64 pc;  /* current frame's pc */
	__u64 sp;  /* its rsp */
	__u64 bp;  /* its rbp */
	struct mt_stack *out;
	struct mt_unwind_proc *proc;
	__u32 n;        /* frames in out->ips */
	__u32 reason;   /* enum mt_unwind_counter that ended the walk (0: running) */
	__u32 exact_pc; /* pc is not a return address (frame 0 at a non-entry probe) */
	__u32 bp_lost;  /* rbp of this frame is not known */
};

/* Binary searches run under bpf_loop too: as plain bounded loops the
 * verifier would walk every path of every iteration (2^steps). */
struct mt_bsearch {
	__u32 lo, hi; /* answer: lo - 1 = last entry with key <= x */
	__u64 x;
	struct mt_unwind_proc *proc;
};

static long mt_bsearch_map_step(__u64 i, void *arg)
{
	struct mt_bsearch *b = arg;
	__u32 mid;

	if (b->lo >= b->hi || !b->proc)
		return 1;
	mid = b->lo + (b->hi - b->lo) / 2;
	if (b->proc->m[mid & (MT_UNWIND_MAX_MAPPINGS - 1)].start <= b->x)
		b->lo = mid + 1;
	else
		b->hi = mid;
	return 0;
}

static long mt_bsearch_row_step(__u64 i, void *arg)
{
	struct mt_bsearch *b = arg;
	struct mt_unwind_row *r;
	__u32 mid;

	if (b->lo >= b->hi)
		return 1;
	mid = b->lo + (b->hi - b->lo) / 2;
	r = bpf_map_lookup_elem(&unwind_rows, &mid);
	if (!r) {
		b->lo = 0;
		b->hi = 0;
		return 1;
	}
	if (r->pc <= b->x)
		b->lo = mid + 1;
	else
		b->hi = mid;
	return 0;
}

/* Row for pc in proc's mappings: fills *row, returns 0; -1 if none. */
static __always_inline int mt_unwind_find_row(struct mt_unwind_proc *proc, __u64 pc,
					      struct mt_unwind_row *row)
{
	struct mt_bsearch b = {};
	struct mt_unwind_mapping *m;
	struct mt_unwind_row *r;
	__u32 first, idx;
	__u64 rel;

	b.hi = proc->nr;
	if (b.hi > MT_UNWIND_MAX_MAPPINGS)
		b.hi = MT_UNWIND_MAX_MAPPINGS;
	b.x = pc;
	b.proc = proc;
	bpf_loop(MT_UNWIND_MAP_STEPS, mt_bsearch_map_step, &b, 0);
	if (b.lo == 0)
		return -1;
	m = &proc->m[(b.lo - 1) & (MT_UNWIND_MAX_MAPPINGS - 1)];
	if (pc >= m->end || m->nr_rows == 0 || pc < m->bias)
		return -1;
	rel = pc - m->bias;
	if (rel > 0xffffffffULL)
		return -1;
	first = m->first_row;
	b.lo = first;
	b.hi = first + m->nr_rows;
	b.x = rel;
	b.proc = 0;
	bpf_loop(MT_UNWIND_ROW_STEPS, mt_bsearch_row_step, &b, 0);
	if (b.lo <= first)
		return -1;
	idx = b.lo - 1;
	r = bpf_map_lookup_elem(&unwind_rows, &idx);
	if (!r)
		return -1;
	*row = *r;
	return 0;
}

/* One frame: from (pc, sp, bp) to the caller's; appends the return address. */
static long mt_unwind_step(__u64 i, void *arg)
{
	struct mt_unwind_ctx *c = arg;
	struct mt_unwind_row row = {};
	__u64 cfa, ra = 0, bp = c->bp, lookup;
	__u32 type, rule;
	int from_fp = 0;

	if (!c->proc || !c->out)
		return 1;
	lookup = c->exact_pc ? c->pc : c->pc - 1; /* return address: the call is before it */
	if (mt_unwind_find_row(c->proc, lookup, &row) != 0)
		row.kind = MT_CFA_NONE;
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
		cfa = c->bp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_RBP_DEREF:
		if (c->bp_lost ||
		    bpf_probe_read_user(&cfa, sizeof(cfa), (void *)(c->bp + (__s64)row.cfa_off * 8))) {
			c->reason = c->bp_lost ? MT_UC_TRUNC_UNSUPPORTED : MT_UC_TRUNC_READ;
			return 1;
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
		__u64 pair[2];
		if (c->bp_lost) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		if (c->bp == 0) {
			c->reason = MT_UC_END_ZERO;
			return 1;
		}
		if ((c->bp & 7) || c->bp < c->sp || bpf_probe_read_user(pair, sizeof(pair), (void *)c->bp)) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		bp = pair[0];
		ra = pair[1];
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
	if (!from_fp) {
		if (bpf_probe_read_user(&ra, sizeof(ra), (void *)(cfa - 8))) {
			c->reason = MT_UC_TRUNC_READ;
			return 1;
		}
		if (rule == MT_RBP_AT_CFA || rule == MT_RBP_AT_RBP) {
			__u64 at = rule == MT_RBP_AT_CFA ? cfa : c->bp;
			if (rule == MT_RBP_AT_RBP && c->bp_lost) {
				c->bp_lost = 1;
			} else if (bpf_probe_read_user(&bp, sizeof(bp), (void *)(at + (__s64)row.rbp_off * 8))) {
				c->reason = MT_UC_TRUNC_READ;
				return 1;
			} else {
				c->bp_lost = 0;
			}
		} else if (rule == MT_RBP_UNKNOWN) {
			c->bp_lost = 1;
		}
	}
	if (ra == 0) {
		c->reason = MT_UC_END_ZERO;
		return 1;
	}
	if (c->n >= MT_MAX_FRAMES) {
		c->reason = MT_UC_TRUNC_DEPTH;
		return 1;
	}
	c->out->ips[c->n & (MT_MAX_FRAMES - 1)] = ra;
	c->n++;
	mt_unwind_count(from_fp ? MT_UC_FRAMES_FP : MT_UC_FRAMES_CFI);
	c->pc = ra;
	c->sp = cfa;
	c->bp = bp;
	c->exact_pc = 0;
	return 0;
}

/* CFI walk. Returns -1 when the process has no tables (caller falls back to
 * its frame-pointer walk), else the capture flags. */
static __always_inline int mt_unwind_cfi(struct pt_regs *regs, int ret_at, struct mt_stack *out)
{
	struct mt_unwind_ctx c = {};
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	__u32 flags = 0;

	if (unwind_disabled)
		return -1;
	c.proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
	if (!c.proc)
		return -1;
	c.out = out;
	c.sp = PT_REGS_SP_CORE(regs);
	c.bp = PT_REGS_FP_CORE(regs);
	c.pc = PT_REGS_IP_CORE(regs);
	if (ret_at >= 0) {
		/* Entry probe: the return address is at [rsp + ret_at], rbp is
		 * still the caller's. */
		__u64 ret = 0;
		if (bpf_probe_read_user(&ret, sizeof(ret), (void *)(c.sp + ret_at)) || !ret) {
			out->nr = 0;
			return MT_F_NO_STACK;
		}
		out->ips[0] = ret;
		c.n = 1;
		c.pc = ret;
		c.sp = c.sp + ret_at + 8;
	} else {
		out->ips[0] = c.pc;
		c.n = 1;
		c.exact_pc = 1;
	}
	bpf_loop(MT_MAX_FRAMES, mt_unwind_step, &c, 0);
	if (c.reason == 0)
		c.reason = MT_UC_TRUNC_DEPTH;
	out->nr = c.n > MT_MAX_FRAMES ? MT_MAX_FRAMES : c.n;
	mt_unwind_count(MT_UC_STACKS);
	mt_unwind_count(c.reason);
	if (c.reason >= MT_UC_TRUNC_DEPTH)
		flags |= MT_F_STACK_TRUNCATED;
	return flags;
}

#endif
