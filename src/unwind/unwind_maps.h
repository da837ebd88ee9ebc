// Loader side of the BPF unwinder: puts CFI tables into the BPF maps of
// bpf/unwind.bpf.h and records, per traced process, which executable
// mapping uses which table (with its load bias).
//
//   auto maps = UnwindMaps::create(skel->maps.unwind_rows, skel->maps.unwind_procs,
//                                  skel->maps.unwind_epoch);
//   maps->add_process(pid);                       // at attach: every r-x file mapping
//   maps->on_exec_mapping(pid, start, end, off);  // process mapped a new r-x file
//   maps->remove_process(pid);                    // exit (exec: add_process again)
//
// Rows of one file are loaded once into the rows array and shared by every
// process mapping the file; freed when the last such process is removed.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/result.h"
#include "unwind/table_store.h"

struct bpf_map;

namespace memtrace::unwind {

// One line of /proc/PID/maps.
struct ProcMapping {
  uint64_t start = 0, end = 0, offset = 0;
  std::string perms;  // "r-xp"
  uint64_t inode = 0;
  std::string path;   // "" for anonymous
};
Result<std::vector<ProcMapping>> read_proc_maps(pid_t pid);

struct UnwindStats {
  size_t processes = 0;
  size_t mappings = 0;        // executable file mappings recorded
  size_t mappings_no_cfi = 0; // of which without rows (frame-pointer fallback)
  size_t files = 0;           // distinct tables loaded into the rows array
  size_t rows = 0;            // rows loaded (sum over files)
  size_t row_bytes = 0;       // rows * sizeof(struct mt_unwind_row)
  size_t rows_capacity = 0;   // unwind_rows max_entries
  size_t map_bytes = 0;       // rows array + per-process records in the kernel
  size_t failed = 0;          // mappings whose file could not be read
};

class UnwindMaps {
 public:
  // From the two maps of a loaded skeleton (unwind_rows, unwind_procs).
  // unwind_epoch (may be null): set to a new value at every publish and
  // removal, so that the BPF walk memo, keyed by (tgid, epoch), never
  // replays a walk made with other tables.
  static Result<std::unique_ptr<UnwindMaps>> create(const bpf_map* rows, const bpf_map* procs,
                                                    const bpf_map* epoch = nullptr);
  // From raw map fds (not owned) and the rows array size.
  static Result<std::unique_ptr<UnwindMaps>> create_fds(int rows_fd, uint32_t max_rows, int procs_fd,
                                                        int epoch_fd = -1);
  ~UnwindMaps();
  UnwindMaps(const UnwindMaps&) = delete;
  UnwindMaps& operator=(const UnwindMaps&) = delete;

  // Reads /proc/PID/maps and loads tables for every executable file mapping
  // (idempotent: a second call picks up new mappings and drops gone ones).
  Result<void> add_process(pid_t pid);
  // The process mapped [start, end) of a file at `offset` executable (the
  // loader sees it as an mmap event). The file is opened through
  // /proc/PID/map_files (exactly the mapped file, any mount namespace);
  // `path` is only used in messages and as a fallback.
  Result<void> on_exec_mapping(pid_t pid, uint64_t start, uint64_t end, uint64_t offset,
                               const std::string& path = "");
  // The process exited (or its address space is gone after exec).
  void remove_process(pid_t pid);

  UnwindStats stats() const;
  const TableStore& store() const { return store_; }

 private:
  UnwindMaps() = default;
  struct Loaded {
    uint32_t first = 0;
    uint32_t refs = 0;
  };
  struct Mapping {
    uint64_t start, end, bias;
    std::shared_ptr<const CfiTable> table;  // null: no CFI
  };
  Result<void> add_mapping(pid_t pid, const ProcMapping& m, std::vector<Mapping>* out);
  Result<uint32_t> load_rows(const std::shared_ptr<const CfiTable>& t);
  void unref(const CfiTable* t);
  Result<void> publish(pid_t pid);
  Result<uint32_t> alloc(uint32_t n);
  void release(uint32_t first, uint32_t n);

  int rows_fd_ = -1;
  int procs_fd_ = -1;
  int epoch_fd_ = -1;
  void bump_epoch(uint32_t gen);
  uint32_t max_rows_ = 0;
  void* rows_mem_ = nullptr;  // the mmap-able rows array
  size_t rows_mem_len_ = 0;
  std::map<uint32_t, uint32_t> free_;  // first -> count (coalesced)
  TableStore store_;
  std::map<const CfiTable*, Loaded> loaded_;
  std::map<pid_t, std::vector<Mapping>> procs_;
  size_t failed_ = 0;
  uint32_t gen_ = 0;  // mt_unwind_proc.gen of the last published value
};

}  // namespace memtrace::unwind
