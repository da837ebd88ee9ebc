// SPDX-License-Identifier: GPL-2.0
/* memtrace-bpf kernel side: allocator uprobes, mmap-family syscall
 * tracepoints, process lifecycle. Records go to ring buffers whose layouts
 * are in memtrace.h (the contract with src/loader).
 *
 * Attach model (DESIGN.md): allocator uprobes are attached per process by the
 * loader (with the PID), so that no other process pays for them. A process
 * that exec's or forks under tracing is stopped here (SIGSTOP, before it runs
 * a user instruction) until the loader has attached its probes; the loader
 * sends SIGCONT.
 *
 * Two builds of this file (bpf/CMakeLists.txt), chosen at load time from the
 * kernel's features (src/loader/kernel_features.h): the full one, and with
 * -DMT_COMPAT one for kernels before 5.17 (5.10 .. 5.16) that uses none of
 * bpf_loop, bpf_find_vma, BPF cookies, task storage, bpf_get_current_task_btf
 * or bpf_task_pt_regs: one entry program per allocator role, in-flight calls
 * in a tid-keyed hash, frame-pointer stacks, faults without the VMA check.
 * Both define the same maps, programs and read-only variables in the same
 * order (the loader opens either through one skeleton). */
#include "vmlinux.h"

#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "memtrace.h"

char LICENSE[] SEC("license") = "GPL";

#define SIGSTOP 19
#define PROT_EXEC 0x4
#define CLONE_VM 0x100

/* Set by the loader before load (STYLE.md #3). */
const volatile __u32 self_pid = 0;
const volatile bool capture_stacks = true;
const volatile bool system_wide = false;	/* no target filter (all but self) */
const volatile bool stop_on_exec_mappings = true; /* pause pending processes at exec mappings */
const volatile __u32 ncomms = 0;
const volatile char comms[MT_MAX_COMMS][MT_COMM_LEN] = {};
const volatile __u64 wakeup_bytes = 1 << 20;	/* wake the loader once this much is queued */

/* Set by the loader when tracing ends, before it detaches: an allocator
 * entry from then on starts no record. Detaching a file's return probes can
 * finish before its entry probes (they are closed in parallel, and each takes
 * long on a file many processes map); without this every call between the
 * two counted as a missed return. Calls entered before still complete. */
volatile bool tracing_stopped = false;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 20); /* resized by the loader */
} events SEC(".maps");

/* Lifecycle records (exec/fork/exit/libmap) get their own ring so that a
 * flood of allocation events can never make the loader miss a stopped
 * process it must resume. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} proc_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tgid */
	__type(value, struct mt_target);
} targets SEC(".maps");

#ifndef MT_COMPAT
/* The allocator call in flight on a thread: task local storage (one
 * pointer-chase from the task, no hashing, freed with the task) rather than
 * a tid-keyed hash (W1: the hash update at entry alone cost ~130 ns per
 * allocation). */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct mt_inflight);
} inflight SEC(".maps");

typedef struct task_struct *mt_task_t;
static __always_inline mt_task_t current_task(void) { return bpf_get_current_task_btf(); }

static __always_inline struct mt_inflight *inflight_of(mt_task_t task, __u64 create)
{
	return bpf_task_storage_get(&inflight, task, 0, create);
}

/* bpf_get_current_pid_tgid() from a task pointer the program has anyway:
 * two loads instead of a helper call (each call returns through the
 * kernel's return thunk; the allocator probes made four per allocation). */
static __always_inline __u64 task_pid_tgid(mt_task_t t)
{
	return (__u64)(__u32)t->tgid << 32 | (__u32)t->pid;
}

/* Where the main thread's stack starts (the CFI walk's upper bound): direct
 * BTF loads from the task the program has. */
static __always_inline __u64 task_start_stack(mt_task_t t)
{
	struct mm_struct *mm = t->mm;
	return mm ? mm->start_stack : 0;
}
#else
/* No task storage in tracing programs before 5.11: a hash keyed by tid,
 * preallocated (no allocation in the probe), its entry deleted when the
 * thread exits (mt_exit). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct mt_inflight);
} inflight SEC(".maps");

typedef void *mt_task_t; /* unused: no BTF task pointer before 5.11 */
static __always_inline mt_task_t current_task(void) { return 0; }

static __always_inline struct mt_inflight *inflight_of(mt_task_t task, __u64 create)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct mt_inflight *cur = bpf_map_lookup_elem(&inflight, &tid);
	if (!cur && create) {
		struct mt_inflight zero = {};
		bpf_map_update_elem(&inflight, &tid, &zero, BPF_NOEXIST);
		cur = bpf_map_lookup_elem(&inflight, &tid);
	}
	return cur;
}

static __always_inline __u64 task_pid_tgid(mt_task_t t) { return bpf_get_current_pid_tgid(); }
static __always_inline __u64 task_start_stack(mt_task_t t) { return 0; } /* (no CFI walk) */
#endif

static __always_inline struct mt_inflight *inflight_get(__u64 create)
{
	return inflight_of(current_task(), create);
}

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tid */
	__type(value, struct mt_sysargs);
} sysargs SEC(".maps");

/* Stacks already sent to the loader. LRU: an evicted stack is sent again,
 * which is harmless (the loader keeps every stack it has seen). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 17);
	__type(key, __u64);
	__type(value, __u8);
} stacks_seen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_stack);
} stack_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MT_C_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* In front of stacks_seen (per CPU, direct-mapped by id): ids this CPU
 * recently found in stacks_seen or sent. A hit skips the LRU hash lookup;
 * it only ever holds ids the loader has received, so it cannot make a
 * stack go missing (a miss just asks stacks_seen). */
#define MT_SENT_CACHE_ENTRIES 4096 /* power of 2 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MT_SENT_CACHE_ENTRIES);
	__type(key, __u32);
	__type(value, __u64);
} stacks_sent_cache SEC(".maps");

