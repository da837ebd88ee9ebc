// Folded stacks (`.folded`): one line per distinct stack per process,
// `comm (pid);outermost;...;innermost value`, as flamegraph.pl, inferno and
// speedscope read them.
#pragma once
#include <optional>
#include <ostream>
#include <string>

#include "report/outputs.h"
#include "report/report.h"

namespace memtrace::report {

// A frame's name in a folded line: ';' and line breaks would split it, so
// they (and '%', so that it reads back) are written %3B, %0A, %0D, %25.
std::string folded_escape(const std::string& name);

// Processes as in to_json (o.include_idle); lines with value 0 are left out.
// Inlined frames are frames of their own; an unnamed frame is
// "[module+0xoffset]" (or "[0xaddress]").
void write_folded(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                  FoldedValue value);

}  // namespace memtrace::report
