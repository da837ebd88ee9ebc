/* Part of memtrace.bpf.c, included at its end (one BPF object, one skeleton). */
#ifndef MT_ALLOC_BPF_H
#define MT_ALLOC_BPF_H

/* ------------------------------------------------------------------------
 * Allocator probes. One entry program and one return program serve every
 * role: the loader passes cookie = role | ret_at << 8 (ret_at: where the
 * return address is relative to rsp at the chosen probe offset).
 * ---------------------------------------------------------------------- */

/* The probe that fired was attached for an earlier image of this process
 * (see MT_COOKIE_IMAGE_SHIFT). The process's image is looked up once per
 * thread and mm, then kept in the thread's record. */
static __always_inline bool from_old_image(mt_task_t task, struct mt_inflight *cur, __u64 cookie)
{
#ifndef MT_COMPAT
	__u64 mm = (__u64)task->mm;

	if (system_wide || (__u32)(cookie >> MT_COOKIE_IMAGE_SHIFT) == MT_COOKIE_IMAGE_SHARED)
		return false;
	if (cur->img_mm != mm) {
		__u32 tgid = task->tgid;
		struct mt_target *t = bpf_map_lookup_elem(&targets, &tgid);

		cur->img_mm = mm;
		/* vfork children run on their parent's probes */
		cur->img = t && t->state != MT_TS_SHARED_MM ? t->image : MT_IMAGE_ANY;
	}
	return cur->img != MT_IMAGE_ANY && cur->img != (__u32)(cookie >> MT_COOKIE_IMAGE_SHIFT);
#else
	return false; /* no cookies: the loader closes the old image's probes */
#endif
}

/* The first or the second argument: both read, then chosen (a choice of
 * offset into ctx is a "modified ctx ptr" the verifier refuses). */
static __always_inline __u64 arg1_or_2(struct pt_regs *ctx, bool second)
{
	__u64 a = PT_REGS_PARM1(ctx), b = PT_REGS_PARM2(ctx);

	asm volatile("" : "+r"(a), "+r"(b));
	return second ? b : a;
}

static __always_inline bool is_realloc(__u32 role)
{
	return role == MT_ROLE_REALLOC || role == MT_ROLE_REALLOCARRAY || role == MT_ROLE_PY_REALLOC;
}

/* ---- --sample-bytes N (issue 34) on the BPF path: each thread counts down
 * the bytes to its next sample (mt_inflight.sample_left), the distance drawn
 * from an exponential distribution of mean N (MT_SAMPLE_GAPS quantiles the
 * loader computes, picked at random), as tcmalloc's sampler and the agent's.
 * An unsampled call still pays its uprobe and uretprobe; it skips the stack
 * and the record. A sampled block's address bumps a counter in
 * sample_buckets; a free whose bucket is 0 is not recorded (no lookup in
 * the loader), one that is not 0 is, and takes it down (a block of another
 * address in the bucket: the model finds no block, frees_of_unseen_blocks).
 * The loader weights each sampled block by 1 / (1 - exp(-size / N)). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MT_SAMPLE_GAPS);
	__type(key, __u32);
	__type(value, __u32);
} sample_gaps SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* the loader sizes it (1 << 20) when sampling */
	__type(key, __u32);
	__type(value, __u32);
} sample_buckets SEC(".maps");