/* Every process this program stopped that the loader has not resumed yet
 * (tgid -> 1), and one flag the loader's guardian sets when the loader is
 * gone (src/loader/guardian.h): from then on no process is stopped, and the
 * guardian resumes those in `stopped`. A process is stopped only once it is
 * in this map, so that whatever happens to the loader (SIGKILL, OOM), none
 * stays stopped. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u32);
} stopped SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} loader_gone SEC(".maps");

#include "stack.bpf.h"

static __always_inline void count(__u32 c)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &c);
	if (v)
		*v += 1;
}

static __always_inline __u64 rb_flags(void)
{
	/* Adaptive wake-up: the loader polls with a short timeout anyway; only
	 * wake it when a good batch is waiting. (Asked for every record: asking
	 * once every 64 records of a CPU saved ~7 ns a record but, on 5.10
	 * under load, let the ring fill: Tracing.EightThreads... dropped 100k
	 * events after a system-wide run.) */
	return bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= wakeup_bytes ? BPF_RB_FORCE_WAKEUP
									    : BPF_RB_NO_WAKEUP;
}

static __always_inline bool traced(__u32 tgid)
{
	if (tgid == self_pid)
		return false;
	if (system_wide)
		return true;
	return bpf_map_lookup_elem(&targets, &tgid) != NULL;
}

static __always_inline void fill_hdr(struct mt_hdr *h, __u32 kind, __u32 flags, __u64 pid_tgid)
{
	h->kind = kind;
	h->flags = flags;
	h->pid = pid_tgid >> 32;
	h->tid = (__u32)pid_tgid;
	h->ts = bpf_ktime_get_ns();
}

/* Capture the current user stack, send it once, return its id (0: none). */
static __always_inline __u64 take_stack(const struct mt_uregs *r, int ret_at, __u32 *flags,
					__u64 pid_tgid)
{
	__u32 zero = 0;
	struct mt_stack *s;
	__u64 id, *sent;
	__u32 slot, nr;
	__u8 one = 1;

	if (!capture_stacks) {
		*flags |= MT_F_NO_STACK;
		return 0;
	}
	s = bpf_map_lookup_elem(&stack_scratch, &zero);
	if (!s)
		return 0;
	*flags |= mt_capture_stack(r, ret_at, s);
	if (*flags & MT_F_STACK_TRUNCATED)
		count(MT_C_STACK_TRUNCATED);
	if (s->nr == 0) {
		count(MT_C_STACK_EMPTY);
		return 0;
	}
	id = s->stack_id;
	slot = (__u32)id & (MT_SENT_CACHE_ENTRIES - 1);
	sent = bpf_map_lookup_elem(&stacks_sent_cache, &slot);
	if (sent && *sent == id)
		return id;
	if (bpf_map_lookup_elem(&stacks_seen, &id)) {
		if (sent)
			*sent = id;
		return id;
	}
	fill_hdr(&s->h, MT_EV_STACK, *flags, pid_tgid);
	s->stack_id = id;
	/* The header and the frames used, not the whole scratch record: most
	 * stacks are far shorter than MT_MAX_FRAMES. */
	nr = s->nr;
	if (nr > MT_MAX_FRAMES)
		nr = MT_MAX_FRAMES;
	if (bpf_ringbuf_output(&events, s, MT_STACK_BYTES(nr), rb_flags())) {
		count(MT_C_STACK_RINGBUF_FULL);
		*flags |= MT_F_NO_STACK;
		return 0;
	}
	bpf_map_update_elem(&stacks_seen, &id, &one, BPF_ANY);
	if (sent)
		*sent = id;
	return id;
}

static __always_inline void emit(__u32 kind, __u32 flags, __u64 pid_tgid, __u64 addr, __u64 size,
				 __u64 old_addr, __u64 old_size, __u64 stack_id, __u32 role, __u32 aux)
{
	struct mt_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count(MT_C_RINGBUF_FULL);
		return;
	}
	fill_hdr(&e->h, kind, flags, pid_tgid);
	e->addr = addr;
	e->size = size;
	e->old_addr = old_addr;
	e->old_size = old_size;
	e->stack_id = stack_id;
	e->role = role;
	e->aux = aux;
	bpf_ringbuf_submit(e, rb_flags());
}

static __always_inline __u64 mul_sat(__u64 a, __u64 b)
{
	__u64 q;
	if (!a || !b || ((a | b) >> 32) == 0)
		return a * b;
	q = ~0ULL / a;
	asm volatile("" : "+r"(q)); /* keep clang from turning this into a 128-bit multiply */
	return b > q ? ~0ULL : a * b;
}

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

	if (system_wide)
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

