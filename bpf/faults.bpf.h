/* Part of memtrace.bpf.c, included at its end (one BPF object, one skeleton). */
#ifndef MT_FAULTS_BPF_H
#define MT_FAULTS_BPF_H

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

#endif /* MT_FAULTS_BPF_H */
