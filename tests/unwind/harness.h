// Test/bench harness around unwind_test.bpf.c: run a program stopped at its
// start, attach the malloc uprobe to it alone, load its unwind tables, and
// collect the distinct stacks (with allocation counts). Shared by
// unwind_bpf_test and bench/unwind.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/result.h"
#include "unwind/unwind_maps.h"

namespace memtrace::unwind::harness {

struct Stack {
  uint64_t count = 0;
  uint32_t flags = 0;  // MT_F_STACK_TRUNCATED ...
  std::vector<uint64_t> ips;
};

struct Options {
  bool no_aslr = false;       // personality(ADDR_NO_RANDOMIZE): addresses as under gdb
  uint64_t mark_size = 0;     // only mallocs of this size (0: all)
  bool unwind = true;         // false: frame pointers only (unwind_disabled)
  bool stop_after_first = false;
  int timeout_ms = 20000;
  bool self_stops = false;    // the program raises SIGSTOP itself (else: launched stopped by us)
  // false: the program's tables are loaded, but its value in unwind_procs is
  // removed again: as a process the loader has not read yet, every row comes
  // through its VMAs and unwind_files.
  bool publish = true;
  bool files_index = true;    // false: unwind_files left empty
};

struct Run {
  pid_t pid = -1;
  std::vector<Stack> stacks;
  std::vector<unwind::ProcMapping> maps;  // /proc/PID/maps when the first stack arrived / at exit
  uint64_t counters[MT_UC_COUNT] = {};
  UnwindStats table_stats;
  uint64_t prog_run_ns = 0, prog_run_cnt = 0;  // with kernel.bpf_stats_enabled
  int exit_status = -1;
  std::string table_errors;
};

// Runs argv (PATH lookup) under the malloc probe. With stop_after_first the
// program is killed after the first stack (it is expected to wait).
Result<Run> trace(const std::vector<std::string>& argv, const Options& opt);

// Function name of a return address (nearest preceding function symbol of
// the mapped file, demangled), "??" if none.
class Symbolizer {
 public:
  explicit Symbolizer(std::vector<unwind::ProcMapping> maps) : maps_(std::move(maps)) {}
  std::string name(uint64_t ip);
  // Every symbol name at the start of ip's function (glibc has several
  // aliases per function: qsort_r, __qsort_r, __GI___qsort_r).
  std::vector<std::string> aliases(uint64_t ip);
  std::string file(uint64_t ip);

 private:
  struct Lookup;
  bool find(uint64_t ip, std::vector<std::string>* names);
  std::vector<unwind::ProcMapping> maps_;
  std::map<std::string, std::shared_ptr<void>> elves_;  // path -> ElfFile (symbols: debug file if any)
};

}  // namespace memtrace::unwind::harness