static __always_inline int alloc_enter(struct pt_regs *ctx, __u32 role, int ret_at, __u64 cookie)
{
	mt_task_t task = current_task();
	__u64 pid_tgid = task_pid_tgid(task);
	__u64 sp = PT_REGS_SP(ctx);
	struct mt_inflight *cur, rec = {};
	__u32 flags = 0;

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
			if (role != MT_ROLE_FREE && role != MT_ROLE_ALIGNED_NEW)
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

	if (role == MT_ROLE_FREE) {
		__u64 ptr = PT_REGS_PARM1(ctx);
		if (ptr) /* free(NULL) is not a free */
			emit(MT_EV_FREE, 0, pid_tgid, ptr, 0, 0, 0, 0, role, 0);
		if (cur) {
			cur->depth = 0;
			cur->role = MT_ROLE_FREE; /* an operator new's mark is for the next call only */
		}
		return 0;
	}

	if (!cur) {
		/* no task storage: the allocation cannot be paired with its
		 * return (counted); realloc's old block still dies */
		count(MT_C_INFLIGHT_FULL);
		if ((role == MT_ROLE_REALLOC || role == MT_ROLE_REALLOCARRAY) && PT_REGS_PARM1(ctx))
			emit(MT_EV_FREE, MT_F_NO_STACK, pid_tgid, PT_REGS_PARM1(ctx), 0, 0, 0, 0, role, 0);
		return 0;
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
		rec.stack_id = take_stack(&r, ret_at, &flags, pid_tgid);
	}
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
	if ((role == MT_ROLE_REALLOC || role == MT_ROLE_REALLOCARRAY) && rec.arg0)
		emit(MT_EV_FREE, flags, pid_tgid, rec.arg0, 0, 0, 0, rec.stack_id, role, 0);

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
_Static_assert(MT_ROLE_COUNT == 11, "one mt_alloc_enter_R per role");
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

	switch (role) {
	case MT_ROLE_REALLOC:
	case MT_ROLE_REALLOCARRAY:
		size = cur->arg1;
		if (cur->arg0 && !ret) {
			/* realloc(p, 0) frees p (already emitted); realloc(p, n)
			 * that fails leaves p alive. */
			if (size)
				emit(MT_EV_REALLOC_FAIL, cur->flags, pid_tgid, cur->arg0, size, 0, 0,
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
		emit(MT_EV_ALLOC_FAIL, cur->flags, pid_tgid, 0, size, 0, 0, cur->stack_id, role, 0);
		return 0;
	}
	emit(MT_EV_ALLOC, cur->flags, pid_tgid, addr, size,
	     (role == MT_ROLE_REALLOC || role == MT_ROLE_REALLOCARRAY) ? cur->arg0 : 0, 0,
	     cur->stack_id, role, 0);
	return 0;
}

/* ------------------------------------------------------------------------
 * mmap family. "Internal" = issued while an allocator call is in flight on
 * the same thread (seed 001 needed mmapmatch.sh for this).
 * ---------------------------------------------------------------------- */

static __always_inline __u32 in_allocator(__u32 tid)
{
	struct mt_inflight *cur = inflight_get(0);
	return cur && cur->depth > 0;
}

static __always_inline void save_args(__u64 pid_tgid, __u64 a0, __u64 a1, __u64 a2, __u64 a3)
{
	__u32 tid = (__u32)pid_tgid;
	struct mt_sysargs a = {.a0 = a0, .a1 = a1, .a2 = a2, .a3 = a3};
	a.internal = in_allocator(tid);
	if (bpf_map_update_elem(&sysargs, &tid, &a, BPF_ANY))
		count(MT_C_SYSARGS_FULL);
}

/* The arguments the entry tracepoint saved for this thread, taken. */
static __always_inline bool take_args(__u32 tid, struct mt_sysargs *out)
{
	struct mt_sysargs *a = bpf_map_lookup_elem(&sysargs, &tid);

	if (!a)
		return false;
	*out = *a;
	bpf_map_delete_elem(&sysargs, &tid);
	return true;
}

static __always_inline struct mt_uregs user_regs(__u64 pid_tgid)
{
#ifndef MT_COMPAT
	struct task_struct *t = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(t);
#else
	/* No bpf_task_pt_regs before 5.15: task_pt_regs(), the top of the
	 * task's kernel stack (THREAD_SIZE 16 KiB: kernels without KASAN), on
	 * x86-64 and arm64 alike. */
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();
	struct pt_regs *regs = (struct pt_regs *)((char *)BPF_CORE_READ(t, stack) + 16384) - 1;
#endif
	struct mt_uregs r = {.ip = PT_REGS_IP_CORE(regs),
			     .sp = PT_REGS_SP_CORE(regs),
			     .bp = PT_REGS_FP_CORE(regs),
			     .tgid = pid_tgid >> 32,
#ifndef MT_COMPAT
			     .start_stack = task_start_stack(t),
#endif
#ifdef __TARGET_ARCH_arm64
			     /* x30: the CFI walk's first return address in a leaf or a .plt stub */
			     .lr = PT_REGS_RET_CORE(regs),
#endif
	};
	return r;
}

SEC("tracepoint/syscalls/sys_enter_mmap")
int mt_enter_mmap(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid >> 32))
		return 0;
	/* len, prot, flags, fd; the offset (pages) for MT_EV_MAPFILE */
	save_args(pid_tgid, ctx->args[1], ctx->args[2], ctx->args[3], ctx->args[4]);
	if (system_wide) {
		__u32 tid = (__u32)pid_tgid;
		struct mt_sysargs *a = bpf_map_lookup_elem(&sysargs, &tid);
		if (a)
			a->pgoff_pages = ctx->args[5] >> 12;
	}
	return 0;
}

static __always_inline void stop_current(__u32 *flags, __u32 tgid)
{
	__u32 zero = 0, one = 1;
	__u32 *gone = bpf_map_lookup_elem(&loader_gone, &zero);

	if (!gone || *gone)
		return; /* nobody left to resume it */
	if (bpf_map_update_elem(&stopped, &tgid, &one, BPF_ANY)) {
		count(MT_C_SIGNAL_FAIL);
		return;
	}
	if (bpf_send_signal(SIGSTOP) == 0) {
		*flags |= MT_F_STOPPED;
	} else {
		bpf_map_delete_elem(&stopped, &tgid);
		count(MT_C_SIGNAL_FAIL);
	}
}

static __always_inline void proc_event(__u32 kind, __u32 flags, __u64 pid_tgid, __u32 ppid,
				       __s32 code, __u64 addr, __u64 len)
{
	struct mt_proc_event *e = bpf_ringbuf_reserve(&proc_events, sizeof(*e), 0);
	if (!e) {
		/* Never stop a process the loader would not hear about. */
		count(MT_C_RINGBUF_FULL);
		return;
	}
	if (flags & MT_F_STOPPED) {
		flags &= ~MT_F_STOPPED;
		stop_current(&flags, pid_tgid >> 32);
	}
	fill_hdr(&e->h, kind, flags, pid_tgid);
	e->ppid = ppid;
	e->exit_code = code;
	e->addr = addr;
	e->len = len;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bpf_ringbuf_submit(e, 0);
}

