// What the helper records and how it prints it (JSON names are the contract
// with memtrace-bpf and with users' scripts: keep them).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace memtrace::singlestep {

enum class Access : uint8_t { kRead = 1, kWrite = 2, kReadWrite = 3 };
const char* access_name(Access a);

struct Region {
  uint64_t addr = 0, len = 0;
  std::string name;  // symbol name, or "" for --addr
  bool contains(uint64_t a) const { return a >= addr && a < addr + len; }
  bool overlaps(uint64_t a, uint64_t n) const { return a < addr + len && addr < a + n; }
};

struct Record {
  uint64_t time_ns = 0;
  pid_t tid = 0;
  uint64_t ip = 0;
  uint64_t address = 0;
  uint32_t size = 0;
  Access access = Access::kRead;
  std::string function;
  std::string insn;   // disassembly, for the per-ip summary
};

// Live allocation tracked by --track-allocs-from.
struct Block {
  uint64_t addr = 0, size = 0;
  uint64_t alloc_time_ns = 0, free_time_ns = 0;  // 0: not freed while tracked
  uint64_t reads = 0, writes = 0, bytes_read = 0, bytes_written = 0;
  std::string alloc_function;
};

struct Report {
  std::vector<Region> regions;
  std::vector<Record> records;
  uint64_t dropped = 0;        // accesses seen after --max was reached (same instruction)
  std::string mode;            // "single-step" | "hw-watchpoint"
  std::string stop_reason;     // "max", "exit", "signal", "duration", "exec", "detached"
  int exit_code = -1;          // tracee exit status when it exited while tracked
  uint64_t emulated = 0, stepped = 0, unrecorded_same_page = 0, syscalls_redirected = 0;
  uint64_t unprotected_syscalls = 0;
  std::vector<Block> blocks;   // --track-allocs-from
  std::string track_allocs_from;
  // --rearm MS (page mode): every MS the regions are made inaccessible again;
  // the first access to each page in an interval faults, the page gets its
  // protection back and the access is retried (no single-step, no record:
  // memtrace-bpf --faults logs the fault with its ip and read/write).
  double rearm_ms = 0;
  uint64_t rearm_intervals = 0;     // times the regions were re-protected
  uint64_t page_first_accesses = 0; // SIGSEGVs on armed pages, each answered by one mprotect
  std::map<uint64_t, uint64_t> page_accesses;  // page -> first accesses

  void write_json(std::ostream& out) const;
  void write_text(std::ostream& out) const;
};

}  // namespace memtrace::singlestep
