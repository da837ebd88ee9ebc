/* CFI unwinding without bpf_loop: kernels 5.10-5.16, the compat object
 * (issue 35). Included by stack.bpf.h (x86-64 compat builds only).
 *
 * The same tables and the same frame step as the full object's walk
 * (unwind_step.bpf.h), in a chain of tail calls: the allocator's entry
 * program stages the walk in a per-CPU value (unwind_chain) and tail-calls
 * the walker, mt_unwind_chain (from mt_chain_start, a BPF function); each
 * run of it takes MT_CHAIN_STEPS frames (a bounded loop: the verifier walks
 * each of them, ~10k instructions a step, not the whole stack's), then
 * tail-calls itself until the stack ends, and finally tail-calls the role's
 * own entry program again, which finds the stack done (same thread, rsp and
 * role) and goes on from where it stopped: the stack's record, the call's
 * in-flight record.
 *
 *   mt_alloc_enter_R
 *     -> mt_chain_start() --tail--> mt_unwind_chain --tail--> itself, up to MT_CHAIN_HOPS times
 *                                                   --tail--> mt_alloc_enter_R (state DONE):
 *                                                             records the call, returns 1
 *     <- 1 (a tail call from a BPF function returns to that function's caller)
 *
 * A chain runs inside one program invocation, with preemption off: the
 * per-CPU value, the window and the row caches are this walk's from its
 * start to its end. At most 33 tail calls per invocation: 1 + MT_CHAIN_HOPS
 * + 1 of them here.
 *
 * mmap's exit (sys_exit_mmap, a tracepoint program) has a chain of its own:
 * mt_chain_start_mmap, mt_unwind_chain_mmap (mmap.bpf.h), its own program
 * array (one program type per array).
 *
 * What the full walk has and this one has not: the walk memo (its replay
 * is a bpf_loop), rows through the pc's VMA for processes whose tables are
 * not published yet (bpf_find_vma: such a process's stacks are frame
 * pointers until the loader has read its mappings), probes away from a
 * function's entry (the compat object's are all at ret_at 0).
 */
#ifndef MT_UNWIND_CHAIN_BPF_H
#define MT_UNWIND_CHAIN_BPF_H

#define MT_CHAIN_STEPS 8 /* frames per run of the walker */
#define MT_CHAIN_HOPS 20 /* runs after the first: (1 + 20) * 8 > MT_MAX_FRAMES */
#define MT_CHAIN_WALKER MT_ROLE_COUNT /* its slot in unwind_chain_progs; slot R: role R's entry program */
_Static_assert((1 + MT_CHAIN_HOPS) * MT_CHAIN_STEPS > MT_MAX_FRAMES, "a chain reaches MT_MAX_FRAMES");
_Static_assert(1 + MT_CHAIN_HOPS + 1 <= 32, "within the kernel's tail-call limit");

enum { MT_CHAIN_IDLE = 0, MT_CHAIN_WALKING, MT_CHAIN_DONE };

struct mt_chain {
	__u64 pid_tgid;
	__u64 probe_sp; /* rsp at the probe: the resumed entry program's check */
	__u64 pc, sp, bp; /* the frame the next step starts from */
	__u64 h;          /* mt_stack_hash of ips[0..n) */
	__u32 tgid, n, reason, exact_pc, bp_lost, frames_fp;
	__u32 hops;  /* walker runs after the first */
	__u32 state; /* MT_CHAIN_* */
	__u32 role;  /* whose entry program resumes */
	__u32 flags; /* DONE: the capture flags (mt_unwind_done) */
	__u32 kind;  /* MT_CHAIN_ALLOC (an allocator entry) or MT_CHAIN_MMAP (sys_exit_mmap) */
	__u32 pad;
	__u64 ret;               /* MT_CHAIN_MMAP: mmap's return value */
	struct mt_sysargs args;  /* and its arguments (taken from sysargs before the walk) */
};
enum { MT_CHAIN_ALLOC = 0, MT_CHAIN_MMAP };

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_chain);
} unwind_chain SEC(".maps");