/* MT_EV_MAPFILE of an executable file mapping of the current task
 * (system-wide: the loader may never read this process's maps). The file
 * is fd's; a record that does not fit is counted as a lost lifecycle one. */
static __always_inline struct mt_map_event *map_event_reserve(__u64 pid_tgid, struct file *f, __u32 size)
{
	struct mt_map_event *e;

	if (!f)
		return 0;
	e = bpf_ringbuf_reserve(&proc_events, size, 0);
	if (!e) {
		count(MT_C_RINGBUF_FULL);
		return 0;
	}
	fill_hdr(&e->h, MT_EV_MAPFILE, 0, pid_tgid);
	e->ino = BPF_CORE_READ(f, f_inode, i_ino);
	e->dev = BPF_CORE_READ(f, f_inode, i_sb, s_dev);
	return e;
}

static __always_inline void map_event_lib(__u64 pid_tgid, __u64 start, __u64 len, __u64 pgoff, __s32 fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct file **fds = BPF_CORE_READ(task, files, fdt, fd);
	__u32 max = BPF_CORE_READ(task, files, fdt, max_fds);
	struct file *f = 0;
	struct mt_map_event *e;

	if (fd < 0 || (__u32)fd >= max || bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]))
		return;
	e = map_event_reserve(pid_tgid, f, MT_MAP_EVENT_LIB_BYTES); /* the name only, no path */
	if (!e)
		return;
	e->start = start;
	e->end = start + len;
	e->pgoff = pgoff;
	e->is_exe = 0;
	/* The file's own name (its dentry's: a symlink's target's), for a
	 * library that no process the loader reads maps (cut at 47 bytes). */
	if (bpf_probe_read_kernel_str(e->path, MT_MAP_NAME_LEN, BPF_CORE_READ(f, f_path.dentry, d_name.name)) < 0)
		e->path[0] = 0;
	bpf_ringbuf_submit(e, 0);
}

/* The end of a traced mmap: the record, and for executable file mappings the
 * loader told (system-wide) or the process stopped for it. Shared by the
 * system-call tracepoint and the fexit program. */
static __always_inline void mmap_done(__u64 pid_tgid, __u64 ret, struct mt_sysargs args)
{
	__u32 tgid = pid_tgid >> 32;
	__u32 flags = 0;
	__u64 stack_id = 0;

	if (ret >= (__u64)-4095)
		return;
	if (args.internal)
		flags |= MT_F_ALLOCATOR_INTERNAL;
	else if (!((__s32)args.a3 >= 0) || /* anonymous direct mapping: keep its stack */
		 !(args.a1 & PROT_EXEC)) {
		struct mt_uregs r = user_regs(pid_tgid);
		stack_id = take_stack(&r, MT_RET_UNKNOWN, &flags, pid_tgid);
	}
	emit(MT_EV_MMAP, flags, pid_tgid, ret, args.a0, 0, (args.a1 << 32) | (args.a2 & 0xffffffff),
	     stack_id, 0, (__u32)args.a3);

	/* A process mapped executable code (its allocator, or a dlopen'd
	 * library): stop it so that the loader attaches, reads the mapping for
	 * symbolization and loads its unwind tables before that code runs, even
	 * if the process exits right after. Not processes given by -p. */
	if (system_wide && (args.a1 & PROT_EXEC) && (__s32)args.a3 >= 0) {
		/* System-wide: never stopped, but told at once through the small
		 * lifecycle ring (drained first, woken at every record) so that the
		 * loader reads the mappings while the process lives, not when the
		 * events ring's backlog reaches this record (a short process was
		 * gone by then: its frames stayed unsymbolized). */
		map_event_lib(pid_tgid, ret, args.a0, (__u64)args.pgoff_pages << 12, (__s32)args.a3);
		proc_event(MT_EV_LIBMAP, 0, pid_tgid, 0, 0, ret, args.a0);
	} else if (stop_on_exec_mappings && (args.a1 & PROT_EXEC) && (__s32)args.a3 >= 0) {
		struct mt_target *t = bpf_map_lookup_elem(&targets, &tgid);
		if (t && (t->state == MT_TS_PENDING ||
			  (t->state == MT_TS_TRACED && !(t->follow & MT_FOLLOW_NO_STOP))))
			proc_event(MT_EV_LIBMAP, MT_F_STOPPED, pid_tgid, 0, 0, ret, args.a0);
	}
}

SEC("tracepoint/syscalls/sys_exit_mmap")
int mt_exit_mmap(struct trace_event_raw_sys_exit *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mt_sysargs args;

	if (take_args((__u32)pid_tgid, &args))
		mmap_done(pid_tgid, ctx->ret, args);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_munmap")
int mt_enter_munmap(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid >> 32))
		return 0;
	emit(MT_EV_MUNMAP, in_allocator((__u32)pid_tgid) ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid,
	     ctx->args[0], ctx->args[1], 0, 0, 0, 0, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_mremap")
int mt_enter_mremap(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid >> 32))
		return 0;
	/* old addr, old len, new len, flags */
	save_args(pid_tgid, ctx->args[0], ctx->args[1], ctx->args[2], ctx->args[3]);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_mremap")
