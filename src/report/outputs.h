// Which report goes to which -o file (issue 19): -o may be given several
// times, each file's format follows --format when given, else its extension.
// Also what the folded and pprof writers share: per stack counts.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "common/result.h"
#include "heap/heap_model.h"
#include "report/report.h"

namespace memtrace::report {

enum class Format { Text, Json, Folded, Pprof, Html };
const char* to_string(Format);
std::optional<Format> format_named(const std::string& name);        // "text", "json", "folded", "pprof", "html"
std::optional<Format> format_of_extension(const std::string& path);  // .txt .json .folded .pb.gz .html

struct OutputSpec {
  std::string path;  // "" : the default stream (stdout, or stderr in launch mode)
  Format format = Format::Text;
};

// The outputs of one run from the -o FILEs and --format ("" when not given).
// No -o: one output, the default stream, --format or text. One -o: its
// --format, else its extension, else text (as before several were allowed).
// Several: --format (an extension naming another format is an error), else
// each extension, which must be known.
// Errors are one line without the "memtrace-bpf: " prefix.
Result<std::vector<OutputSpec>> plan_outputs(const std::vector<std::string>& paths, const std::string& format);

// The first text or JSON output: where --trace, --interval and the console
// write, and the format they use. nullptr when every output is a profile.
const OutputSpec* primary_output(const std::vector<OutputSpec>& outs);

// The value of a folded line (--folded-value).
enum class FoldedValue { LiveBytes, AllocBytes, AllocCount, LiveBlocks };
std::optional<FoldedValue> folded_value_named(const std::string& name);  // live_bytes alloc_bytes alloc_count live_blocks

// Counts of one allocation stack in one process (image).
struct StackCounts {
  uint64_t stack_id = 0;
  uint64_t live_bytes = 0, live_blocks = 0;  // at the end (sum: in_use_bytes / in_use_blocks)
  uint64_t alloc_bytes = 0, alloc_count = 0;  // every allocation from it while traced
  bool python = false;                        // the python domain's (heap::StackAllocs::python)
};
// Every stack of p with anything to count, by stack id.
std::vector<StackCounts> stack_counts(const heap::Process& p);

struct ProfileOptions {
  FoldedValue folded = FoldedValue::LiveBytes;
  // pprof: the GNU build-id of a module (path) in hex, "" when it has none.
  std::function<std::string(const std::string& module)> build_id;
  int64_t duration_nanos = 0;  // pprof: how long the trace ran
};
// A folded or pprof output (f) to os; text and JSON are the caller's (they
// carry what the tracer or replay adds). "write failed" and the like.
Result<void> write_profile(std::ostream& os, Format f, const heap::HeapModel& m, const Resolver& r,
                           const Options& o, const ProfileOptions& po);

}  // namespace memtrace::report
