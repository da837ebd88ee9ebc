/* User stack capture: the one place that walks a user stack. CFI unwinding
 * (unwind.bpf.h, issue 5) for processes whose tables the loader has put in
 * unwind_procs; the frame-pointer walk below for the others (and inside the
 * CFI walk wherever a pc has no table row). Included by memtrace.bpf.c.
 *
 * mt_capture_stack(regs, ret_at, out):
 *   regs    user registers at the probe (uprobe ctx, or bpf_task_pt_regs for
 *           tracepoints)
 *   ret_at  where the probed function's return address lives: [rsp + ret_at]
 *           for an entry probe (0 at function+0, 8 after one push, ...);
 *           MT_RET_UNKNOWN when the probe is not at a function entry.
 *   out     per-CPU scratch struct mt_stack; out->nr and out->ips filled,
 *           innermost first; returns flags (MT_F_STACK_TRUNCATED, MT_F_NO_STACK).
 */
#ifndef MT_STACK_BPF_H
#define MT_STACK_BPF_H

#define MT_RET_UNKNOWN (-1)

#include "unwind.bpf.h"

static __always_inline __u32 mt_capture_stack(struct pt_regs *regs, int ret_at,
					      struct mt_stack *out)
{
	int cfi = mt_unwind_cfi(regs, ret_at, out);
	if (cfi >= 0)
		return (__u32)cfi;

	__u64 sp = PT_REGS_SP_CORE(regs);
	__u64 fp = PT_REGS_FP_CORE(regs);
	__u32 n = 0;
	__u32 flags = 0;

	if (ret_at >= 0) {
		__u64 ret = 0;
		if (bpf_probe_read_user(&ret, sizeof(ret), (void *)(sp + ret_at)) == 0 && ret)
			out->ips[n++] = ret;
	} else {
		out->ips[n++] = PT_REGS_IP_CORE(regs);
	}

	/* Frame-pointer chain: [fp] = caller's fp, [fp+8] = return address. */
	for (int i = 0; i < MT_MAX_FRAMES; i++) {
		__u64 pair[2];
		if (n >= MT_MAX_FRAMES) {
			flags |= MT_F_STACK_TRUNCATED;
			break;
		}
		if (fp == 0 || (fp & 7) || fp < sp)
			break;
		if (bpf_probe_read_user(pair, sizeof(pair), (void *)fp))
			break;
		if (pair[1] == 0)
			break;
		/* A probe after the callee's own "push rbp; mov rsp,rbp" sees the
		 * return address twice: once at [rsp+ret_at], once at [fp+8]. */
		if (!(n == 1 && i == 0 && ret_at >= 0 && pair[1] == out->ips[0]))
			out->ips[n++ & (MT_MAX_FRAMES - 1)] = pair[1];
		if (pair[0] <= fp)
			break;
		fp = pair[0];
	}
	out->nr = n;
	if (n == 0)
		flags |= MT_F_NO_STACK;
	return flags;
}

static __always_inline __u64 mt_stack_hash(const struct mt_stack *s)
{
	__u64 h = 0xcbf29ce484222325ULL;
	for (int i = 0; i < MT_MAX_FRAMES; i++) {
		if (i >= s->nr)
			break;
		h ^= s->ips[i];
		h *= 0x100000001b3ULL;
		h ^= h >> 29;
	}
	return h ? h : 1;
}

#endif