int mt_exit_mremap(struct trace_event_raw_sys_exit *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u64 ret = ctx->ret;
	struct mt_sysargs args;

	if (!take_args((__u32)pid_tgid, &args) || ret >= (__u64)-4095)
		return 0;
	emit(MT_EV_MREMAP, args.internal ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid, ret, args.a2,
	     args.a0, args.a1, 0, 0, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_brk")
int mt_enter_brk(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid >> 32))
		return 0;
	save_args(pid_tgid, ctx->args[0], 0, 0, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_brk")
int mt_exit_brk(struct trace_event_raw_sys_exit *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mt_sysargs args;

	if (!take_args((__u32)pid_tgid, &args))
		return 0;
	emit(MT_EV_BRK, args.internal ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid, ctx->ret, args.a0, 0,
	     0, 0, 0, 0);
	return 0;
}

/* ------------------------------------------------------------------------
 * The same four system calls on fentry/fexit of their functions, loaded
 * instead of the tracepoints above where the kernel allows (the loader's
 * KernelFeatures::syscall_fexit). While any syscalls:* tracepoint is attached
 * every system call of every task takes the kernel's slow path
 * (TIF_SYSCALL_TRACEPOINT): 40 ns more on each here, and on 6.11+ each traced
 * allocator call's return is a system call (the uretprobe trampoline). One
 * fexit also replaces an enter/exit pair and its sysargs entry: the
 * arguments are still in the saved registers when the function returns.
 * ---------------------------------------------------------------------- */
#ifdef __TARGET_ARCH_arm64
#define MT_SYS(name) "__arm64_sys_" #name
#define SYS_A0(r) ((r)->orig_x0) /* x0 is the return value's register */
#define SYS_A1(r) ((r)->regs[1])
#define SYS_A2(r) ((r)->regs[2])
#define SYS_A3(r) ((r)->regs[3])
#define SYS_A4(r) ((r)->regs[4])
#define SYS_A5(r) ((r)->regs[5])
#else
#define MT_SYS(name) "__x64_sys_" #name
#define SYS_A0(r) ((r)->di)
#define SYS_A1(r) ((r)->si)
#define SYS_A2(r) ((r)->dx)
#define SYS_A3(r) ((r)->r10)
#define SYS_A4(r) ((r)->r8)
#define SYS_A5(r) ((r)->r9)
#endif

SEC("?fexit/" MT_SYS(mmap))
int BPF_PROG(mt_fexit_mmap, const struct pt_regs *regs, long ret)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!traced(pid_tgid >> 32))
		return 0;
	/* len, prot, flags, fd; the offset (pages) for MT_EV_MAPFILE */
	struct mt_sysargs a = {.a0 = SYS_A1(regs), .a1 = SYS_A2(regs), .a2 = SYS_A3(regs), .a3 = SYS_A4(regs),
			       .internal = in_allocator((__u32)pid_tgid)};
	if (system_wide)
		a.pgoff_pages = SYS_A5(regs) >> 12;
	mmap_done(pid_tgid, ret, a);
	return 0;
}

SEC("?fentry/" MT_SYS(munmap))
int BPF_PROG(mt_fentry_munmap, const struct pt_regs *regs)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	/* Before the unmap, as the tracepoint: no mapping another thread gets
	 * at this address can be recorded before this record. */
	if (!traced(pid_tgid >> 32))
		return 0;
	emit(MT_EV_MUNMAP, in_allocator((__u32)pid_tgid) ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid,
	     SYS_A0(regs), SYS_A1(regs), 0, 0, 0, 0, 0);
	return 0;
}

SEC("?fexit/" MT_SYS(mremap))
int BPF_PROG(mt_fexit_mremap, const struct pt_regs *regs, long ret)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!traced(pid_tgid >> 32) || (__u64)ret >= (__u64)-4095)
		return 0;
	/* new address, new len, old addr, old len */
	emit(MT_EV_MREMAP, in_allocator((__u32)pid_tgid) ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid, ret,
	     SYS_A2(regs), SYS_A0(regs), SYS_A1(regs), 0, 0, 0);
	return 0;
}

SEC("?fexit/" MT_SYS(brk))
int BPF_PROG(mt_fexit_brk, const struct pt_regs *regs, long ret)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!traced(pid_tgid >> 32))
		return 0;
	emit(MT_EV_BRK, in_allocator((__u32)pid_tgid) ? MT_F_ALLOCATOR_INTERNAL : 0, pid_tgid, ret,
	     SYS_A0(regs), 0, 0, 0, 0, 0);
	return 0;
}

/* ------------------------------------------------------------------------
 * Process lifecycle: exec, fork, exit.
 * ---------------------------------------------------------------------- */

static __always_inline bool comm_matches(void)
{
	char c[MT_COMM_LEN] = {};
	bpf_get_current_comm(c, sizeof(c));
	for (int i = 0; i < MT_MAX_COMMS; i++) {
		if (i >= ncomms)
			break;
		bool eq = true;
		for (int j = 0; j < MT_COMM_LEN; j++) {
			if (c[j] != comms[i][j]) {
				eq = false;
				break;
			}
			if (c[j] == 0)
				break;
		}
		if (eq)
			return true;
	}
	return false;
}

/* MT_EV_MAPFILE of the program an exec starts (system-wide): its code's
 * range (mm's start_code: the first executable PT_LOAD's address), the
 * file really executed (a script's interpreter), and in pgoff the
 * interpreter's (ld.so's) load address from the auxiliary vector. */
