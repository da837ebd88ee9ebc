// The heap model: live blocks, mappings and counters per process, built from
// the ring-buffer records of bpf/memtrace.h. No BPF, no I/O: the loader feeds
// it, the reports read it.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "memtrace.h"

namespace memtrace::heap {

struct Block {
  uint64_t size = 0;
  uint64_t stack_id = 0;
  uint64_t ts = 0;
};

struct Mapping {
  uint64_t len = 0;
  uint64_t stack_id = 0;
  bool allocator = false;  // mapped from inside an allocator call
  bool file = false;
  uint32_t prot = 0;
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
  void on_exec(pid_t pid);  // the old image's heap is gone with it
  void clear(pid_t pid);  // console 'clear': forget counters and blocks

  uint64_t malformed_records() const { return malformed_; }
  uint64_t missing_stacks() const { return missing_stacks_; }
  uint64_t event_count() const { return events_; }

 private:
  void alloc(Process& p, const mt_event& e);
  void free_block(Process& p, const mt_event& e);
  void mmap(Process& p, const mt_event& e);
  void munmap(Process& p, uint64_t addr, uint64_t len);

  std::map<pid_t, std::unique_ptr<Process>> procs_;
  std::unordered_map<uint64_t, Stack> stacks_;
  Process* last_ = nullptr;
  uint64_t malformed_ = 0, missing_stacks_ = 0, events_ = 0;
};

}  // namespace memtrace::heap
