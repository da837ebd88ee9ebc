// State of --track-allocs-from (see allocs.cpp).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>

#include "tracer.h"

namespace memtrace::singlestep {

struct Tracer::AllocState {
  enum Fn : uint8_t { kMalloc, kCalloc, kRealloc, kFree, kReturn };
  struct Pending {        // a call from FUNCTION waiting for its return
    Fn fn;
    uint64_t size = 0;
    uint64_t old_ptr = 0;  // realloc
    uint64_t ret_addr = 0;
  };
  uint64_t caller_lo = 0, caller_hi = 0;  // FUNCTION's range in the tracee
  std::map<uint64_t, Fn> entries;          // breakpoint address -> allocator function
  std::map<uint64_t, uint32_t> saved;      // breakpoint address -> original bytes (arch::kBreakpointLen)
  std::map<uint64_t, int> return_refs;     // return-address breakpoints in use
  std::map<pid_t, Pending> pending;
  uint64_t gate = 0;                       // FUNCTION's entry: install allocator breakpoints there
  bool installed = false;
};

}  // namespace memtrace::singlestep
