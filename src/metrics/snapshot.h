// What one /metrics scrape shows, copied from the heap model by the drain
// thread (the only thread that touches the model) and handed to the metrics
// server's thread: plain numbers and strings, nothing shared.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "heap/heap_model.h"
#include "report/report.h"

namespace memtrace::metrics {

// One series key: a process (pid) under one command name. The images of a
// pid that share a name (an exec of the same program, a pid reused by a
// program of that name) are one series: counters summed over them, gauges
// from the newest. An exec into another program starts a new series; the
// old one goes as an exited process does.
struct ProcessSample {
  pid_t pid = 0;
  std::string comm;  // valid UTF-8 (a label value must be)
  std::string cgroup, container_id;  // of the newest image ("": not known, none)
  bool gone = false;  // exited, or exec'd into another program
  // gauges
  uint64_t in_use_bytes = 0, in_use_blocks = 0, peak_bytes = 0;
  uint64_t mapped_allocator = 0, mapped_program = 0;  // bytes mapped now
  // counters
  uint64_t allocs = 0, frees = 0, bytes_allocated = 0, failed_allocs = 0;
  uint64_t mmap_allocator = 0, mmap_program = 0;  // bytes mapped, in all
  uint64_t faults = 0, pages_touched = 0;         // --faults
  // The allocator domains (issue 32): malloc's and CPython's pymalloc (of the totals above).
  uint64_t in_use_malloc = 0, in_use_python = 0;  // bytes, gauges
  uint64_t allocs_malloc = 0, allocs_python = 0;  // counters
};

struct Snapshot {
  std::vector<ProcessSample> processes;  // by pid, then name
  report::Drops drops;                   // the report's DROPPED and STATS
  bool faults = false;                   // --faults: the fault series exist
  std::chrono::steady_clock::time_point taken{};
};

struct SnapshotOptions {
  bool faults = false;
  bool include_idle = false;  // processes that did nothing (-p, -c, launch: yes; system-wide: no)
};
Snapshot snapshot_of(const heap::HeapModel& m, report::Drops drops, const SnapshotOptions& o);

// s with every invalid UTF-8 sequence replaced by U+FFFD.
std::string valid_utf8(const std::string& s);

}  // namespace memtrace::metrics
