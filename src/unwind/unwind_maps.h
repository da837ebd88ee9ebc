// Loader side of the BPF unwinder: puts CFI tables into the BPF maps of
// bpf/unwind.bpf.h and records, per traced process, which executable
// mapping uses which table (with its load bias).
//
//   auto maps = UnwindMaps::create(skel->maps.unwind_shards, skel->maps.unwind_procs,
//                                  skel->maps.unwind_epoch, cap_bytes);
//   maps->add_process(pid);                       // at attach: every r-x file mapping
//   maps->on_exec_mapping(pid, start, end, off);  // process mapped a new r-x file
//   maps->remove_process(pid);                    // exit (exec: add_process again)
//
// Rows of one file are loaded once, as a consecutive range of the row space,
// and shared by every process mapping the file. The row space is made of
// shards (BPF array maps of 2^18 rows in unwind_shards): more are added
// when a file needs room, empty ones at the end are dropped. A file no
// process maps any more keeps its rows for kKeepSeconds (a build runs
// cc1plus again and again) unless the room is needed. The shards' sum is
// capped: a file that would pass the cap unwinds by frame pointers
// (counted in `failed` and `over_cap`, with a message naming the file).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/result.h"
#include "procfs/proc_maps.h"
#include "unwind/table_store.h"

struct bpf_map;

namespace memtrace::unwind {

using ProcMapping = procfs::Mapping;  // one line of /proc/PID/maps (src/procfs)

struct UnwindStats {
  size_t processes = 0;
  size_t mappings = 0;        // executable file mappings recorded
  size_t mappings_no_cfi = 0; // of which without rows (frame-pointer fallback)
  size_t files = 0;           // distinct tables loaded and in use
  size_t files_kept = 0;      // loaded, no process maps them now (kept kKeepSeconds)
  size_t shards = 0;          // shards in the kernel now
  size_t rows = 0;            // rows loaded (sum over files)
  size_t row_bytes = 0;       // rows * sizeof(struct mt_unwind_row)
  size_t map_bytes = 0;       // shards + per-process records in the kernel
  size_t peak_bytes = 0;      // the most the shards took at once
  size_t cap_bytes = 0;       // the cap on the shards
  size_t over_cap = 0;        // files left out by the cap (their mappings count in failed)
  size_t failed = 0;          // mappings whose file could not be read or loaded
  double build_ms = 0;        // time spent building tables (parsing CFI)
  double load_ms = 0;         // time spent copying rows and adding shards
};

// Of the table's file mapped at `start` from file `offset`: what a runtime
// address less is a row's pc (the load bias + table.base); nullopt: no
// code of the file there (ld.so's reservation of a library's extent).
std::optional<uint64_t> row_bias(const CfiTable& table, uint64_t start, uint64_t offset);
// The file of pid's mapping m, exactly the mapped one (/proc/PID/map_files;
// its path under /proc/PID/root if that cannot be opened); *what names it
// for messages. Not valid: neither opened (errno says why).
Fd open_mapped_file(pid_t pid, const ProcMapping& m, std::string* what);

class UnwindMaps {
 public:
  // From the maps of a loaded skeleton (unwind_shards, unwind_procs).
  // unwind_epoch (may be null): set to a new value at every publish and
  // removal, so that the BPF walk memo, keyed by (tgid, epoch), never
  // replays a walk made with other tables. cap_bytes: the most the shards
  // may take together. The first shards are added here (before anything is
  // attached: adding one waits for an RCU grace period).
  static Result<std::unique_ptr<UnwindMaps>> create(const bpf_map* shards, const bpf_map* procs,
                                                    const bpf_map* epoch = nullptr,
                                                    size_t cap_bytes = kDefaultCapBytes);
  // From raw map fds (not owned) and the slots of `shards`.
  static Result<std::unique_ptr<UnwindMaps>> create_fds(int shards_fd, uint32_t max_shards, int procs_fd,
                                                        int epoch_fd = -1,
                                                        size_t cap_bytes = kDefaultCapBytes);
  static constexpr size_t kDefaultCapBytes = size_t(512) << 20;
  static constexpr uint32_t kShardRows = 1u << MT_UNWIND_SHARD_BITS;
  static constexpr size_t kShardBytes = size_t(kShardRows) * sizeof(mt_unwind_row);
  // 8 MiB, the old fixed array: python3 with its libraries several times over.
  static constexpr size_t kInitialShards = 4;
  static constexpr double kKeepSeconds = 60;
  ~UnwindMaps();
  UnwindMaps(const UnwindMaps&) = delete;
  UnwindMaps& operator=(const UnwindMaps&) = delete;

