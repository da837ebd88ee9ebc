// SPDX-License-Identifier: GPL-2.0
/* What the helpers an allocator probe calls cost, one at a time
 * (bench/unwind/helper_cost.cpp runs this through BPF_PROG_TEST_RUN of a
 * raw_tp program, in the caller's context, iters calls per run). Each
 * helper call and return costs more than its work on a kernel whose returns
 * go through a return thunk (SRSO "Safe RET" on this VM's AMD EPYC): the
 * probes' fixed part is their number of calls. */
#include "vmlinux.h"

#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct hc_rec {
	__u64 w[9]; /* the size of an allocation event (72 bytes) */
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} hc_ring SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} hc_percpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct hc_rec);
} hc_task SEC(".maps");

const volatile __u32 mode = 0;
const volatile __u32 iters = 1000;

__u64 sink; /* keeps each result */

static long hc_step(__u64 i, void *arg)
{
	__u32 zero = 0;

	switch (mode) {
	case 1:
		sink += bpf_ktime_get_ns();
		break;
	case 2: /* (bpf_ktime_get_coarse_ns: not for tracing programs) */
		sink += bpf_ktime_get_boot_ns();
		break;
	case 3:
		sink += bpf_jiffies64();
		break;
	case 4:
		sink += bpf_get_current_task_btf()->pid;
		break;
	case 5:
		sink += bpf_get_current_pid_tgid();
		break;
	case 6: {
		__u64 *v = bpf_map_lookup_elem(&hc_percpu, &zero);
		if (v)
			sink += ++*v;
		break;
	}
	case 7: {
		struct hc_rec *r = bpf_task_storage_get(&hc_task, bpf_get_current_task_btf(), 0,
							BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (r)
			sink += ++r->w[0];
		break;
	}
	case 8:
		sink += bpf_ringbuf_query(&hc_ring, BPF_RB_AVAIL_DATA);
		break;
	case 9: {
		struct hc_rec *r = bpf_ringbuf_reserve(&hc_ring, sizeof(*r), 0);
		if (r) {
			r->w[0] = i;
			bpf_ringbuf_discard(r, BPF_RB_NO_WAKEUP);
		}
		break;
	}
	case 10: {
		struct hc_rec r = {.w = {i}};
		/* (output, then the ring's consumer position is never moved:
		 * discard keeps it empty for reserve; output fills it, so
		 * the count of failures is the cost of a full ring too) */
		sink += bpf_ringbuf_output(&hc_ring, &r, sizeof(r), BPF_RB_NO_WAKEUP);
		break;
	}
	default:
		break;
	}
	return 0;
}

SEC("raw_tp")
int helper_cost(void *ctx)
{
	bpf_loop(iters, hc_step, 0, 0);
	return 0;
}
