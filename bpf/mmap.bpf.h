/* Part of memtrace.bpf.c, included at its end (one BPF object, one skeleton). */
#ifndef MT_MMAP_BPF_H
#define MT_MMAP_BPF_H

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

/* The record of an mmap, and what follows it for executable mappings. In
 * the compat object a BPF function of its own: its locals stay out of
 * mt_exit_mmap's frame, which must be under 256 bytes for the CFI chain's
 * tail calls from mt_chain_start_mmap (the verifier's rule for tail calls
 * from BPF functions). */
#ifdef MT_CHAIN
#define MT_MMAP_RECORD static __attribute__((noinline)) int
#else
#define MT_MMAP_RECORD static __always_inline int
#endif
MT_MMAP_RECORD mmap_record(__u64 pid_tgid, __u64 ret, const struct mt_sysargs *args, __u32 flags,
			   __u64 stack_id);

/* The end of a traced mmap: the record, and for executable file mappings the
 * loader told (system-wide) or the process stopped for it. Shared by the
 * system-call tracepoint (tp_ctx: its context, where the compat object's
 * CFI chain starts) and the fexit program (tp_ctx null). */
static __always_inline void mmap_done(void *tp_ctx, __u64 pid_tgid, __u64 ret, struct mt_sysargs args)
{
	__u32 flags = 0;
	__u64 stack_id = 0;

	if (ret >= (__u64)-4095)
		return;
	if (args.internal)
		flags |= MT_F_ALLOCATOR_INTERNAL;
	else if (!((__s32)args.a3 >= 0) || /* anonymous direct mapping: keep its stack */
		 !(args.a1 & PROT_EXEC)) {
		struct mt_uregs r = user_regs(pid_tgid);
#ifdef MT_CHAIN
		/* 1: the chain ran and its resumed mt_exit_mmap recorded the call */
		if (tp_ctx && capture_stacks && mt_chain_start_mmap(tp_ctx, &r, &args, ret))
			return;
#endif
		stack_id = take_stack(&r, MT_RET_UNKNOWN, &flags, pid_tgid);
	}
	mmap_record(pid_tgid, ret, &args, flags, stack_id);
}

MT_MMAP_RECORD mmap_record(__u64 pid_tgid, __u64 ret, const struct mt_sysargs *a, __u32 flags,
			   __u64 stack_id)
{
	__u32 tgid = pid_tgid >> 32;
	struct mt_sysargs args;

	if (!a)
		return 0;
	args = *a;

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
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_mmap")
int mt_exit_mmap(struct trace_event_raw_sys_exit *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mt_sysargs args;

#ifdef MT_CHAIN
	{
		/* The CFI chain this exit started is done: the record with
		 * its stack (unwind_chain.bpf.h) */
		__u32 zero = 0;
		struct mt_chain *st = bpf_map_lookup_elem(&unwind_chain, &zero);

		if (st && st->state == MT_CHAIN_DONE) {
			st->state = MT_CHAIN_IDLE;
			if (st->kind == MT_CHAIN_MMAP && st->pid_tgid == pid_tgid) {
				struct mt_stack *s = bpf_map_lookup_elem(&stack_scratch, &zero);
				__u32 flags = st->flags;
				__u64 id;

				if (!s)
					return 0;
				id = stack_send(s, &flags, pid_tgid);
				mmap_record(pid_tgid, st->ret, &st->args, flags, id);
				return 1; /* to mt_chain_start_mmap's caller */
			}
		}
	}
#endif
	if (take_args((__u32)pid_tgid, &args))
		mmap_done(ctx, pid_tgid, ctx->ret, args);
	return 0;
}

#ifdef MT_CHAIN
/* The CFI chain's walker for mmap's stacks (unwind_chain.bpf.h), a
 * tracepoint program as mt_exit_mmap is (never attached: tail-called). */
SEC("tracepoint/syscalls/sys_exit_mmap")
int mt_unwind_chain_mmap(void *ctx)
{
	__u32 zero = 0;
	struct mt_chain *st = bpf_map_lookup_elem(&unwind_chain, &zero);

	if (!st || st->state != MT_CHAIN_WALKING || st->kind != MT_CHAIN_MMAP)
		return 0;
	if (mt_chain_run(st)) {
		bpf_tail_call(ctx, &unwind_chain_progs_tp, MT_CHAIN_MMAP_WALKER);
		st->flags = mt_chain_finish(st); /* (no tail call left: cut here) */
		st->state = MT_CHAIN_DONE;
	}
	bpf_tail_call(ctx, &unwind_chain_progs_tp, MT_CHAIN_MMAP_RESUME);
	st->state = MT_CHAIN_IDLE; /* (never) the exit walks frame pointers */
	count(MT_C_CHAIN_FALLBACK);
	return 0;
}
#endif

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
	mmap_done(0, pid_tgid, ret, a);
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

#endif /* MT_MMAP_BPF_H */
