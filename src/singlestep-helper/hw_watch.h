// Fast path: up to four aligned 1/2/4/8-byte words watched with hardware
// breakpoints (perf_event_open PERF_TYPE_BREAKPOINT, one event per thread and
// word). No page protection, no single-step: the tracee runs at full speed and
// the kernel writes one sample per access into a ring buffer.
//
// x86 has no read-only watchpoint. With at most two words each word gets a
// write (W) and a read-or-write (RW) breakpoint, so a sample pair W+RW is a
// write and RW alone a read. With three or four words only RW fits in the four
// debug registers and accesses are reported as "read-write" (read or write).
// x86 data breakpoints trap after the instruction: the ip reported is the
// address of the next instruction. arm64 watchpoints trap before it (the
// kernel steps over it for perf): the ip is the access's own. The size is the
// watched word's on both.
#pragma once
#include <sys/types.h>

#include <map>
#include <vector>

#include "common/fd.h"
#include "common/result.h"
#include "process_maps.h"
#include "report.h"

namespace memtrace::singlestep {

class HwWatch {
 public:
  explicit HwWatch(std::vector<Region> regions);
  ~HwWatch();
  static bool eligible(const std::vector<Region>& regions);
  Result<void> add_thread(pid_t tid);
  void remove_thread(pid_t tid);
  // Move samples from the ring buffers into the report.
  void drain(Report& report, ProcessSymbols& syms, uint64_t max, bool final = false);

 private:
  struct Event {
    Fd fd;
    void* ring = nullptr;
    size_t ring_size = 0;
    bool owner = false;  // this event owns the ring buffer (others redirect into it)
  };
  struct Sample {
    uint64_t id, ip, time;
    uint32_t tid;
    uint64_t addr;
  };
  std::vector<Region> regions_;
  bool paired_ = false;
  std::map<pid_t, std::vector<Event>> threads_;
  std::map<uint64_t, std::pair<size_t, bool>> ids_;  // perf id -> (region, is write-only event)
  std::vector<Sample> pending_;
};

}  // namespace memtrace::singlestep