  // Loads tables for every executable file mapping of pid, from `maps` (the
  // caller's read of /proc/PID/maps) or read here (idempotent: a second call
  // picks up new mappings and drops gone ones).
  Result<void> add_process(pid_t pid, const std::vector<ProcMapping>* maps = nullptr);
  // The process mapped [start, end) of a file at `offset` executable (the
  // loader sees it as an mmap event). The file is opened through
  // /proc/PID/map_files (exactly the mapped file, any mount namespace);
  // `path` is only used in messages and as a fallback.
  Result<void> on_exec_mapping(pid_t pid, uint64_t start, uint64_t end, uint64_t offset,
                               const std::string& path = "");
  // The process exited (or its address space is gone after exec).
  void remove_process(pid_t pid);
  // unwind_files (bpf/unwind.bpf.h; -1: none): every loaded file's rows by
  // (dev, inode), for pcs no published mapping covers.
  void set_files_map(int fd) { files_fd_ = fd; }

  UnwindStats stats() const;
  const TableStore& store() const { return store_; }

 private:
  UnwindMaps() = default;
  struct FileKey {  // as the kernel names the file: i_sb->s_dev (MAJOR << 20 | MINOR), i_ino
    uint64_t dev = 0, ino = 0;
    bool operator==(const FileKey&) const = default;
  };
  struct Loaded {
    uint32_t first = 0;  // global row number
    uint32_t refs = 0;
    std::shared_ptr<const CfiTable> table;  // kept while loaded (refs 0: kept kKeepSeconds)
    std::chrono::steady_clock::time_point idle_since;
    std::vector<FileKey> files;  // its entries in unwind_files (one table, several inodes)
  };
  struct Shard {
    Fd fd;
    void* mem = nullptr;  // mmap of its kShardRows rows
  };
  struct Mapping {
    uint64_t start, end, bias;
    std::shared_ptr<const CfiTable> table;  // null: no CFI
    FileKey file;
  };
  // After load_rows: the file's entry in unwind_files (once per inode).
  void index_file(const Mapping& m);
  Result<void> add_mapping(pid_t pid, const ProcMapping& m, std::vector<Mapping>* out);
  Result<uint32_t> load_rows(const std::shared_ptr<const CfiTable>& t);
  void unref(const CfiTable* t);
  Result<void> publish(pid_t pid);
  Result<uint32_t> alloc(uint32_t n);
  void release(uint32_t first, uint32_t n);
  Result<void> add_shards(size_t k);
  // Frees the rows of tables no process uses (those idle kKeepSeconds, or
  // all with `all`), then drops empty shards at the end (beyond the first).
  void sweep(bool all);
  uint32_t space() const { return static_cast<uint32_t>(shards_.size()) * kShardRows; }

  int shards_fd_ = -1;
  uint32_t max_shards_ = 0;
  int procs_fd_ = -1;
  int epoch_fd_ = -1;
  int files_fd_ = -1;
  void bump_epoch(uint32_t gen);
  std::vector<Shard> shards_;
  std::map<uint32_t, uint32_t> free_;  // first -> count (coalesced), within space()
  size_t cap_bytes_ = 0, peak_bytes_ = 0;
  std::set<const CfiTable*> over_cap_said_;  // files whose rows did not fit (message given)
  double build_ms_ = 0, load_ms_ = 0;
  TableStore store_;
  std::map<const CfiTable*, Loaded> loaded_;
  std::map<pid_t, std::vector<Mapping>> procs_;
  size_t failed_ = 0;
  uint32_t gen_ = 0;  // mt_unwind_proc.gen of the last published value
};

}  // namespace memtrace::unwind
