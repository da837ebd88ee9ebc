/* User stack capture: the one place that walks a user stack. CFI unwinding
 * (unwind.bpf.h, issue 5) for processes whose tables the loader has put in
 * unwind_procs; the frame-pointer walk below for the others (and inside the
 * CFI walk wherever a pc has no table row). Included by memtrace.bpf.c.
 *
 * mt_capture_stack(r, ret_at, out):
 *   r       user ip, sp, rbp at the probe and the current tgid, read once
 *           by the caller (uprobe: directly from ctx; tracepoints: from
 *           bpf_task_pt_regs). Each PT_REGS_*_CORE read is a
 *           bpf_probe_read_kernel call (~30 ns).
 *   ret_at  where the probed function's return address lives: [rsp + ret_at]
 *           for an entry probe (0 at function+0, 8 after one push, ...);
 *           on arm64 in x30 (r->lr), and ret_at is how far sp moved down
 *           before the probe (the caller's sp is sp + ret_at);
 *           MT_RET_UNKNOWN when the probe is not at a function entry.
 *   out     per-CPU scratch struct mt_stack; out->nr and out->ips filled,
 *           innermost first, out->stack_id = mt_stack_hash(out) (both walks
 *           fold it in frame by frame); returns flags (MT_F_STACK_TRUNCATED:
 *           cut, at MT_MAX_FRAMES or where a frame could not be recovered;
 *           MT_F_NO_STACK).
 */
#ifndef MT_STACK_BPF_H
#define MT_STACK_BPF_H

#define MT_RET_UNKNOWN (-1)

#include "unwind.bpf.h"
#if defined(MT_COMPAT) && defined(__TARGET_ARCH_x86)
#include "unwind_chain.bpf.h"
#define MT_CHAIN 1 /* CFI stacks through a chain of tail calls (5.10-5.16) */
#endif

static __always_inline __u64 mt_stack_hash(const struct mt_stack *s)
{
	__u64 h = MT_HASH_SEED;
	for (int i = 0; i < MT_MAX_FRAMES; i++) {
		if (i >= s->nr)
			break;
		h = mt_hash_step(h, s->ips[i]);
	}
	return h ? h : 1;
}

#if !defined(MT_COMPAT)
/* The frame-pointer chain ([fp] = caller's fp, [fp+8] = return address),
 * one bpf_loop step per frame: as a bounded loop of MT_MAX_FRAMES + 1
 * iterations the verifier walked every one, in both programs that take a
 * stack (6.12 under qemu: ~3 s of a launch's load). The compat build
 * (5.10: no bpf_loop) keeps the loop, in mt_capture_stack. */
struct mt_fp_io {
	__u64 sp, fp, h;
	__u32 n, flags;
	int ret_at;
};

struct mt_fp_ctx {
	struct mt_fp_io *io;
	struct mt_stack *out;
};

static long mt_fp_step(__u32 i, void *data)
{
	struct mt_fp_ctx *c = data;
	struct mt_fp_io *io = c->io;
	struct mt_stack *out = c->out;
	__u64 pair[2];

	if (io->fp == 0 || (io->fp & 7) || io->fp < io->sp)
		return 1;
	if (bpf_probe_read_user(pair, sizeof(pair), (void *)io->fp))
		return 1;
#ifdef __TARGET_ARCH_arm64
	pair[1] &= MT_ARM64_VA_MASK; /* a PAC-signed x30 */
#endif
	if (pair[1] == 0)
		return 1;
	/* A probe after the callee's own "push rbp; mov rsp,rbp" sees the
	 * return address twice: once at [rsp+ret_at], once at [fp+8]. */
	if (!(io->n == 1 && i == 0 && io->ret_at >= 0 && pair[1] == out->ips[0])) {
		if (io->n >= MT_MAX_FRAMES) {
			io->flags |= MT_F_STACK_TRUNCATED;
			return 1;
		}
		out->ips[io->n & (MT_MAX_FRAMES - 1)] = pair[1];
		io->n++;
		io->h = mt_hash_step(io->h, pair[1]);
	}
	if (pair[0] <= io->fp)
		return 1;
	io->fp = pair[0];
	return 0;
}

