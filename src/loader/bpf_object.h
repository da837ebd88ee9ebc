// The BPF object (bpf/memtrace.bpf.c, or its compat build for kernels before
// 5.17) opened through the one skeleton, and loaded with its heavy programs
// verified in parallel.
//
// Two programs carry the unwinder (bpf/unwind.bpf.h), each verified on its
// own: the allocator entry (mt_alloc_enter) and the mmap exit
// (mt_exit_mmap / mt_fexit_mmap, whose record has a stack); they are most of
// the load (docs/startup-cost.md). The kernel verifies privileged loads
// concurrently but libbpf loads an object's programs one by one, so the
// object is opened three times: the main one creates every map and loads the
// light programs, the other two take its maps (bpf_map__reuse_fd) and load
// one heavy group each, on two threads.
#pragma once
#include <atomic>
#include <string>
#include <thread>

#include "common/result.h"

struct memtrace_bpf;
struct bpf_program;

namespace memtrace::loader {

memtrace_bpf* open_skeleton(bool full);

// libbpf's warnings kept (and printed with MEMTRACE_LIBBPF_VERBOSE=1), so
// that a refused program is named with the verifier's reason.
void install_libbpf_print();
void clear_libbpf_log();
std::string load_failure(int err);

// The objects of one load: `main` (maps, light programs; the one whose
// maps, rodata and bss the tracer uses), and the heavy groups' own.
struct BpfObjects {
  memtrace_bpf* main = nullptr;
  memtrace_bpf* uprobes = nullptr;  // null: loaded by main (MEMTRACE_SERIAL_LOAD=1)
  memtrace_bpf* mmap = nullptr;
  // defer_uprobes: the uprobe programs still verified on this thread after
  // load_objects returns (wait_uprobes).
  std::thread uprobe_loader;
  std::atomic<bool> uprobes_loaded{false};
  int uprobe_err = 0;
  // The programs of a group, from the object that loads them.
  memtrace_bpf* uprobe_object() const { return uprobes ? uprobes : main; }
};

// main opened and configured (rodata, map sizes, autoload, expected attach
// types: set on main, copied to the others); loads it, then the heavy groups
// in parallel. full: which object main was opened from.
// defer_uprobes (with parallel): the uprobe programs' load goes on after
// this returns (--inject: the agent takes the allocator; uprobes only where
// it cannot), until wait_uprobes.
Result<void> load_objects(BpfObjects& objs, bool full, bool parallel, bool defer_uprobes = false);
Result<void> wait_uprobes(BpfObjects& objs);

// Every object's programs that are loaded.
size_t loaded_programs(const BpfObjects& objs);
void destroy_objects(BpfObjects& objs);

}  // namespace memtrace::loader