/* The size the call asks for (the same arguments as the record's below). */
static __always_inline __u64 asked_size(struct pt_regs *ctx, __u32 role)
{
	switch (role) {
	case MT_ROLE_CALLOC:
		return mul_sat(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx));
	case MT_ROLE_REALLOC:
		return PT_REGS_PARM2(ctx);
	case MT_ROLE_REALLOCARRAY:
		return mul_sat(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
	case MT_ROLE_POSIX_MEMALIGN:
		return PT_REGS_PARM3(ctx);
	case MT_ROLE_ALIGNED_ALLOC:
	case MT_ROLE_MEMALIGN:
	case MT_ROLE_PY_MALLOC:
		return PT_REGS_PARM2(ctx);
	case MT_ROLE_PY_CALLOC:
		return mul_sat(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
	case MT_ROLE_PY_REALLOC:
		return PT_REGS_PARM3(ctx);
	default:
		return PT_REGS_PARM1(ctx);
	}
}

static __always_inline __u32 *sample_bucket(__u64 addr)
{
	__u32 k = (__u32)(((addr >> 4) * 0x9E3779B97F4A7C15ULL) >> 40) & sample_bucket_mask;

	return bpf_map_lookup_elem(&sample_buckets, &k);
}

static __always_inline __s64 sample_gap(void)
{
	__u32 i = bpf_get_prandom_u32() & (MT_SAMPLE_GAPS - 1);
	__u32 *g = bpf_map_lookup_elem(&sample_gaps, &i);

	return g && *g ? (__s64)*g : (__s64)sample_bytes;
}

/* Whether a free of addr is recorded: always without sampling, else when
 * its bucket holds a sampled block (taken down). */
static __always_inline bool free_recorded(__u64 addr)
{
	__u32 *b;

	if (!sample_bytes)
		return true;
	b = sample_bucket(addr);
	if (!b || !*b)
		return false;
	__sync_fetch_and_add(b, -1);
	return true;
}

static __always_inline int alloc_enter_record(struct pt_regs *ctx, __u32 role, int ret_at,
					      struct mt_inflight *cur, __u64 stack_id, __u32 flags,
					      __u64 pid_tgid, __u64 sp);

static __always_inline int alloc_enter(struct pt_regs *ctx, __u32 role, int ret_at, __u64 cookie)
{
	mt_task_t task = current_task();
	__u64 pid_tgid = task_pid_tgid(task);
	__u64 sp = PT_REGS_SP(ctx);
	struct mt_inflight *cur;
	__u64 stack_id;
	__u32 flags = 0;
	bool is_free = role == MT_ROLE_FREE || role == MT_ROLE_PY_FREE;

#ifdef MT_CHAIN
	{
		/* The CFI chain this entry started (take_stack) is done: the
		 * call goes on from its stack (unwind_chain.bpf.h). */
		__u32 zero = 0;
		struct mt_chain *st = bpf_map_lookup_elem(&unwind_chain, &zero);

		if (st && st->state == MT_CHAIN_DONE) {
			st->state = MT_CHAIN_IDLE;
			if (st->kind == MT_CHAIN_ALLOC && st->pid_tgid == pid_tgid && st->probe_sp == sp &&
			    st->role == role) {
				struct mt_stack *s = bpf_map_lookup_elem(&stack_scratch, &zero);
				__u64 id;

				cur = inflight_of(task, 0); /* (made before the walk) */
				if (!cur || !s)
					return 0;
				flags = st->flags;
				id = stack_send(s, &flags, pid_tgid);
				alloc_enter_record(ctx, role, ret_at, cur, id, flags, pid_tgid, sp);
				return 1; /* to mt_chain_start's caller, the entry that started the chain */
			}
		}
	}
#endif
	if ((__u32)(pid_tgid >> 32) == self_pid || tracing_stopped)
		return 0;

	/* Created here for the roles that need a record at return, so that
	 * cur is known non-NULL across the stack capture below (a
	 * pointer-or-NULL live across it would make the verifier check the
	 * unwinder once per case). */
	cur = inflight_of(task, role == MT_ROLE_FREE ? 0 : 1);
	if (cur && from_old_image(task, cur, cookie))
		return 0;
	if (cur && cur->depth > 0) {
		if (sp <= cur->sp) {
			/* A public entry point called from inside another
			 * (realloc(NULL, n) -> malloc): counted once, as the
			 * outer call. free and aligned operator new have no
			 * return probe: not counted. */
			if (!is_free && role != MT_ROLE_ALIGNED_NEW)
				cur->depth++;
			count(MT_C_NESTED);
			return 0;
		}
		count(MT_C_STALE_INFLIGHT); /* a return we never saw */
	}

	if (role == MT_ROLE_ALIGNED_NEW) {
		/* The size the program asked for, for the aligned call this
		 * operator makes next (see MT_ROLE_ALIGNED_NEW). new[] and the
		 * nothrow forms call new through the PLT: the innermost entry
		 * leaves the mark, with the same size. */
		if (cur) {
			cur->depth = 0;
			cur->role = MT_ROLE_ALIGNED_NEW;
			cur->arg0 = PT_REGS_PARM1(ctx);
			cur->sp = sp + ret_at;
		}
		return 0;
	}

	if (is_free) {
		__u64 ptr = arg1_or_2(ctx, role == MT_ROLE_PY_FREE);
		/* pymalloc's free of a block past 512 bytes frees it with free():
		 * the mark its entry left (MT_ROLE_PY_FREE) says it is freed
		 * already. Used once. */
		if (role == MT_ROLE_FREE && cur && cur->role == MT_ROLE_PY_FREE && cur->depth == 0 &&
		    cur->arg0 == ptr && sp + ret_at <= cur->sp) {
			cur->role = MT_ROLE_FREE;
			count(MT_C_NESTED);
			return 0;
		}
		if (ptr && free_recorded(ptr)) /* free(NULL) is not a free */
			emit(MT_EV_FREE, 0, pid_tgid, ptr, 0, 0, 0, 0, role, 0);
		if (cur) {
			cur->depth = 0;
			cur->role = role; /* an operator new's mark is for the next call only */
			cur->arg0 = ptr;
			cur->sp = sp + ret_at;
		}
		return 0;
	}

	if (!cur) {
		/* no task storage: the allocation cannot be paired with its
		 * return (counted); realloc's old block still dies */
		count(MT_C_INFLIGHT_FULL);
		if (is_realloc(role)) {
			__u64 old = arg1_or_2(ctx, role == MT_ROLE_PY_REALLOC);
			if (old && free_recorded(old))
				emit(MT_EV_FREE, MT_F_NO_STACK, pid_tgid, old, 0, 0, 0, 0, role, 0);
		}
		return 0;
	}

	if (sample_bytes) {
		/* Not sampled: no stack, no record; the depth still pairs
		 * the call with its return (nested calls), and realloc's old
		 * block dies if it was a sampled one. */
		__s64 left = cur->sample_left > 0 ? cur->sample_left : sample_gap();

		left -= (__s64)asked_size(ctx, role);
		if (left > 0) {
			struct mt_inflight un = {.sp = sp, .role = role, .depth = 1, .flags = MT_F_UNSAMPLED,
						 .sample_left = left};
			if (is_realloc(role)) {
				__u64 old = arg1_or_2(ctx, role == MT_ROLE_PY_REALLOC);
				if (old && free_recorded(old)) {
					emit(MT_EV_FREE, MT_F_NO_STACK, pid_tgid, old, 0, 0, 0, 0, role, 0);
					un.arg0 = old; /* a failure revives it */
					un.arg1 = asked_size(ctx, role);
				}
			}
			*cur = un;
			return 0;
		}
		cur->sample_left = sample_gap();
	}

	/* The stack first, with nothing branch-dependent live across it, so
	 * that the verifier checks the unwinder once (mt_alloc_enter: 170k
	 * instructions verified, 320k before). */
	{
		struct mt_uregs r = {.ip = PT_REGS_IP(ctx), .sp = sp, .bp = PT_REGS_FP(ctx),
				     .tgid = pid_tgid >> 32, .start_stack = task_start_stack(task),
#ifdef __TARGET_ARCH_arm64
				     .lr = PT_REGS_RET(ctx),
#endif
		};
#ifdef MT_CHAIN
		/* The compat object's CFI walk: 1 when the chain ran and its
		 * resumed entry recorded this call (unwind_chain.bpf.h) */
		if (capture_stacks && mt_chain_start(ctx, &r, ret_at, role))
			return 0;
#endif
		stack_id = take_stack(&r, ret_at, &flags, pid_tgid);
	}
	return alloc_enter_record(ctx, role, ret_at, cur, stack_id, flags, pid_tgid, sp);
}

/* alloc_enter after the stack: the call's in-flight record (its return
 * probe emits it), realloc's old block. */
static __always_inline int alloc_enter_record(struct pt_regs *ctx, __u32 role, int ret_at,
					      struct mt_inflight *cur, __u64 stack_id, __u32 flags,
					      __u64 pid_tgid, __u64 sp)
{
	struct mt_inflight rec = {};

	rec.stack_id = stack_id;
	rec.flags = flags;
	rec.sp = sp;
	rec.role = role;
	rec.depth = 1;
	switch (role) {
	case MT_ROLE_CALLOC:
		rec.arg0 = mul_sat(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx));
		break;
	case MT_ROLE_REALLOC:
		rec.arg0 = PT_REGS_PARM1(ctx);
		rec.arg1 = PT_REGS_PARM2(ctx);
		break;
	case MT_ROLE_REALLOCARRAY:
		rec.arg0 = PT_REGS_PARM1(ctx);
		rec.arg1 = mul_sat(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
		break;
	case MT_ROLE_POSIX_MEMALIGN:
		rec.arg1 = PT_REGS_PARM1(ctx); /* memptr */
		rec.arg0 = PT_REGS_PARM3(ctx); /* size */
		break;
	case MT_ROLE_ALIGNED_ALLOC:
	case MT_ROLE_MEMALIGN:
		rec.arg0 = PT_REGS_PARM2(ctx);
		break;
	case MT_ROLE_PY_MALLOC: /* (ctx, size) */
		rec.arg0 = PT_REGS_PARM2(ctx);
		break;
	case MT_ROLE_PY_CALLOC: /* (ctx, nelem, elsize) */
		rec.arg0 = mul_sat(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
		break;
	case MT_ROLE_PY_REALLOC: /* (ctx, ptr, size) */
		rec.arg0 = PT_REGS_PARM2(ctx);
		rec.arg1 = PT_REGS_PARM3(ctx);
		break;
	default: /* malloc, valloc, pvalloc */
		rec.arg0 = PT_REGS_PARM1(ctx);
		break;
	}
	/* Made from inside a C++ aligned operator new whose entry left its
	 * size: that size, not the rounded one passed on. Checked after the
	 * stack capture (nothing branch-dependent live across it). The mark
	 * goes with *cur = rec below, taken or not. */
	if (cur->role == MT_ROLE_ALIGNED_NEW && cur->depth == 0 &&
	    (role == MT_ROLE_ALIGNED_ALLOC || role == MT_ROLE_POSIX_MEMALIGN || role == MT_ROLE_MEMALIGN) &&
	    sp + ret_at < cur->sp) {
		rec.arg0 = cur->arg0;
		rec.flags |= MT_F_CXX_NEW;
	}

	/* realloc(p, n), p != NULL: the old block dies now, before the
	 * allocator can hand its address to another thread. A failure is
	 * undone by MT_EV_REALLOC_FAIL at return. */
	if (is_realloc(role) && rec.arg0) {
		if (free_recorded(rec.arg0))
			emit(MT_EV_FREE, flags, pid_tgid, rec.arg0, 0, 0, 0, rec.stack_id, role, 0);
		else
			rec.flags |= MT_F_OLD_UNRECORDED;
	}

	rec.sample_left = cur->sample_left;
	*cur = rec;
	return 0;
}

#ifndef MT_COMPAT
SEC("uprobe")
int mt_alloc_enter(struct pt_regs *ctx)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	return alloc_enter(ctx, cookie & 0xff, (int)(cookie >> 8), cookie);
}
#else
/* No BPF cookie before 5.15: one program per role (the loader attaches role
 * R's probes to mt_alloc_enter_R, mt_alloc_enter being malloc's), each probe
 * placed where the return address is still at [rsp] (ret_at 0). */
SEC("uprobe")
int mt_alloc_enter(struct pt_regs *ctx) { return alloc_enter(ctx, MT_ROLE_MALLOC, 0, 0); }
#define MT_ROLE_PROG(R)                                                        \
	SEC("uprobe") int mt_alloc_enter_##R(struct pt_regs *ctx) { return alloc_enter(ctx, R, 0, 0); }
MT_ROLE_PROG(1)
MT_ROLE_PROG(2)
MT_ROLE_PROG(3)
MT_ROLE_PROG(4)
MT_ROLE_PROG(5)
MT_ROLE_PROG(6)
MT_ROLE_PROG(7)
MT_ROLE_PROG(8)
MT_ROLE_PROG(9)
MT_ROLE_PROG(10)
MT_ROLE_PROG(11)
MT_ROLE_PROG(12)
MT_ROLE_PROG(13)
MT_ROLE_PROG(14)
_Static_assert(MT_ROLE_COUNT == 15, "one mt_alloc_enter_R per role");

#ifdef MT_CHAIN
/* The CFI chain's walker (unwind_chain.bpf.h): MT_CHAIN_STEPS frames a run,
 * then itself again, or the entry program of the role that started it. Its
 * return value (or the resumed entry's) is mt_chain_start's. */
SEC("uprobe")
int mt_unwind_chain(struct pt_regs *ctx)
{
	__u32 zero = 0;
	struct mt_chain *st = bpf_map_lookup_elem(&unwind_chain, &zero);

	if (!st || st->state != MT_CHAIN_WALKING || st->kind != MT_CHAIN_ALLOC)
		return 0;
	if (mt_chain_run(st)) {
		bpf_tail_call(ctx, &unwind_chain_progs, MT_CHAIN_WALKER);
		st->flags = mt_chain_finish(st); /* (no tail call left: cut here) */
		st->state = MT_CHAIN_DONE;
	}
	bpf_tail_call(ctx, &unwind_chain_progs, st->role < MT_ROLE_COUNT ? st->role : 0);
	/* (never: the loader fills every slot before it attaches) 0 to
	 * mt_chain_start's caller: it walks frame pointers, records the call */
	st->state = MT_CHAIN_IDLE;
	count(MT_C_CHAIN_FALLBACK);
	return 0;
}
#endif
#endif

SEC("uretprobe")
int mt_alloc_exit(struct pt_regs *ctx)
{
	mt_task_t task = current_task();
	__u64 pid_tgid = task_pid_tgid(task);
	struct mt_inflight *cur = inflight_of(task, 0);
	__u64 ret = PT_REGS_RC(ctx);
	__u64 size, addr;
	__u32 role;

	if (!cur || cur->depth == 0)
		return 0;
	if (cur->depth > 1) {
		/* An old image's return probe (MT_COOKIE_IMAGE_SHIFT) fires
		 * beside the current one's until the loader has closed it:
		 * only a nested call's count could be taken down twice. At
		 * depth 1 the first of the two emits and the other finds
		 * depth 0, so the cookie (a helper call) is asked only here. */
#ifndef MT_COMPAT
		if (from_old_image(task, cur, bpf_get_attach_cookie(ctx)))
			return 0;
#endif
		cur->depth--;
		return 0;
	}
	cur->depth = 0;
	role = cur->role;
	size = cur->arg0;
	addr = ret;
	if (cur->flags & MT_F_UNSAMPLED) {
		/* realloc(p, n) that fails leaves p alive: p's free was recorded
		 * at entry (a sampled block), so is its revival */
		if (is_realloc(role) && cur->arg0 && !ret && cur->arg1)
			emit(MT_EV_REALLOC_FAIL, 0, pid_tgid, cur->arg0, cur->arg1, 0, 0, 0, role, 0);
		return 0;
	}

	switch (role) {
	case MT_ROLE_REALLOC:
	case MT_ROLE_REALLOCARRAY:
	case MT_ROLE_PY_REALLOC:
		size = cur->arg1;
		if (cur->arg0 && !ret) {
			/* realloc(p, 0) frees p (already emitted); realloc(p, n)
			 * that fails leaves p alive. */
			if (size && !(cur->flags & MT_F_OLD_UNRECORDED))
				emit(MT_EV_REALLOC_FAIL, cur->flags & ~MT_F_BPF_ONLY, pid_tgid, cur->arg0, size, 0, 0,
				     cur->stack_id, role, 0);
			return 0;
		}
		break;
	case MT_ROLE_POSIX_MEMALIGN:
		addr = 0;
		if ((int)ret == 0)
			bpf_probe_read_user(&addr, sizeof(addr), (void *)cur->arg1);
		break;
	default:
		break;
	}
	if (!addr) {
		emit(MT_EV_ALLOC_FAIL, cur->flags & ~MT_F_BPF_ONLY, pid_tgid, 0, size, 0, 0, cur->stack_id, role, 0);
		return 0;
	}
	if (sample_bytes) { /* a sampled block: its free is to be recorded */
		__u32 *b = sample_bucket(addr);
		if (b)
			__sync_fetch_and_add(b, 1);
	}
	emit(MT_EV_ALLOC, cur->flags & ~MT_F_BPF_ONLY, pid_tgid, addr, size,
	     is_realloc(role) && !(cur->flags & MT_F_OLD_UNRECORDED) ? cur->arg0 : 0, 0,
	     cur->stack_id, role, 0);
	return 0;
}

#endif /* MT_ALLOC_BPF_H */
