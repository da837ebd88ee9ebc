// Page-fault tracing in the loader (--faults, --trace-faults, --rearm): what
// the heap model cannot know by itself (mappings from /proc/PID/maps), the
// per-fault trace line, and the memtrace-singlestep page-mode helper that
// re-arms chosen ranges.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <functional>
#include <string>
#include <vector>

#include "common/result.h"
#include "heap/heap_model.h"
#include "loader/resolver.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {

// A /proc/PID/maps line as a fault attribution: [heap], [stack], a thread
// stack ([stack:TID]), a file, anonymous memory, [vdso]...
heap::FaultHit classify_mapping(const symbolize::MappingInfo& m);

// Snapshots of /proc/PID/maps, taken again when the last one is older than
// the fault being attributed (so at most once per drained batch of faults per
// process). Kept after the process exits: faults drained after the exit are
// attributed from the last snapshot (mappings made after it are unknown).
class MapsCache {
 public:
  // generation: the process's exec count (a snapshot of the old image is dropped).
  std::optional<heap::FaultHit> lookup(pid_t pid, uint64_t addr, uint64_t ts, uint32_t generation = 0);
  void forget(pid_t pid) { snaps_.erase(pid); }
  uint64_t reads() const { return reads_; }

 private:
  struct Snap {
    std::vector<symbolize::MappingInfo> maps;  // sorted by start
    uint64_t taken_ns = 0;
    uint32_t generation = 0;
  };
  std::map<pid_t, Snap> snaps_;
  uint64_t reads_ = 0;
};

// One line per fault (--trace-faults), seed 003's columns plus what was hit.
class FaultTrace {
 public:
  // out: where the lines go, asked per line (the report's output: -o FILE is
  // opened after the tracer is made).
  FaultTrace(std::function<std::ostream&()> out, bool json, Resolver& r, const heap::HeapModel& m)
      : out_(std::move(out)), json_(json), r_(r), m_(m) {}
  void header();
  void line(const heap::Process& p, const mt_event& e, const heap::FaultHit& h);

 private:
  std::string function_at(const heap::Process& p, uint64_t addr, bool return_address);
  std::function<std::ostream&()> out_;
  bool json_;
  Resolver& r_;
  const heap::HeapModel& m_;
};

// --range START-END (hex or decimal), or --range ADDR: the live block that
// contains ADDR (blocks allocated while tracing).
struct AddrRange {
  uint64_t start = 0, end = 0;
  std::string spec;  // as the user wrote it
};
Result<AddrRange> parse_range(const std::string& spec);
// Every page of the range must be mapped and accessible in pid.
Result<void> check_mapped(pid_t pid, const AddrRange& r);

// memtrace-singlestep in page mode on one process, for --rearm.
class RearmHelper {
 public:
  ~RearmHelper();
  // Starts the helper and waits until the ranges are armed.
  Result<void> start(pid_t pid, const std::vector<AddrRange>& ranges, double interval_ms);
  // SIGINT: it restores every protection and writes its report; returns it.
  nlohmann::json stop();
  bool running() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
  std::string report_path_;
  nlohmann::json report_;
};

// Path of memtrace-singlestep next to this binary (installed) or in the build tree.
std::string singlestep_helper_path();

}  // namespace memtrace::loader