#define MT_AUXV_PAIRS 32
static __always_inline void map_event_exe(__u64 pid_tgid, struct task_struct *p, struct linux_binprm *bprm)
{
	struct mm_struct *mm = BPF_CORE_READ(p, mm);
	struct mt_map_event *e;
	__u64 base = 0;

	if (!mm)
		return;
	e = map_event_reserve(pid_tgid, BPF_CORE_READ(bprm, file), sizeof(*e));
	if (!e)
		return;
	e->start = BPF_CORE_READ(mm, start_code);
	e->end = BPF_CORE_READ(mm, end_code);
	e->is_exe = 1;
	for (int i = 0; i < MT_AUXV_PAIRS; i++) {
		unsigned long kv[2];
		if (bpf_probe_read_kernel(kv, sizeof(kv), (char *)mm +
					  bpf_core_field_offset(struct mm_struct, saved_auxv) + i * 16))
			break;
		if (kv[0] == 0) /* AT_NULL */
			break;
		if (kv[0] == 7) { /* AT_BASE */
			base = kv[1];
			break;
		}
	}
	e->pgoff = base;
	if (bpf_probe_read_kernel_str(e->path, sizeof(e->path), BPF_CORE_READ(bprm, interp)) < 0)
		e->path[0] = 0;
	bpf_ringbuf_submit(e, 0);
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(mt_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	struct mt_target *t;

	if (tgid == self_pid)
		return 0;
	/* The old image's unwind mappings describe an address space that is
	 * gone: until the loader publishes the new one, rows come through the
	 * new image's VMAs (bpf/unwind.bpf.h). */
	bpf_map_delete_elem(&unwind_procs, &tgid);
	bpf_map_delete_elem(&unwind_lazy_gen, &tgid);
	/* A call of the old image in flight (its return was never seen) ends
	 * with the image: not a missed return of the new one. */
	struct mt_inflight *cur = inflight_get(0);
	if (cur) {
		cur->depth = 0;
		cur->role = MT_ROLE_FREE; /* nor an aligned operator new's mark */
		cur->img_mm = 0; /* a later image may get this mm's address again */
	}
	/* Names this exec in both records (the events stream's and the
	 * lifecycle one) so that the loader starts one image for the two. */
	__u64 exec_id = bpf_ktime_get_ns();
	if (system_wide) {
		/* No stop system-wide: the loader only looks for new allocator objects. */
		emit(MT_EV_EXEC, 0, pid_tgid, exec_id, 0, 0, 0, 0, 0, 0);
		proc_event(MT_EV_EXEC, 0, pid_tgid, 0, 0, exec_id, 0);
		map_event_exe(pid_tgid, p, bprm);
		return 0;
	}
	t = bpf_map_lookup_elem(&targets, &tgid);
	if (t) {
		/* A traced process loaded a new image: its old probes are gone
		 * with its old mm. In comm mode the new image must match too. */
		if (ncomms && !t->follow && !comm_matches()) {
			bpf_map_delete_elem(&targets, &tgid);
			emit(MT_EV_EXEC, MT_F_EXEC_UNTRACED, pid_tgid, exec_id, 0, 0, 0, 0, 0, 0);
			proc_event(MT_EV_EXIT, 0, pid_tgid, 0, -1, 0, 0);
			return 0;
		}
		t->state = MT_TS_PENDING;
		t->image++;
	} else if (ncomms && comm_matches()) {
		struct mt_target nt = {.state = MT_TS_PENDING, .follow = 0};
		if (bpf_map_update_elem(&targets, &tgid, &nt, BPF_ANY))
			return 0;
	} else {
		return 0;
	}
	/* In the events stream too: every event of the old image is before
	 * this record, every event of the new one after it (one task). */
	emit(MT_EV_EXEC, 0, pid_tgid, exec_id, 0, 0, 0, 0, 0, 0);
	proc_event(MT_EV_EXEC, MT_F_STOPPED, pid_tgid, 0, 0, exec_id, 0);
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(mt_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 ptgid = BPF_CORE_READ(parent, tgid);
	__u32 ctgid = BPF_CORE_READ(child, tgid);
	struct mt_target *t;

	if (ptgid == ctgid) /* a thread */
		return 0;
	/* The fork in the parent's events stream, in the parent's context:
	 * after every event of the parent from before the fork, before any
	 * from after it and before any of the child (it is not running yet).
	 * The child starts with exactly the parent's live blocks here. */
	if (system_wide) {
		emit(MT_EV_FORK, 0, bpf_get_current_pid_tgid(), ctgid, 0, 0, 0, 0, 0, 0);
		return 0;
	}
	t = bpf_map_lookup_elem(&targets, &ptgid);
	if (!t)
		return 0;
	emit(MT_EV_FORK, 0, bpf_get_current_pid_tgid(), ctgid, 0, 0, 0, 0, 0, 0);
	/* -c: children keep the parent's comm, so they are followed as well. */
	struct mt_target nt = {.follow = t->follow};
	if (BPF_CORE_READ(child, mm) == BPF_CORE_READ(parent, mm))
		nt.state = MT_TS_SHARED_MM; /* vfork: runs on the parent's probes until exec */
	else
		nt.state = MT_TS_PENDING;
	bpf_map_update_elem(&targets, &ctgid, &nt, BPF_ANY);
	return 0;
}

/* The child's first return to user space (fork/clone in the child): stop it
 * before it runs anything, so that the loader attaches its own probes (a
 * per-process uprobe does not follow fork). Runs in the child. */
static __always_inline int child_starts(void)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct mt_target *t;

	if (tgid != tid)
		return 0;
	t = bpf_map_lookup_elem(&targets, &tgid);
	if (!t)
		return 0;
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	__u32 ppid = BPF_CORE_READ(task, real_parent, tgid);
	/* The program the loader launches: already marked PENDING by the loader
	 * before this first return; it waits for the loader and is stopped at
	 * its exec. */
	if (ppid == self_pid)
		return 0;
	if (t->state == MT_TS_SHARED_MM) {
		proc_event(MT_EV_FORK, MT_F_VFORK, pid_tgid, ppid, 0, 0, 0);
		return 0;
	}
	if (t->state != MT_TS_PENDING)
		return 0;
	proc_event(MT_EV_FORK, MT_F_STOPPED, pid_tgid, ppid, 0, 0, 0);
	return 0;
}

static __always_inline int child_returns(struct trace_event_raw_sys_exit *ctx)
{
	return ctx->ret == 0 ? child_starts() : 0; /* 0: in the child */
}

SEC("tracepoint/syscalls/sys_exit_clone")
int mt_exit_clone(struct trace_event_raw_sys_exit *ctx) { return child_returns(ctx); }
SEC("tracepoint/syscalls/sys_exit_clone3")
int mt_exit_clone3(struct trace_event_raw_sys_exit *ctx) { return child_returns(ctx); }
SEC("tracepoint/syscalls/sys_exit_fork")
int mt_exit_fork(struct trace_event_raw_sys_exit *ctx) { return child_returns(ctx); }
SEC("tracepoint/syscalls/sys_exit_vfork")
int mt_exit_vfork(struct trace_event_raw_sys_exit *ctx) { return child_returns(ctx); }

/* Without syscall tracepoints: every new task runs schedule_tail (from
 * ret_from_fork) before its first return to user space; its fexit runs in
 * the child with the runqueue lock released. Kernel threads and threads of a
 * process are not in targets or fail tgid == tid. */
SEC("?fexit/schedule_tail")
int BPF_PROG(mt_fexit_schedule_tail, struct task_struct *prev) { return child_starts(); }

/* sched_process_exit gained its group_dead argument after 6.12; the loader
 * sets this from the kernel's BTF (the tracepoint's prototype). Without it
 * the last thread of a group is the one that finds signal->live at 0 (do_exit
 * decrements it before the tracepoint); two threads exiting at once may both
 * see 0, so the first to claim (tgid, start time) in exits_seen reports. */
const volatile bool exit_has_group_dead = true;

struct mt_exit_key {
	__u32 tgid;
	__u32 pad;
	__u64 start_time; /* of the group leader: names the process, not the pid */
};
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct mt_exit_key);
	__type(value, __u8);
} exits_seen SEC(".maps");

