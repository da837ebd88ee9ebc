// Reports: heap summary per process (seed 004's words), leaks grouped by
// stack, drop counters. Text and JSON from one data model.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "heap/heap_model.h"

namespace memtrace::report {

struct FrameOut {
  uint64_t address = 0;
  std::string function;  // "" if unknown
  uint64_t offset = 0;
  std::string module;
  uint64_t module_offset = 0;  // file offset of the address looked up in module
  std::string file;
  int line = 0;
  int column = 0;  // 0: unknown
  bool inlined = false;
  std::string unknown;  // reason when nothing is known
  // Not a return address (a raw stack's frame after a walk went wrong:
  // ImageMap::follows_call): frames_of cuts the stack before it.
  bool untrusted = false;
};

// How many of a stack's addresses to keep, each resolved (innermost first):
// heap::trusted_frames over FrameOut::untrusted (an untrusted frame in no
// mapping is Unmapped).
size_t trusted_addresses(const std::vector<std::vector<FrameOut>>& resolved);

// Symbolize one frame of a stack of image p (return_address: look up
// address-1): an address in p's mappings (raw stacks: loc is null), or a
// location (sealed stacks; address is where it was in p, for show).
using Resolver = std::function<std::vector<FrameOut>(const heap::Process& p, uint64_t address, const heap::Loc* loc,
                                                     bool return_address)>;
// The frames of stack st of image p, one Resolver call each (every recorded
// frame is a return address: the caller's call site).
template <class F>
void for_each_frame(const heap::Process& p, const heap::Stack& st, F&& f) {
  if (st.sealed)
    for (const heap::Loc& l : st.locs) f(heap::address_of(p, l), &l);
  else
    for (uint64_t ip : st.ips) f(ip, static_cast<const heap::Loc*>(nullptr));
}

struct Options {
  size_t top = 10;          // leak groups per process
  bool at_exit = true;      // "in use at exit" vs "in use"
  bool leaks = true;
  bool include_idle = false;  // processes with no allocator activity
  bool stats = false;         // the text report's STATS line (-v; JSON always has "stats")
};

struct Drops {
  std::map<std::string, uint64_t> dropped;  // lost events by cause
  std::map<std::string, uint64_t> stats;    // informational counters
};

struct LeakGroup {
  uint64_t bytes = 0, blocks = 0, stack_id = 0;
  uint64_t untouched_blocks = 0;  // no page fault landed in them (--faults)
  uint64_t python_blocks = 0;     // of blocks: the python domain's (pymalloc); not kept once sealed
};
std::vector<LeakGroup> leak_groups(const heap::Process& p);

// Page faults by allocation stack (--faults): pages first touched, and the
// bytes allocated from the same stack.
struct FaultSite {
  uint64_t stack_id = 0;
  heap::SiteFaults faults;
  heap::SiteAllocs allocs;
};
std::vector<FaultSite> fault_sites(const heap::Process& p);          // most pages first
std::vector<FaultSite> alloc_sites_by_bytes(const heap::Process& p);  // most bytes first
std::vector<std::pair<std::string, heap::SiteFaults>> fault_regions(const heap::Process& p);
void write_faults_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                       size_t top);
nlohmann::json faults_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, size_t top);
// The frames of a stack, innermost first (inlined frames before the function
// they were inlined into); *truncated: the stack was cut short.
std::vector<FrameOut> frames_of(const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                                uint64_t stack_id, bool* truncated);
nlohmann::json frames_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, uint64_t stack_id,
                           bool* truncated);

// ---- Analyses (issue 19): what heaptrack_print and memray show beside leaks.
// Stacks of p whose field (&heap::StackAllocs::peak_bytes, ::temporary,
// ::allocs, ...) is not 0, largest first (ties: by stack id).
std::vector<std::pair<uint64_t, const heap::StackAllocs*>> stacks_by(const heap::Process& p,
                                                                      uint64_t heap::StackAllocs::*field);
// Seconds p was traced (first to last record); 0 with fewer than two.
double traced_seconds(const heap::Process& p);
// n per traced second of p (0 when traced_seconds is 0).
double per_second(const heap::Process& p, uint64_t n);
// How many of a stack's frames the text report shows: up to main, as
// valgrind (--show-below-main=no): what is under it (__libc_start_call_main,
// __libc_start_main, _start) is the same in every stack. JSON, folded,
// pprof and HTML keep every frame.
size_t text_frames(const std::vector<FrameOut>& fs);
// A stack on one line, innermost first: "f (file.c:12) < g (file.c:30) < ...",
// at most max_frames frames.
std::string stack_line(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, uint64_t stack_id,
                       size_t max_frames = 4);
// The analyses of p (per process JSON "analysis"): temporary, peak, churn with
// their top stacks, lifetimes, timeline, and the spans of the stacks listed.
nlohmann::json analysis_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, size_t top);
// Their text: the PEAK, MOST TEMPORARY ALLOCATIONS and MOST ALLOCATIONS
// sections, one line per stack (top of each).
void write_analysis_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                         size_t top);

void write_summary_text(std::ostream& os, const heap::Process& p, bool at_exit);
// A process's container (procfs::container_of its cgroup) as JSON: {"id",
// "runtime", "pod"}, or null when its cgroup names none.
nlohmann::json container_json(const std::string& cgroup);
// The text report's tail: DROPPED with each counter that is not 0 and what
// it means for the figures above it, else "nothing dropped"; STATS (the
// tool's own counters) when stats. JSON has every counter, always.
void write_tail_text(std::ostream& os, const Drops& d, bool stats);
void write_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                const Drops& d);
nlohmann::json to_json(const heap::HeapModel& m, const Resolver& r, const Options& o, const Drops& d);

// JSON text of j: comms, paths and arguments are bytes, not always UTF-8;
// invalid sequences become U+FFFD instead of an exception (nlohmann's dump
// throws type_error 316). Every JSON the tool writes goes through this.
std::string json_text(const nlohmann::json& j, int indent = -1);

}  // namespace memtrace::report
