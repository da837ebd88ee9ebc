/* Part of memtrace.bpf.c, included at its end (one BPF object, one skeleton). */
#ifndef MT_PROC_BPF_H
#define MT_PROC_BPF_H

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

/* --cgroup: the current task is in the subtree (cgroup v2: its ancestor at
 * the subtree's level is the subtree's root). Dead code when cgroup_id is
 * 0 (rodata): the verifier never sees the helper then. */
static __always_inline bool cgroup_matches(void)
{
	return cgroup_id && bpf_get_current_ancestor_cgroup_id(cgroup_level) == cgroup_id;
}

/* -c and --cgroup: a process that either names starts being traced at its exec. */
static __always_inline bool filter_matches(void)
{
	return (ncomms && comm_matches()) || cgroup_matches();
}

/* The interpreter's (ld.so's) load address from mm's auxiliary vector
 * (AT_BASE), 0 when the program has none: statically linked (or ld.so run
 * as the program). Filled by the ELF loader before the exec tracepoint. */
#define MT_AUXV_PAIRS 32
static __always_inline __u64 interp_base(struct mm_struct *mm)
{
	for (int i = 0; i < MT_AUXV_PAIRS; i++) {
		unsigned long kv[2];
		if (bpf_probe_read_kernel(kv, sizeof(kv), (char *)mm +
					  bpf_core_field_offset(struct mm_struct, saved_auxv) + i * 16))
			break;
		if (kv[0] == 0) /* AT_NULL */
			break;
		if (kv[0] == 7) /* AT_BASE */
			return kv[1];
	}
	return 0;
}

/* MT_EV_MAPFILE of the program an exec starts (system-wide): its code's
 * range (mm's start_code: the first executable PT_LOAD's address), the
 * file really executed (a script's interpreter), and in pgoff the
 * interpreter's (ld.so's) load address (interp_base). */
static __always_inline void map_event_exe(__u64 pid_tgid, struct mm_struct *mm, struct linux_binprm *bprm,
					  __u64 base)
{
	struct mt_map_event *e;

	e = map_event_reserve(pid_tgid, BPF_CORE_READ(bprm, file), sizeof(*e));
	if (!e)
		return;
	e->start = BPF_CORE_READ(mm, start_code);
	e->end = BPF_CORE_READ(mm, end_code);
	e->is_exe = 1;
	e->pgoff = base;
	if (bpf_probe_read_kernel_str(e->path, sizeof(e->path), BPF_CORE_READ(bprm, interp)) < 0)
		e->path[0] = 0;
	bpf_ringbuf_submit(e, 0);
}

/* System-wide, an exec of a program without an interpreter (statically
 * linked): its allocator is in its own file, which no library mapping will
 * bring. Its first exec is stopped (before its first instruction) until the
 * loader has looked at the file and attached its probes, unless the loader
 * knows the file (static_known), is ending, or started the process itself
 * (a helper the loader may wait for). */
static __always_inline __u32 static_exec_flags(struct task_struct *p, struct linux_binprm *bprm,
					       struct mt_file_key *kp)
{
	struct mt_file_key k = {};
	struct file *f = BPF_CORE_READ(bprm, file);

	if (!f)
		return 0;
	k.ino = BPF_CORE_READ(f, f_inode, i_ino);
	k.dev = BPF_CORE_READ(f, f_inode, i_sb, s_dev);
	*kp = k;
	if (bpf_map_lookup_elem(&static_known, &k) || tracing_stopped ||
	    BPF_CORE_READ(p, real_parent, tgid) == self_pid)
		return MT_F_EXEC_STATIC;
	return MT_F_EXEC_STATIC | MT_F_STOPPED;
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
		/* No stop system-wide (the loader only looks for new allocator
		 * objects), but at a static program's first exec. */
		struct mm_struct *mm = BPF_CORE_READ(p, mm);
		__u64 base = mm ? interp_base(mm) : 1;
		struct mt_file_key k = {};
		__u32 flags = base ? 0 : static_exec_flags(p, bprm, &k);

		emit(MT_EV_EXEC, 0, pid_tgid, exec_id, 0, 0, 0, 0, 0, 0);
		/* The file in the record: a later exec, not stopped, may be over
		 * before the loader could look at /proc/PID/exe. */
		proc_event(MT_EV_EXEC, flags, pid_tgid, (__u32)k.dev, 0, exec_id, k.ino);
		if (mm)
			map_event_exe(pid_tgid, mm, bprm, base);
		return 0;
	}
	t = bpf_map_lookup_elem(&targets, &tgid);
	if (t) {
		/* A traced process loaded a new image: its old probes are gone
		 * with its old mm. In comm mode the new image must match too. */
		if ((ncomms || cgroup_id) && !t->follow && !filter_matches()) {
			bpf_map_delete_elem(&targets, &tgid);
			emit(MT_EV_EXEC, MT_F_EXEC_UNTRACED, pid_tgid, exec_id, 0, 0, 0, 0, 0, 0);
			proc_event(MT_EV_EXIT, 0, pid_tgid, 0, -1, 0, 0);
			return 0;
		}
		t->state = MT_TS_PENDING;
		t->image++;
	} else if (filter_matches()) {
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

#endif /* MT_PROC_BPF_H */
