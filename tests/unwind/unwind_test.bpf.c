/* Test and bench harness for the unwinder: a uprobe on malloc of one process
 * captures the stack with mt_capture_stack (bpf/stack.bpf.h, exactly what
 * memtrace.bpf.c uses), counts allocations per distinct stack and sends each
 * distinct stack once. An mmap with PROT_EXEC of a file stops the process
 * (SIGSTOP) and tells user space to load the new file's table first. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "memtrace.h"

char LICENSE[] SEC("license") = "GPL";

const volatile __u32 target_tgid = 0;
const volatile __u64 mark_size = 0; /* 0: every malloc */

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} rb SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_stack);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 18);
	__type(key, __u64);
	__type(value, __u64);
} stack_counts SEC(".maps");

#include "stack.bpf.h"

SEC("uprobe")
int BPF_KPROBE(on_malloc, __u64 size)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 zero = 0, flags, nr;
	struct mt_stack *s;
	__u64 id, one = 1, *cnt;

	if ((pid_tgid >> 32) != target_tgid)
		return 0;
	if (mark_size && size != mark_size)
		return 0;
	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s)
		return 0;
	{
		struct task_struct *t = bpf_get_current_task_btf();
		struct mm_struct *mm = t->mm;
		struct mt_uregs r = {.ip = PT_REGS_IP(ctx), .sp = PT_REGS_SP(ctx), .bp = PT_REGS_FP(ctx),
				     .tgid = pid_tgid >> 32, .start_stack = mm ? mm->start_stack : 0};
		flags = mt_capture_stack(&r, 0, s);
	}
	id = mt_stack_hash(s) ^ flags;
	cnt = bpf_map_lookup_elem(&stack_counts, &id);
	if (cnt) {
		__sync_fetch_and_add(cnt, 1);
		return 0;
	}
	bpf_map_update_elem(&stack_counts, &id, &one, BPF_NOEXIST);
	s->h.kind = MT_EV_STACK;
	s->h.flags = flags;
	s->h.pid = pid_tgid >> 32;
	s->h.tid = (__u32)pid_tgid;
	s->h.ts = bpf_ktime_get_ns();
	s->stack_id = id;
	/* variable-size, as memtrace.bpf.c sends it */
	nr = s->nr;
	if (nr > MT_MAX_FRAMES)
		nr = MT_MAX_FRAMES;
	bpf_ringbuf_output(&rb, s, MT_STACK_BYTES(nr), 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_mmap")
int on_mmap(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mt_proc_event *e;

	if ((pid_tgid >> 32) != target_tgid)
		return 0;
	if (!(ctx->args[2] & 4 /* PROT_EXEC */) || (long)ctx->args[4] < 0)
		return 0;
	e = bpf_ringbuf_reserve(&rb, sizeof(*e), 0);
	if (!e)
		return 0;
	__builtin_memset(e, 0, sizeof(*e));
	e->h.kind = MT_EV_LIBMAP;
	e->h.flags = MT_F_STOPPED;
	e->h.pid = pid_tgid >> 32;
	e->h.tid = (__u32)pid_tgid;
	bpf_send_signal(19 /* SIGSTOP */);
	bpf_ringbuf_submit(e, 0);
	return 0;
}
