// SPDX-License-Identifier: GPL-2.0
/* What one bpf_probe_read_user of the calling process's memory costs, by
 * size and destination (bench/unwind/copy_cost.cpp runs it through
 * BPF_PROG_TEST_RUN of a raw_tp program, which runs in the caller's
 * context). The unwinder's window reads are such copies. */
#include "vmlinux.h"

#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

#define CC_BYTES 16384
struct cc_buf {
	__u64 w[CC_BYTES / 8];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cc_buf);
} cc_percpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cc_buf);
} cc_array SEC(".maps");

const volatile __u64 src = 0;   /* user address to read */
const volatile __u32 len = 16;  /* bytes per copy (0: the loop alone) */
const volatile __u32 dest = 0;  /* 0 per-CPU array value, 1 array value, 2 BPF stack (len <= 128) */
const volatile __u32 iters = 1000;

struct cc_ctx {
	void *dst;
};

static long cc_map(__u64 i, void *arg)
{
	struct cc_ctx *c = arg;

	if (c->dst && len)
		bpf_probe_read_user(c->dst, len & (CC_BYTES - 1), (void *)src);
	return 0;
}

static long cc_stack(__u64 i, void *arg)
{
	__u64 buf[16];

	if (len)
		bpf_probe_read_user(buf, len & 127, (void *)src);
	return buf[0] == 0x1234567; /* (keeps the copy) */
}

SEC("raw_tp")
int copy_cost(void *ctx)
{
	struct cc_ctx c = {};
	__u32 zero = 0;

	if (dest == 2) {
		bpf_loop(iters, cc_stack, &c, 0);
		return 0;
	}
	c.dst = dest == 0 ? bpf_map_lookup_elem(&cc_percpu, &zero) : bpf_map_lookup_elem(&cc_array, &zero);
	bpf_loop(iters, cc_map, &c, 0);
	return 0;
}
