// --inject's entry trampolines (x86-64, issue 21): the allocator's own
// functions in the target (ring.h: the agent's entries) get a jmp at their
// entry to the agent's hook, so that calls that bypass the GOT (a dlsym
// pointer to malloc, ld.so's own pointer, a dlopen'd library's constructor,
// libc's internal calls) are recorded too. The instructions the jmp
// overwrites are relocated here, with capstone, into a stub that ends with a
// jmp back; the hook calls the original through the stub. Written through
// /proc/PID/mem while every thread of the target is stopped and none is
// inside the bytes being replaced.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/result.h"
#include "inject/ring.h"
#include "procfs/proc_maps.h"

namespace memtrace::inject {

class StoppedProcess;

// The first instructions of a function, covering at least min_len bytes,
// rewritten to run at stub_at and followed by a jmp back to fn + len.
struct Relocated {
  std::vector<uint8_t> code;  // to write at stub_at
  size_t len = 0;             // bytes of the original replaced (>= min_len)
};

// code: the function's bytes from its entry (fn); body_len: how much of it
// is the function (its symbol's size; 0: unknown), scanned for branches
// back into (fn, fn + len); incoming: offsets in (0, len] other code of its
// object branches to. RIP-relative operands and relative branches out of
// the prologue are re-encoded for stub_at (rel8 branches widened); a
// branch into the replaced bytes, jrcxz/loop, or a target out of rel32 reach
// refuse it: the error says which instruction.
Result<Relocated> relocate_prologue(const std::vector<uint8_t>& code, size_t body_len, uint64_t fn, uint64_t stub_at,
                                    size_t min_len, const std::vector<uint64_t>& incoming = {});

struct PatchReport {
  uint32_t patched = 0;      // entries patched now
  uint32_t already = 0;      // patched by an earlier session (memtrace_agent_attach): left as they are
  uint32_t thread_stops = 0; // stops of the whole process until no thread was inside the bytes
  uint64_t stopped_us = 0;   // how long the process was held for the writes
  std::vector<std::string> refused;  // "free: ..." one line each: that entry stays as it was (its GOT slots still hooked)
};

// What patch_entries reads of the files (their symbols, every rel32
// branch target of their code: ~1.5 MB of libc scanned), read before the
// agent is loaded (prepare_entries: libc's and libstdc++'s), so that the
// process runs with the hooks and without the trampolines for as short a
// time as possible.
struct EntryFiles;
struct EntryFilesDeleter {
  void operator()(EntryFiles* f) const;
};
using EntryFilesPtr = std::unique_ptr<EntryFiles, EntryFilesDeleter>;
// maps: pid's (nullptr: read here); fns: more entries whose files are
// read too (a non-glibc allocator's, ring.h fns).
EntryFilesPtr prepare_entries(pid_t pid, const std::vector<procfs::Mapping>* maps = nullptr,
                              const std::vector<uint64_t>& fns = {});

// The agent's entries (hdr, the ring's header as the loader maps it)
// patched in pid. held: the process is stopped already (hold_at_entry).
// files: prepare_entries' (else read here). An error only when nothing
// could be done at all; a function that cannot be patched is named in
// refused.
// maps: pid's as the attach read them (the entries' mappings were there
// before the agent came; nullptr: read here).
Result<PatchReport> patch_entries(pid_t pid, mt_inj_hdr* hdr, StoppedProcess* held, EntryFiles* files = nullptr,
                                  const std::vector<procfs::Mapping>* maps = nullptr);

// The entries patch_entries (of this session or an earlier one) patched,
// put back as the file has them (a uprobe's int3 kept), every thread
// stopped; the agent's pointers to the originals too. At a session's clean
// end: a tracer's uprobe placed later on one of those entries (the BPF
// path's at malloc's first instruction) would find the jmp there and break
// the process. How many were put back (an entry found as the file has it
// already, a restore ended half way or another tool's, counts: its pointers
// are reset and it is listed as not patched); an error saying why when
// none could be (the agent, its trampoline area or /proc/PID/mem gone).
Result<uint32_t> unpatch_entries(pid_t pid, mt_inj_hdr* hdr);

}  // namespace memtrace::inject
