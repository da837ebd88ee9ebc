// What the running kernel lets memtrace-bpf do, probed at start: each BPF
// helper, map type, attach type and tracepoint argument the tool uses is
// asked of the kernel itself (libbpf's probes, the kernel's BTF), never
// inferred from a version number (distributions backport). The loader picks
// a mechanism per feature from this; `memtrace-bpf --check` prints it.
#pragma once
#include <string>
#include <vector>

namespace memtrace::loader {

struct KernelFeatures {
  std::string release;  // uname -r

  // Needed to run at all.
  bool bpf = false;  // bpf(2) works for this process (a map can be created)
  std::string bpf_error;  // why not: names the cause (capabilities, lockdown, sysctl)
  bool btf = false;       // /sys/kernel/btf/vmlinux: CO-RE relocations, BTF tracepoints
  bool ringbuf = false;   // BPF_MAP_TYPE_RINGBUF (5.8)
  bool uprobes = false;   // the uprobe PMU or tracefs uprobe_events
  bool sched_tp_btf = false;  // sched_process_exec/fork/exit as BTF tracepoints

  // Chosen per feature.
  bool uprobe_multi = false;    // BPF_TRACE_UPROBE_MULTI links (6.6): one link per process
  bool attach_cookie = false;   // bpf_get_attach_cookie (5.15): one program for every allocator role
  bool bpf_loop = false;        // bpf_loop (5.17): the CFI unwinder's frame loop
  bool find_vma = false;        // bpf_find_vma (5.17): page faults checked against their VMA
  bool task_storage = false;    // task local storage in tracing programs
  bool task_btf = false;        // bpf_get_current_task_btf (5.11)
  bool task_pt_regs = false;    // bpf_task_pt_regs (5.15): user registers in syscall tracepoints
  bool exit_group_dead = false; // sched_process_exit passes group_dead (after 6.12)
  bool syscall_fexit = false;   // fentry/fexit on the mmap family's system-call functions and schedule_tail
                               // (trampolines: x86-64 5.5, arm64 6.0): no syscalls:* tracepoint attached
  bool page_fault_tp = false;   // the user page-fault hook: exceptions:page_fault_user as a BTF tracepoint
                               // (x86-64); on aarch64 a kprobe on handle_mm_fault (docs/arm64.md)

  // Context for error messages.
  std::string lockdown;      // "none", "integrity", "confidentiality", or "" (unknown)
  int unprivileged_bpf_disabled = -1;
  bool cap_sys_admin = false, cap_bpf = false, cap_perfmon = false;

  // Everything the BPF programs need is there (possibly through fallbacks).
  bool can_run() const { return bpf && btf && ringbuf && uprobes && sched_tp_btf; }
  // The full BPF object can load (5.17 and later, or backports of all of
  // these); otherwise the compat object (bpf/memtrace.bpf.c, MT_COMPAT).
  bool full_bpf() const {
    return bpf_loop && find_vma && attach_cookie && task_storage && task_btf && task_pt_regs;
  }
  // What the full object needs and this kernel lacks ("bpf_loop, bpf_find_vma").
  std::string full_bpf_missing() const;
};

// Which BPF object to load: the full one where the kernel allows it. The
// environment variable MEMTRACE_BPF_VARIANT=compat|full overrides the choice
// (tests run the compat object on a new kernel with it).
bool choose_full_bpf(const KernelFeatures& k);

// Whether the full object's fentry/fexit programs replace the system-call
// tracepoints. MEMTRACE_SYSCALL_HOOKS=tracepoint|fexit overrides the choice
// (tests and benchmarks compare the two on one kernel).
bool choose_syscall_fexit(const KernelFeatures& k);

// Probes the running kernel (needs root for the BPF probes; without it, bpf
// is false and bpf_error says why).
KernelFeatures probe_kernel();

// One line per feature: what this kernel supports, and which mechanism or
// fallback the tool uses ("ok", "fallback", "missing" first).
std::vector<std::string> describe(const KernelFeatures& k);

}  // namespace memtrace::loader