/* Filled by the loader after load: slot R = mt_alloc_enter_R (0:
 * mt_alloc_enter), slot MT_CHAIN_WALKER = mt_unwind_chain. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, MT_ROLE_COUNT + 1);
	__type(key, __u32);
	__type(value, __u32);
} unwind_chain_progs SEC(".maps");

/* The same for the mmap exit (a tracepoint program: a program array holds
 * one program type): slot 0 = mt_exit_mmap, slot 1 = mt_unwind_chain_mmap. */
#define MT_CHAIN_MMAP_RESUME 0
#define MT_CHAIN_MMAP_WALKER 1
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u32);
} unwind_chain_progs_tp SEC(".maps");

/* 0, in a way clang cannot see through: a chain start's return value is
 * the chain's last program's when it ran (a tail call from a BPF function
 * returns to that function's caller), so its "return 0" on every path
 * clang sees must not be folded into the caller's test. */
static __always_inline int mt_chain_not_started(void)
{
	int none = 0;

	asm volatile("" : "+r"(none));
	return none;
}

/* Starts the chain for an entry probe's stack (frame 0 = the return address
 * at [rsp + ret_at]). 1: the chain ran, and the entry program it resumed
 * recorded the call (the caller returns); 0: it did not start, or could not
 * resume (the caller walks frame pointers and records the call itself).
 *
 * A BPF function of its own, which matters twice: a tail call from a BPF
 * function replaces that function's frame only, so the chain's last
 * program returns here, with its return value (the resumed entry returns
 * 1); and however the start fails, the caller's frame-pointer walk after it
 * is one state to the verifier (inlined, each way out was a state of its
 * own: the walk's 129 iterations verified ~8 times, 103k instructions per
 * entry program, 55k now). */
/* The walk staged in unwind_chain for the stack at r: frame 0 is the
 * return address at [rsp + ret_at] at an entry probe, else r->ip (exact);
 * null when this stack is for the frame-pointer walk. */
static __always_inline struct mt_chain *mt_chain_stage(const struct mt_uregs *r, int ret_at, __u32 role,
							__u32 kind)
{
	struct mt_unwind_win *win;
	struct mt_unwind_pair p;
	struct mt_chain *st;
	struct mt_stack *out;
	__u32 zero = 0, tgid = r->tgid;
	__u64 *ep, pc, sp;

	if (unwind_disabled)
		return 0;
	out = bpf_map_lookup_elem(&stack_scratch, &zero);
	ep = bpf_map_lookup_elem(&unwind_epoch, &zero);
	if (!out || !ep || !*ep || !bpf_map_lookup_elem(&unwind_procs, &tgid))
		return 0;
	st = bpf_map_lookup_elem(&unwind_chain, &zero);
	win = bpf_map_lookup_elem(&unwind_win, &zero);
	if (!st || !win)
		return 0;
	win->len = 0; /* nothing of this stack read yet */
	win->floor = r->sp;
	win->top = 0; /* (no task pointer before 5.11: mm->start_stack unknown) */
	if (ret_at >= 0) {
		__u64 ra = r->sp + ret_at;
		if (mt_uread16_fast(win, ra, &p) || !p.a)
			return 0;
		pc = p.a;
		sp = ra + 8;
		st->exact_pc = 0;
	} else {
		pc = r->ip;
		sp = r->sp;
		st->exact_pc = 1;
	}
	out->ips[0] = pc;
	st->n = 1;
	st->h = mt_hash_step(MT_HASH_SEED, pc);
	st->pc = pc;
	st->sp = sp;
	st->bp = r->bp;
	st->bp_lost = 0;
	st->frames_fp = 0;
	st->reason = 0;
	st->hops = 0;
	st->tgid = tgid;
	st->pid_tgid = bpf_get_current_pid_tgid();
	st->probe_sp = r->sp;
	st->role = role;
	st->kind = kind;
	st->state = MT_CHAIN_WALKING;
	return st;
}

static __attribute__((noinline)) int mt_chain_start(void *ctx, const struct mt_uregs *r, int ret_at,
						     __u32 role)
{
	struct mt_chain *st;

	if (!ctx || !r)
		return 0;
	st = mt_chain_stage(r, ret_at, role, MT_CHAIN_ALLOC);
	if (!st)
		return 0;
	bpf_tail_call(ctx, &unwind_chain_progs, MT_CHAIN_WALKER);
	st->state = MT_CHAIN_IDLE; /* (the walker is not in the array: frame pointers) */
	return mt_chain_not_started();
}

