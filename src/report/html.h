// The HTML report (`-o report.html`, --format html; issue 19): one page that
// works offline (its scripts and styles are inlined: d3 and d3-flame-graph
// from npm, built into the program by src/report/html/). Per process image:
// a flame graph switchable between live bytes at the end, bytes allocated,
// allocation count (and, when the model has them, live bytes at the peak,
// temporary allocations, pages touched with --faults), memory over time
// whose brushed range filters the flame graph, the peak, leaks, temporary
// allocations, lifetimes and churn. The page draws all of it from one JSON
// object, html_data(), that this file writes into it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>

#include "common/result.h"
#include "heap/heap_model.h"
#include "report/diff.h"
#include "report/report.h"

namespace memtrace::report {

struct HtmlOptions {
  // Stacks kept per process image: those with the largest share of any
  // value; the others are folded into one frame "(other N stacks)" with
  // their summed values, so every total stays exact. With many images each
  // gets max_stacks_total / images (at least min_stacks).
  size_t max_stacks = 2000;
  size_t max_stacks_total = 10000;
  size_t min_stacks = 20;
  // Allocation spans (the time-range filter) per image: time buckets are
  // merged in pairs until there are at most this many.
  size_t max_spans = 50000;
  int64_t duration_nanos = 0;         // how long the trace ran (0: unknown)
};

// What the page draws. Frames and strings are tables shared by the images;
// a stack is a list of frame indexes, outermost first; values are columns
// indexed like the stacks (see app.js for every field's use).
nlohmann::json html_data(const heap::HeapModel& m, const Resolver& r, const Options& o, const HtmlOptions& ho);

// The page with html_data() in it. "write failed" when os fails.
Result<void> write_html(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                        const HtmlOptions& ho);

// The diff page (`memtrace-bpf diff A B -o d.html`, src/report/html/diff.js),
// of d made by diff_sides(..., every_stack): per group (a program), the
// stacks of either side with their values in A and in B for the
// differential flame graph, and diff_json's group whose sections' rows name
// their stack by its index among them. The stacks that changed the most are
// kept whole (ho's caps, per group as per image), with every row a section
// lists; the others are added up in one frame "(N other stacks)".
nlohmann::json diff_html_data(const Diff& d, const HtmlOptions& ho);
Result<void> write_diff_html(std::ostream& os, const Diff& d, const HtmlOptions& ho);

}  // namespace memtrace::report