static __always_inline bool group_exit(struct task_struct *task, __u64 *ctx)
{
	if (exit_has_group_dead)
		return ctx[1] != 0; /* read only where the argument exists */
	if (BPF_CORE_READ(task, signal, live.counter) != 0)
		return false;
	struct mt_exit_key k = {.tgid = BPF_CORE_READ(task, tgid),
				.start_time = BPF_CORE_READ(task, group_leader, start_time)};
	__u8 one = 1;
	return bpf_map_update_elem(&exits_seen, &k, &one, BPF_NOEXIST) == 0;
}

SEC("tp_btf/sched_process_exit")
int mt_exit(__u64 *ctx)
{
	struct task_struct *task = (struct task_struct *)ctx[0];
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid, tgid = pid_tgid >> 32;

	/* inflight (task storage) goes with the task */
	bpf_map_delete_elem(&sysargs, &tid);
#ifdef MT_COMPAT
	bpf_map_delete_elem(&inflight, &tid);
#endif
	if (tgid == self_pid)
		return 0;
	if (!system_wide && !bpf_map_lookup_elem(&targets, &tgid))
		return 0;
	if (!group_exit(task, ctx))
		return 0;
	bpf_map_delete_elem(&targets, &tgid);
	bpf_map_delete_elem(&unwind_lazy_gen, &tgid);
	struct signal_struct *sig = BPF_CORE_READ(task, signal);
	__s32 code = BPF_CORE_READ(task, exit_code);
	if (BPF_CORE_READ(sig, flags) & 0x4 /* SIGNAL_GROUP_EXIT */)
		code = BPF_CORE_READ(sig, group_exit_code);
	proc_event(MT_EV_EXIT, 0, pid_tgid, 0, code, 0, 0);
	return 0;
}

/* ------------------------------------------------------------------------
 * Page faults (--faults). The loader turns autoload off unless --faults is
 * given, so without it this program is not even loaded. It is a BTF-typed
 * (raw) tracepoint: no trace record is built for the event, the program is
 * called with the tracepoint's arguments, and the first thing it does is the
 * target lookup, so an untraced process pays one hash lookup per fault.
 * ---------------------------------------------------------------------- */

#define MT_PF_PROT 0x1
#define MT_PF_WRITE 0x2
#define MT_PF_INSTR 0x10
#define MT_VM_READ 0x1
#define MT_VM_WRITE 0x2
#define MT_VM_EXEC 0x4

/* The fault record, the same on every architecture. */
static __always_inline int emit_fault(__u64 pid_tgid, __u32 flags, __u64 address, __u64 ip,
				      __u64 error_code)
{
	struct mt_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);

	if (!e) {
		count(MT_C_FAULT_RINGBUF_FULL);
		return 0;
	}
	fill_hdr(&e->h, MT_EV_FAULT, flags, pid_tgid);
	e->addr = address;
	e->size = 0;
	e->old_addr = ip;
	e->old_size = error_code;
	e->stack_id = 0;
	e->role = 0;
	e->aux = 0;
	bpf_ringbuf_submit(e, rb_flags());
	return 0;
}

struct mt_vma_check {
	__u64 error_code;
	__u32 flags;
};

#if !defined(MT_COMPAT) && !defined(__TARGET_ARCH_arm64)
/* x86 access_error(): a write needs VM_WRITE; any other access needs the VMA
 * to be accessible at all (a read of a present page is a protection fault). */
static long mt_vma_cb(struct task_struct *task, struct vm_area_struct *vma, void *data)
{
	struct mt_vma_check *c = data;
	__u64 vm_flags = BPF_CORE_READ(vma, vm_flags);

	if (c->error_code & MT_PF_WRITE) {
		if (!(vm_flags & MT_VM_WRITE))
			c->flags |= MT_F_FAULT_ACCESS_ERR;
	} else if (c->error_code & MT_PF_INSTR) {
		if (!(vm_flags & MT_VM_EXEC))
			c->flags |= MT_F_FAULT_ACCESS_ERR;
	} else if (!(vm_flags & (MT_VM_READ | MT_VM_WRITE | MT_VM_EXEC))) {
		c->flags |= MT_F_FAULT_ACCESS_ERR;
	}
	return 0;
}
#endif

