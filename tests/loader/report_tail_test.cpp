// The text report's tail (report::write_tail_text): DROPPED only when
// something was dropped, each counter that is not 0 with what it means for
// the figures above it, else one line "nothing dropped"; STATS only under -v.
// JSON has every counter, zeros included, always.
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

#include "harness.h"
#include "report/report.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

std::string tail(const memtrace::report::Drops& d, bool stats) {
  std::ostringstream os;
  memtrace::report::write_tail_text(os, d, stats);
  return os.str();
}

TEST(ReportTail, NothingDroppedIsOneLine) {
  memtrace::report::Drops d;
  d.dropped = {{"ringbuf", 0}, {"malformed", 0}, {"attach_failed", 0}};
  d.stats = {{"events", 5662}, {"unwind_memo_hits", 7}};
  EXPECT_EQ(tail(d, false), "nothing dropped\n");
  EXPECT_EQ(tail(d, true), "nothing dropped\nSTATS: events=5662 unwind_memo_hits=7\n");
  d.dropped.clear();
  EXPECT_EQ(tail(d, false), "nothing dropped\n");
}

TEST(ReportTail, DroppedListsWhatIsNotZeroAndWhatItMeans) {
  memtrace::report::Drops d;
  d.dropped = {{"ringbuf", 12}, {"malformed", 0}, {"stack_missing", 3}, {"a_new_counter", 1}};
  d.stats = {{"events", 10}};
  EXPECT_EQ(tail(d, false),
            "DROPPED: a_new_counter=1 ringbuf=12 stack_missing=3\n"
            "    a_new_counter: events lost (docs/usage.md): the figures above may be low\n"
            "    ringbuf: allocator/mmap events lost, the ring buffer full (--ringbuf-mb): counts may be low, a "
            "lost free shows as a leak\n"
            "    stack_missing: stacks the kernel returned empty: those allocations are counted, under "
            "\"(no stack)\"\n");
  std::string v = tail(d, true);
  EXPECT_EQ(v.substr(v.rfind("STATS:")), "STATS: events=10\n");
}

class ReportTailRun : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// The demo (scripts/demo.sh's command): the report ends with "nothing
// dropped" and no STATS; -v adds STATS; JSON has both, zeros included.
TEST_F(ReportTailRun, DemoEndsWithNothingDroppedAndStatsUnderVerbose) {
  ToolRun r = run_argv({tool(), "--", target("demo_target"), "1000"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("HEAP SUMMARY"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\nnothing dropped\n"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("DROPPED"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("STATS"), std::string::npos) << r.err;
  // Text stacks end at main, as valgrind's (report::text_frames): the
  // frames under it are the same in every stack. The demo's whole report,
  // summary, 4 leaks and the analyses, is 61 lines (with its own output line).
  EXPECT_NE(r.err.find("main+0x"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("__libc_start_call_main"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("_start+"), std::string::npos) << r.err;
  EXPECT_LE(std::count(r.err.begin(), r.err.end(), '\n'), 62) << r.err;

  r = run_argv({tool(), "-v", "--", target("demo_target"), "1000"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("\nnothing dropped\nSTATS: "), std::string::npos) << r.err;
  size_t st = r.err.find("\nSTATS: ");
  ASSERT_NE(st, std::string::npos);
  std::string stats = r.err.substr(st, r.err.find('\n', st + 1) - st);
  EXPECT_NE(stats.find(" events="), std::string::npos) << stats;
  EXPECT_NE(stats.find(" attach_processes=1"), std::string::npos) << stats;

  r = run_tool({"--", target("demo_target"), "1000"});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(r.report.contains("dropped") && r.report.contains("stats")) << r.report.dump();
  EXPECT_EQ(r.report["dropped"]["ringbuf"], 0) << r.report["dropped"].dump();
  EXPECT_EQ(r.report["dropped"]["attach_failed"], 0) << r.report["dropped"].dump();
  EXPECT_GT(r.report["stats"]["events"].get<long>(), 0) << r.report["stats"].dump();
  EXPECT_EQ(r.report["stats"]["attach_processes"], 1) << r.report["stats"].dump();
  // JSON keeps every frame, those under main too.
  const json* p = find_comm(r.report, "demo_target");
  ASSERT_TRUE(p && !(*p)["leaks"].empty()) << r.report.dump();
  bool below_main = false;
  for (const auto& f : (*p)["leaks"][0]["stack"]) below_main = below_main || f.value("function", "") == "__libc_start_call_main";
  EXPECT_TRUE(below_main) << (*p)["leaks"][0].dump();
}

}  // namespace
