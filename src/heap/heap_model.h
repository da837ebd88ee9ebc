// The heap model: live blocks, mappings and counters per process, built from
// the ring-buffer records of bpf/memtrace.h. No BPF, no I/O: the loader feeds
// it, the reports read it.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "memtrace.h"

namespace memtrace::heap {

struct Block {
  uint64_t size = 0;
  uint64_t stack_id = 0;
  uint64_t ts = 0;
  bool touched = false;  // a page fault landed in it (fault tracking on)
};

struct Mapping {
  uint64_t len = 0;
  uint64_t stack_id = 0;
  bool allocator = false;  // mapped from inside an allocator call
  bool file = false;
  uint32_t prot = 0;
  uint32_t flags = 0;      // mmap flags (MAP_STACK: a thread stack)
  std::string path;        // file mappings: filled on the first fault (RegionLookup)
};

// ---- Page faults (issue 6): where a fault landed.
enum class Hit : uint8_t {
  Block,         // a live heap block: charged to its allocation stack
  Mmap,          // a direct mmap of the program (with its stack)
  AllocatorMap,  // memory the allocator mapped, outside any live block
  Heap,          // the brk heap, outside any live block
  Stack,         // the main thread's stack
  ThreadStack,   // a thread stack (MAP_STACK mapping or [stack:tid])
  File,          // a file mapping (path)
  Anon,          // other anonymous memory mapped before tracing started
  Other,         // [vdso], [vvar], ...
  Unmapped,      // no mapping: a crash (or stack growth)
};
const char* to_string(Hit);

struct FaultHit {
  Hit kind = Hit::Unmapped;
  uint64_t start = 0, end = 0;  // the block or mapping hit
  uint64_t stack_id = 0;        // Block: allocation stack; Mmap/ThreadStack: mmap's stack
  std::string path;             // File: the file; others: a /proc/PID/maps name when known
  bool first_touch = false;     // first fault on this page in this process
};

// What the loader knows from /proc/PID/maps for an address the model does not
// cover (mappings made before tracing, [heap], [stack], file paths).
// ts: when the fault happened (bpf_ktime_get_ns, CLOCK_MONOTONIC): a snapshot
// older than that may miss a mapping made since.
using RegionLookup = std::function<std::optional<FaultHit>(pid_t pid, uint64_t addr, uint64_t ts)>;
struct Process;
using FaultObserver = std::function<void(const Process&, const mt_event&, const FaultHit&)>;

struct FaultCounts {
  uint64_t total = 0, read = 0, write = 0, instr = 0;
  uint64_t pages_first_touched = 0;  // distinct pages that faulted (until unmapped)
  uint64_t access_errors = 0;        // answered with SIGSEGV: --rearm pages, or a crash
};

struct SiteFaults {
  uint64_t faults = 0, pages = 0, reads = 0, writes = 0;
  Hit kind = Hit::Block;  // by stack: Block (malloc family) or Mmap (direct mmap)
};

struct SiteAllocs {  // allocations by stack, kept while faults are traced
  uint64_t bytes = 0, blocks = 0, touched_blocks = 0;
};

struct Summary {
  uint64_t allocs = 0, frees = 0, bytes_allocated = 0;
  uint64_t in_use_bytes = 0, in_use_blocks = 0, peak_in_use_bytes = 0;
  uint64_t failed_allocs = 0;
  uint64_t mmap_bytes_allocator = 0, mmap_bytes_direct = 0;  // cumulative bytes mapped
  uint64_t mapped_now_allocator = 0, mapped_now_direct = 0;  // bytes mapped now
  uint64_t mmap_calls = 0, munmap_calls = 0, mremap_calls = 0, brk_calls = 0;
  uint64_t brk_start = 0, brk_now = 0;
  uint64_t unknown_frees = 0;     // free of a block never seen allocated
  uint64_t inherited_blocks = 0;  // live blocks copied from the parent at fork
};

struct Process {
  pid_t pid = 0;
  pid_t ppid = 0;
  std::string comm;
  std::optional<int> exit_code;  // wait-status style: code << 8 | signal
  bool exited = false;
  Summary s;
  std::unordered_map<uint64_t, Block> live;
  std::map<uint64_t, Mapping> maps;  // by start
  // realloc(p, n): p's block, parked from its free at entry until the return
  // says whether realloc succeeded.
  std::unordered_map<uint32_t, std::pair<uint64_t, Block>> realloc_parked;

  // Page faults (only with fault tracking on).
  FaultCounts f;
  std::unordered_map<uint64_t, SiteFaults> fault_stacks;  // Block and stacked Mmap hits by stack
  std::map<std::string, SiteFaults> fault_regions;        // other hits by region label
  std::unordered_map<uint64_t, SiteAllocs> alloc_sites;   // bytes allocated (or mmap'd) by stack
  std::set<uint64_t> touched;                             // pages that faulted
  std::map<uint64_t, uint64_t> live_index;                // live block start -> end
  uint64_t exec_ts = 0;     // last exec seen: faults from before it belong to the old image
  uint32_t exec_count = 0;  // execs seen (a /proc/PID/maps snapshot from before is stale)
};

struct Stack {
  std::vector<uint64_t> ips;
  bool truncated = false;
};

class HeapModel {
 public:
  HeapModel();
  // One record from the events ring buffer (mt_event or mt_stack).
  void apply(const void* data, size_t len);

  Process& process(pid_t pid);
  Process* find(pid_t pid);
  const std::map<pid_t, std::unique_ptr<Process>>& processes() const { return procs_; }
  const Stack* stack(uint64_t id) const;

  void on_fork(pid_t parent, pid_t child);  // child inherits the parent's live blocks
  void on_exit(pid_t pid, int code);
  void on_exec(pid_t pid, uint64_t ts = 0);  // the old image's heap is gone with it (ts: of the exec)
  void clear(pid_t pid);  // console 'clear': forget counters and blocks

  // Page-fault attribution (--faults): keeps live blocks in address order too.
  // Turn on before the first record.
  void enable_faults(RegionLookup lookup, FaultObserver observer = {});
  bool faults_enabled() const { return faults_; }
  // The block or mapping containing addr (no counting).
  FaultHit attribute(Process& p, uint64_t addr, uint64_t ts = 0);

  uint64_t malformed_records() const { return malformed_; }
  uint64_t missing_stacks() const { return missing_stacks_; }
  uint64_t event_count() const { return events_; }
  uint64_t faults_before_exec() const { return faults_before_exec_; }

 private:
  void alloc(Process& p, const mt_event& e);
  void free_block(Process& p, const mt_event& e);
  void mmap(Process& p, const mt_event& e);
  void munmap(Process& p, uint64_t addr, uint64_t len);
  void fault(Process& p, const mt_event& e);
  void index_add(Process& p, uint64_t addr, uint64_t size);
  void index_del(Process& p, uint64_t addr);
  void forget_pages(Process& p, uint64_t addr, uint64_t len);

  std::map<pid_t, std::unique_ptr<Process>> procs_;
  std::unordered_map<uint64_t, Stack> stacks_;
  Process* last_ = nullptr;
  uint64_t malformed_ = 0, missing_stacks_ = 0, events_ = 0;
  bool faults_ = false;
  uint64_t faults_before_exec_ = 0;
  RegionLookup lookup_;
  FaultObserver observer_;
};

// Label of a non-block hit, as shown in reports: "[heap]", "file /path", ...
std::string region_label(const FaultHit& h);

}  // namespace memtrace::heap