#ifdef __TARGET_ARCH_arm64
/* arm64 has no page_fault_user tracepoint, and its fault handler
 * (do_page_fault, __kprobes) and exception entry (noinstr) cannot be probed:
 * the hook is a kprobe on handle_mm_fault(vma, address, flags, regs), which
 * do_page_fault calls once the VMA is found and the access checked against it
 * (arch/arm64/mm/fault.c, 6.1 and 6.12 alike). Counted as x86's tracepoint
 * counts: once per user fault (exception), so the calls of a retry are left
 * out: FAULT_FLAG_TRIED marks every retry under the mmap lock, and since 6.4
 * a user fault is first tried under the VMA lock (FAULT_FLAG_VMA_LOCK) and,
 * when that returns VM_FAULT_RETRY, tried again under the mmap lock without
 * that flag (and without TRIED unless the first try was a major fault): the
 * thread's last VMA-locked address tells that second call apart. Faults
 * with no VMA or a forbidden access end in SIGSEGV before handle_mm_fault
 * and are not seen (x86 flags them); kernel accesses to user memory (no
 * FAULT_FLAG_USER: uaccess, GUP) are not user faults, as on x86. */
enum fault_flag___mt { FAULT_FLAG_VMA_LOCK___mt = 4096 }; /* 6.4+ */
/* A fault flag's value: from the kernel's enum fault_flag (5.17+), else its
 * #define of 5.10-5.16, which had the same values (include/linux/mm.h). */
#define MT_FAULT_FLAG(name, old) \
	(bpf_core_enum_value_exists(enum fault_flag, name) ? bpf_core_enum_value(enum fault_flag, name) : (old))

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);   /* tid */
	__type(value, __u64); /* address of its last VMA-locked try */
} fault_vma_locked SEC(".maps");

SEC("kprobe/handle_mm_fault")
int BPF_KPROBE(mt_page_fault, struct vm_area_struct *vma, unsigned long address, unsigned int flags,
	       struct pt_regs *regs)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	__u32 fflags = 0;
	__u64 error_code;

	if (!(flags & MT_FAULT_FLAG(FAULT_FLAG_USER, 0x40)))
		return 0;
	if (!system_wide) {
		if (!bpf_map_lookup_elem(&targets, &tgid))
			return 0;
	} else if (tgid == self_pid) {
		count(MT_C_FAULTS_FILTERED);
		return 0;
	}
	if (flags & MT_FAULT_FLAG(FAULT_FLAG_TRIED, 0x20)) {
		if (bpf_core_enum_value_exists(enum fault_flag___mt, FAULT_FLAG_VMA_LOCK___mt))
			bpf_map_delete_elem(&fault_vma_locked, &tid);
		return 0;
	}
	if (bpf_core_enum_value_exists(enum fault_flag___mt, FAULT_FLAG_VMA_LOCK___mt)) {
		__u32 vma_lock = bpf_core_enum_value(enum fault_flag___mt, FAULT_FLAG_VMA_LOCK___mt);

		if (flags & vma_lock) {
			__u64 a = address;

			bpf_map_update_elem(&fault_vma_locked, &tid, &a, BPF_ANY);
		} else {
			__u64 *last = bpf_map_lookup_elem(&fault_vma_locked, &tid);

			if (last && *last == address) {
				bpf_map_delete_elem(&fault_vma_locked, &tid);
				return 0; /* the same fault, retried under the mmap lock */
			}
		}
	}
	/* The record as on x86: its error-code bits (user 0x4, write 0x2,
	 * instruction fetch 0x10) made from the fault flags; present (0x1) is
	 * not known here. */
	error_code = 0x4;
	if (flags & MT_FAULT_FLAG(FAULT_FLAG_WRITE, 0x01)) {
		error_code |= MT_PF_WRITE;
		fflags |= MT_F_FAULT_WRITE;
	}
	if (flags & MT_FAULT_FLAG(FAULT_FLAG_INSTRUCTION, 0x100)) {
		error_code |= MT_PF_INSTR;
		fflags |= MT_F_FAULT_INSTR;
	}
	return emit_fault(pid_tgid, fflags, address, PT_REGS_IP_CORE(regs), error_code);
}
#else
SEC("tp_btf/page_fault_user")
int BPF_PROG(mt_page_fault, unsigned long address, struct pt_regs *regs, unsigned long error_code)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	struct mt_vma_check c = {.error_code = error_code};
	long err;

	if (!system_wide) {
		if (!bpf_map_lookup_elem(&targets, &tgid))
			return 0;
	} else if (tgid == self_pid) {
		count(MT_C_FAULTS_FILTERED);
		return 0;
	}
	if (error_code & MT_PF_WRITE)
		c.flags |= MT_F_FAULT_WRITE;
	if (error_code & MT_PF_INSTR)
		c.flags |= MT_F_FAULT_INSTR;
#ifndef MT_COMPAT
	err = bpf_find_vma(bpf_get_current_task_btf(), address, mt_vma_cb, &c, 0);
	if (err == -2 /* ENOENT */)
		c.flags |= MT_F_FAULT_NO_VMA;
	else if (err) {
		c.flags |= MT_F_FAULT_VMA_UNKNOWN;
		count(MT_C_FAULT_VMA_BUSY);
	}
#else
	/* No bpf_find_vma before 5.17: the access is not checked against its
	 * VMA (the loader refuses --rearm, which needs that check). */
	(void)err;
#endif
	return emit_fault(pid_tgid, c.flags, address, PT_REGS_IP_CORE(regs), error_code);
}
#endif /* __TARGET_ARCH_arm64 */
