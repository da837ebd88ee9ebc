// pprof (`.pb.gz`): a gzip'd profile.proto (github.com/google/pprof,
// proto/profile.proto) written by hand: sample types alloc_objects/count,
// alloc_space/bytes, inuse_objects/count, inuse_space/bytes (the default);
// one sample per allocation stack per process with pid and comm labels;
// mappings with build-ids and file offsets, functions, and locations whose
// lines are the inlined frames, innermost first.
#pragma once
#include <functional>
#include <ostream>
#include <string>
#include <unordered_map>
#include <utility>

#include "common/result.h"
#include "report/outputs.h"
#include "report/report.h"

namespace memtrace::report {

struct PprofOptions {
  // The GNU build-id of a module (path) in hex, "" when it has none.
  std::function<std::string(const std::string& module)> build_id;
  int64_t time_nanos = 0;      // when the profile was taken (CLOCK_REALTIME)
  int64_t duration_nanos = 0;  // how long the trace ran
  // Continuous profiles (--pprof-dir): only this image (null: every image),
  // and by stack id the (allocations, bytes) to subtract from each stack's
  // alloc counts, those of the previous file (alloc_* are then the
  // allocations since it; a count below its base restarted: console clear).
  const heap::Process* only = nullptr;
  const std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>>* alloc_base = nullptr;
};

// The profile, not compressed (tests decode it).
std::string pprof_profile(const heap::HeapModel& m, const Resolver& r, const Options& o, const PprofOptions& po);
Result<std::string> gzip(const std::string& data);
// gzip(pprof_profile(...)) to os.
Result<void> write_pprof(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                         const PprofOptions& po);

}  // namespace memtrace::report
