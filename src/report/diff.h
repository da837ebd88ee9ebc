// What grew and what shrank between two states of the heap, by allocation
// stack (issue 19): `memtrace-bpf diff A B` of two recordings or two JSON
// reports, and the console's `snapshot` then `diff`.
//
// Two runs are matched by command name, and their stacks by symbolized
// frames, never by address (ASLR moves every module between runs): a frame
// is its function with its source file and line (DiffMatch::Line), or its
// function only (DiffMatch::Function: across a rebuild that moved lines),
// with its module's file name; an unnamed frame is module+file offset.
// The console compares one run with itself: processes by pid, stacks by id.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/result.h"
#include "heap/heap_model.h"
#include "report/report.h"

namespace memtrace::report {

enum class DiffMatch { Line, Function };

struct DiffCounts {
  int64_t live_bytes = 0, live_blocks = 0;  // in use
  int64_t allocs = 0, alloc_bytes = 0;      // allocator calls from the stack
};

struct DiffTotals {  // one side of a group: its processes' summaries added up
  int64_t processes = 0, in_use_bytes = 0, in_use_blocks = 0, allocs = 0, frees = 0, bytes_allocated = 0;
};

struct DiffRow {
  DiffCounts a, b;
  std::vector<FrameOut> frames;  // innermost first
  bool truncated = false;
};

// The rows of one kind, the largest change first: `rows` holds the first
// --top of them, `total` counts them all and `delta` adds up all of them.
struct DiffSection {
  std::vector<DiffRow> rows;
  size_t total = 0;
  DiffCounts delta;  // b - a
};

struct DiffGroup {
  std::string label;               // the command name; the console: "pid N (comm)"
  std::vector<pid_t> a_pids, b_pids;
  DiffTotals a, b;
  bool allocs_by_stack = true;  // both sides count allocations per stack (a JSON report does not)
  DiffSection grew;    // more bytes (or blocks) in use
  DiffSection shrank;  // fewer
  DiffSection churn;   // in use unchanged, allocations changed
  // Only from diff_sides(..., every_stack) (the HTML page's flame graph):
  // every stack of either side, the unchanged ones too, and which of them
  // the sections' rows are, in order (grew's, then shrank's, then churn's).
  std::vector<DiffRow> stacks;
  std::vector<size_t> shown;
};

struct Diff {
  std::string a_name, b_name;
  DiffMatch match = DiffMatch::Line;
  bool console = false;  // snapshot/diff in one run
  std::vector<DiffGroup> groups;  // the largest change in use first
  std::vector<std::string> notes;  // what could not be compared
};

// ---- diff A B
// One side: per command name, every stack with its counts, keyed by its frames.
struct DiffSide {
  struct Stack {
    DiffCounts c;
    std::vector<FrameOut> frames;
    bool truncated = false;
  };
  struct Group {
    std::vector<pid_t> pids;
    DiffTotals t;
    std::map<std::string, Stack> stacks;
    bool allocs_by_stack = true;
    size_t listed = 0, total = 0;  // leak groups listed and in all (a JSON report's --top)
  };
  std::string name;  // the file, as given
  std::map<std::string, Group> groups;
  std::vector<std::string> notes;
};
// Every active image of a heap model (a replayed recording), every stack symbolized.
DiffSide diff_side(const heap::HeapModel& m, const Resolver& r, DiffMatch match, const std::string& name);
// A JSON report (memtrace-bpf -o x.json, replay --format json): the leak
// groups it lists; allocations per stack are not in it. An error if j is not one.
Result<DiffSide> diff_side(const nlohmann::json& j, DiffMatch match, const std::string& name);
Diff diff_sides(const DiffSide& a, const DiffSide& b, DiffMatch match, size_t top, bool every_stack = false);

// ---- the console: snapshot, later diff
struct HeapSnapshot {
  struct Proc {
    DiffTotals t;
    std::unordered_map<uint64_t, DiffCounts> stacks;  // by stack id
  };
  std::map<std::pair<pid_t, std::string>, Proc> procs;  // by pid and command name
};
HeapSnapshot snapshot_heap(const heap::HeapModel& m);
// The model now against s: only the rows shown are symbolized.
Diff diff_since(const HeapSnapshot& s, const heap::HeapModel& m, const Resolver& r, size_t top);

void write_diff_text(std::ostream& os, const Diff& d);
nlohmann::json diff_json(const Diff& d);

}  // namespace memtrace::report