/* A global function: verified once, whatever state its caller is in. */
__attribute__((noinline)) int mt_fp_walk(struct mt_fp_io *io, struct mt_stack *out)
{
	struct mt_fp_ctx c = {.io = io, .out = out};

	if (!io || !out)
		return -1;
	/* one step per frame, one for the duplicate, one to find out whether
	 * a stack of MT_MAX_FRAMES frames goes on (truncated) or ends there */
	bpf_loop(MT_MAX_FRAMES + 1, mt_fp_step, &c, 0);
	return 0;
}
#endif

static __always_inline __u32 mt_capture_stack(const struct mt_uregs *r, int ret_at,
					      struct mt_stack *out)
{
#if !defined(MT_COMPAT)
	/* the CFI unwinder's frame loop is bpf_loop (5.17); x86-64's or
	 * arm64's register rules (unwind.bpf.h) */
	int cfi = mt_unwind_cfi(r, ret_at, out);
	if (cfi >= 0)
		return (__u32)cfi;
#endif

	__u64 sp = r->sp;
	__u64 fp = r->bp;
	__u64 h = MT_HASH_SEED; /* mt_stack_hash, folded in frame by frame */
	__u32 n = 0;
	__u32 flags = 0;

	if (ret_at >= 0) {
		__u64 ret = 0;
#ifdef __TARGET_ARCH_arm64
		ret = r->lr & MT_ARM64_VA_MASK; /* at the entry: bl left it in x30 */
		if (ret) {
#else
		if (bpf_probe_read_user(&ret, sizeof(ret), (void *)(sp + ret_at)) == 0 && ret) {
#endif
			out->ips[n++] = ret;
			h = mt_hash_step(h, ret);
		}
	} else {
		out->ips[n++] = r->ip;
		h = mt_hash_step(h, r->ip);
	}

#if !defined(MT_COMPAT)
	{
		struct mt_fp_io io = {.sp = sp, .fp = fp, .h = h, .n = n, .ret_at = ret_at};
		if (mt_fp_walk(&io, out) == 0) {
			h = io.h;
			n = io.n;
			flags |= io.flags;
		}
	}
#else
	/* Frame-pointer chain: [fp] = caller's fp, [fp+8] = return address.
	 * A bounded loop (5.10 has no bpf_loop): one iteration per frame, one
	 * for the duplicate below, one to find out whether a stack of
	 * MT_MAX_FRAMES frames goes on (truncated) or ends there (complete). */
	for (int i = 0; i < MT_MAX_FRAMES + 1; i++) {
		__u64 pair[2];
		if (fp == 0 || (fp & 7) || fp < sp)
			break;
		if (bpf_probe_read_user(pair, sizeof(pair), (void *)fp))
			break;
#ifdef __TARGET_ARCH_arm64
		pair[1] &= MT_ARM64_VA_MASK; /* a PAC-signed x30 */
#endif
		if (pair[1] == 0)
			break;
		/* A probe after the callee's own "push rbp; mov rsp,rbp" sees the
		 * return address twice: once at [rsp+ret_at], once at [fp+8]. */
		if (!(n == 1 && i == 0 && ret_at >= 0 && pair[1] == out->ips[0])) {
			if (n >= MT_MAX_FRAMES) {
				flags |= MT_F_STACK_TRUNCATED;
				break;
			}
			out->ips[n++ & (MT_MAX_FRAMES - 1)] = pair[1];
			h = mt_hash_step(h, pair[1]);
		}
		if (pair[0] <= fp)
			break;
		fp = pair[0];
	}
#endif
	out->nr = n;
	if (n == 0)
		flags |= MT_F_NO_STACK;
	out->stack_id = h ? h : 1;
	return flags;
}

#endif
