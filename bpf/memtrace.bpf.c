// SPDX-License-Identifier: GPL-2.0
/* memtrace-bpf kernel side: allocator uprobes, mmap-family syscall
 * tracepoints, process lifecycle. Records go to ring buffers whose layouts
 * are in memtrace.h (the contract with src/loader). This file holds the
 * maps and what every program shares; the programs are in alloc.bpf.h,
 * mmap.bpf.h, proc.bpf.h and faults.bpf.h, included at its end.
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
 * in a tid-keyed hash, CFI stacks through a chain of tail calls
 * (unwind_chain.bpf.h; frame pointers on arm64), faults without the VMA check.
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
/* --cgroup: the cgroup v2 subtree's id and level (0: no cgroup filter) */
const volatile __u64 cgroup_id = 0;
const volatile __u32 cgroup_level = 0;
const volatile __u64 wakeup_bytes = 1 << 20;	/* wake the loader once this much is queued */
/* --sample-bytes N (issue 34): one allocation per N bytes on average is
 * recorded (0: every one), alloc.bpf.h's sampler. */
const volatile __u64 sample_bytes = 0;
const volatile __u32 sample_bucket_mask = 0;

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

/* System-wide: statically linked programs (no interpreter) whose file the
 * loader has looked at for an allocator, by the kernel's (dev, inode): the
 * first exec of any other is stopped until the loader attached the file's
 * probes (bpf/proc.bpf.h, mt_exec); those execs are not stopped again (the
 * probes, attached to the file, are in every mm that maps it). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct mt_file_key);
	__type(value, __u32);
} static_known SEC(".maps");

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

#include "python.bpf.h"

/* The stack captured in s: counted, sent once; its id (0: none). */
static __always_inline __u64 stack_send(struct mt_stack *s, __u32 *flags, __u64 pid_tgid)
{
	__u64 id, *sent;
	__u32 slot, nr, py_nr;
	__u8 one = 1;

	if (*flags & MT_F_STACK_TRUNCATED)
		count(MT_C_STACK_TRUNCATED);
	if (s->nr == 0) {
		count(MT_C_STACK_EMPTY);
		return 0;
	}
	id = mt_py_walk(s, pid_tgid >> 32, s->stack_id);
	slot = (__u32)id & (MT_SENT_CACHE_ENTRIES - 1);
	sent = bpf_map_lookup_elem(&stacks_sent_cache, &slot);
	if (sent && *sent == id)
		return id;
	if (bpf_map_lookup_elem(&stacks_seen, &id)) {
		if (sent)
			*sent = id;
		return id;
	}
	mt_py_send_codes(s, pid_tgid);
	fill_hdr(&s->h, MT_EV_STACK, *flags, pid_tgid);
	s->stack_id = id;
	/* The header and the frames used, not the whole scratch record: most
	 * stacks are far shorter than MT_MAX_FRAMES. */
	nr = s->nr;
	if (nr > MT_MAX_FRAMES)
		nr = MT_MAX_FRAMES;
	py_nr = s->py_nr;
	if (py_nr > MT_MAX_PY_FRAMES)
		py_nr = MT_MAX_PY_FRAMES;
	nr += 2 * py_nr; /* at most MT_STACK_SLOTS, bounds the verifier can follow */
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

/* Capture the current user stack, send it once, return its id (0: none). */
static __always_inline __u64 take_stack(const struct mt_uregs *r, int ret_at, __u32 *flags,
					__u64 pid_tgid)
{
	__u32 zero = 0;
	struct mt_stack *s;

	if (!capture_stacks) {
		*flags |= MT_F_NO_STACK;
		return 0;
	}
	s = bpf_map_lookup_elem(&stack_scratch, &zero);
	if (!s)
		return 0;
	*flags |= mt_capture_stack(r, ret_at, s);
	return stack_send(s, flags, pid_tgid);
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

/* The programs, by what they trace. */
#include "alloc.bpf.h"
#include "mmap.bpf.h"
#include "proc.bpf.h"
#include "faults.bpf.h"