/* mmap's exit (sys_exit_mmap): the same, with the call's arguments kept
 * for the resumed program (its sysargs entry is taken already). */
static __attribute__((noinline)) int mt_chain_start_mmap(void *ctx, const struct mt_uregs *r,
							  const struct mt_sysargs *args, __u64 ret)
{
	struct mt_chain *st;

	if (!ctx || !r || !args)
		return 0;
	st = mt_chain_stage(r, MT_RET_UNKNOWN, 0, MT_CHAIN_MMAP);
	if (!st)
		return 0;
	st->args = *args;
	st->ret = ret;
	bpf_tail_call(ctx, &unwind_chain_progs_tp, MT_CHAIN_MMAP_WALKER);
	st->state = MT_CHAIN_IDLE;
	return mt_chain_not_started();
}

/* c's frame state from st: loads from map memory, numbers unknown to the
 * verifier, so that every frame step starts from one state whatever path
 * the step before took (kept on the stack, its constants -- bp_lost,
 * frames_fp -- made the paths of each step multiply those of the next:
 * 733k instructions for 5 steps, against 58k for one). */
static __always_inline void mt_chain_load(struct mt_unwind_ctx *c, const struct mt_chain *st)
{
	asm volatile("" ::: "memory"); /* loads, not the values clang knows it stored */
	c->pc = st->pc;
	c->sp = st->sp;
	c->bp = st->bp;
	c->h = st->h;
	c->n = st->n;
	c->exact_pc = st->exact_pc;
	c->bp_lost = st->bp_lost;
	c->frames_fp = st->frames_fp;
	c->reason = st->reason;
}

static __always_inline void mt_chain_store(struct mt_chain *st, const struct mt_unwind_ctx *c)
{
	st->pc = c->pc;
	st->sp = c->sp;
	st->bp = c->bp;
	st->h = c->h;
	st->n = c->n;
	st->exact_pc = c->exact_pc;
	st->bp_lost = c->bp_lost;
	st->frames_fp = c->frames_fp;
	st->reason = c->reason;
}

/* MT_CHAIN_STEPS frames from st's, into stack_scratch. */
static __always_inline void mt_chain_steps(struct mt_chain *st)
{
	struct mt_unwind_ctx c = {};
	__u32 zero = 0, tgid = st->tgid;

	c.rc = bpf_map_lookup_elem(&unwind_rc, &zero);
	c.win = bpf_map_lookup_elem(&unwind_win, &zero);
	c.out = bpf_map_lookup_elem(&stack_scratch, &zero);
	c.proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
	if (!c.rc || !c.win || !c.out || !c.proc) {
		st->reason = MT_UC_TRUNC_NO_TABLE; /* (tables removed: the process is gone) */
		return;
	}
	c.gen = c.proc->gen;
	c.me = 0; /* no memo */
	for (int i = 0; i < MT_CHAIN_STEPS; i++) {
		long end;

		mt_chain_load(&c, st);
		end = mt_unwind_step(&c);
		mt_chain_store(st, &c);
		if (end)
			break;
	}
}

/* The walk is over: stack_scratch's nr and id, the counters; the flags. */
static __always_inline __u32 mt_chain_finish(struct mt_chain *st)
{
	struct mt_stack *s;
	__u32 zero = 0, n = st->n > MT_MAX_FRAMES ? MT_MAX_FRAMES : st->n;

	s = bpf_map_lookup_elem(&stack_scratch, &zero);
	if (!s)
		return MT_F_NO_STACK;
	s->nr = n;
	s->stack_id = st->h ? st->h : 1;
	return mt_unwind_done(n, st->frames_fp, st->reason ? st->reason : MT_UC_TRUNC_DEPTH);
}

/* One run of a walker program: 1 when it is to run again (hops left),
 * else the stack is done (its flags in st). */
static __always_inline int mt_chain_run(struct mt_chain *st)
{
	mt_chain_steps(st);
	if (!st->reason && st->hops < MT_CHAIN_HOPS) {
		st->hops++;
		return 1;
	}
	st->flags = mt_chain_finish(st);
	st->state = MT_CHAIN_DONE;
	return 0;
}

#endif /* MT_UNWIND_CHAIN_BPF_H */
