// SPDX-License-Identifier: GPL-2.0
/* The uprobe floor: empty programs on the same probes, at the same offsets,
 * as memtrace-bpf's allocator probes. Whatever a run costs with these is the
 * cost of the traps alone (DESIGN.md: emulated ~0.7 us, single-stepped 14-17 us). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "GPL";

SEC("uprobe")
int floor_enter(struct pt_regs *ctx)
{
	return 0;
}

SEC("uretprobe")
int floor_exit(struct pt_regs *ctx)
{
	return 0;
}
