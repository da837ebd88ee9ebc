// Whether a stopped thread may hold a lock the agent's dlopen needs (issue
// 21): one of its LIVE frames lies in "busy" code (ld.so, glibc's malloc.c,
// libc functions that run code under their locks). Its frames are its pc,
// then the return addresses an unwind of its stack finds with the CFI of
// .eh_frame (src/unwind's tables, the ones the BPF unwinder reads), and,
// past a signal frame, the interrupted context's pc and its callers (a
// handler may have interrupted malloc). Stale return addresses in dead
// stack slots are not frames: a raw scan of the stack words took them for
// ones and refused safe attaches. Where the unwind cannot go on (no CFI for
// a pc, an expression the tables do not keep, a frame that does not move up
// the stack), the rest of that stack is scanned as before (a word preceded
// by a call instruction, up to 32 KiB) and the reason says so.
//
//   auto bf = inject::BusyFrames::open(pid);      // busy code, maps
//   std::string why = (*bf)->reason(tid, mem);    // "" or "return address in libc.so.6+0x9a2b1 (frame 6)"
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"
#include "unwind/table_store.h"

namespace memtrace::inject {

// Code whose locks the agent's dlopen may need: ld.so's text (the load
// lock: dlopen, dlclose, dlsym, TLS setup), glibc's malloc (malloc.c: the
// arenas' locks; its static functions, _int_malloc, sysmalloc..., lie
// between its exported ones' neighbours: one translation unit), and libc
// functions that take the loader's or the allocator's locks around code of
// their own or of the program (dl_iterate_phdr's callback, fork's
// handlers, dlopen's constructors).
struct BusyCode {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [lo, hi) in the target
  bool has(uint64_t a) const {
    for (const auto& [lo, hi] : ranges)
      if (a >= lo && a < hi) return true;
    return false;
  }
};
// maps: pid's (nullptr: read here).
Result<BusyCode> busy_code(pid_t pid, const std::vector<procfs::Mapping>* maps = nullptr);

struct ProcessView;

class BusyFrames {
 public:
  // view: the attach's snapshot of the maps and the allocator's code
  // besides glibc's (injector.h; nullptr: the maps read here, glibc only).
  static Result<std::unique_ptr<BusyFrames>> open(pid_t pid, const ProcessView* view = nullptr);
  // The maps read again (threads started since: their stacks).
  void refresh_maps();
  // "" when no live frame of thread tid (ptrace-stopped; mem: its
  // process's /proc/PID/mem) is in busy code; else where one is, and how it
  // was found: "pc in libc.so.6+0x98a1c", "return address in
  // libc.so.6+0x9a2b1 (frame 6, past a signal frame)", "return address in
  // ld-linux-x86-64.so.2+0xb758 (stack scanned from frame 3: no CFI for pc
  // 0x7f0012345678)".
  std::string reason(pid_t tid, int mem);

  uint64_t scans() const { return scans_; }  // reasons that needed the stack scan

 private:
  explicit BusyFrames(pid_t pid) : pid_(pid) {}
  struct Module {
    uint64_t bias = 0;  // ELF vaddr = runtime address - bias
    std::shared_ptr<const unwind::CfiTable> table;
    std::string error;  // why there is no table
  };
  const Module& module_of(const procfs::Mapping& m, int mem);
  const procfs::Mapping* mapping_of(uint64_t a) const;
  std::string where(const char* what, uint64_t a) const;
  std::string scan(int mem, uint64_t sp, int frame, const std::string& why);

  pid_t pid_;
  BusyCode busy_;
  std::vector<procfs::Mapping> maps_;
  unwind::TableStore store_;
  std::map<std::pair<uint64_t, uint64_t>, Module> modules_;  // by mapping [start, end)
  uint64_t scans_ = 0;
};

// Whether a call instruction ends just before ra (a return address, not a
// function pointer or other data that happens to point into code).
bool after_call(int mem, uint64_t ra);

}  // namespace memtrace::inject
