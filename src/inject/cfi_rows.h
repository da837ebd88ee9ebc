// The agent's CFI rows (issue 33, ring.h MT_INJ_STACK_CFI): the BPF
// unwinder's tables (src/unwind) for every executable file mapping of the
// process, as one blob the ring's file carries after its data area: the
// modules (struct mt_inj_cfi_mod, sorted by start) then the rows, one
// copy per file.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "procfs/proc_maps.h"
#include "unwind/table_store.h"
extern "C" {
#include "memtrace.h"
#include "inject/ring.h"
}

namespace memtrace::inject {

struct CfiRows {
  std::vector<mt_inj_cfi_mod> mods;
  std::vector<mt_unwind_row> rows;
  size_t mappings_without = 0;  // executable file mappings with no rows (no CFI, unreadable): their frames go to libunwind
  std::string first_error;      // the first file that could not be read, for the log
  double build_ms = 0;
  size_t bytes() const { return mods.size() * sizeof(mt_inj_cfi_mod) + rows.size() * sizeof(mt_unwind_row); }
};

// From the attach's snapshot of pid's maps; store: tables built once per file.
CfiRows build_cfi_rows(pid_t pid, const std::vector<procfs::Mapping>& maps, unwind::TableStore* store);

}  // namespace memtrace::inject
