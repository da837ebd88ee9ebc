// The analyses heaptrack and memray users expect (issue 19): temporary
// allocations, the peak with its stacks, lifetimes, churn, memory over time
// and the spans of the temporal flame graph, on tests/targets/analysis_target
// (which knows its numbers), in the JSON and text reports of a trace and of
// `replay` of its recording; and against heaptrack itself on the same target.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <regex>

#include "harness.h"
#include "slurp.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

// What the target printed: "analysis keep=200 temp=1000 ..." and "peak_window A B".
struct Expected {
  long keep = 0, temp = 0, thread_temp = 0, pairs = 0, peak_big = 0, peak_small = 0, hold_ms = 0;
  unsigned long long before = 0, after = 0;
};
Expected parse_expected(const std::string& out) {
  Expected e;
  auto at = out.find("analysis ");
  if (at != std::string::npos)
    sscanf(out.c_str() + at,
           "analysis keep=%ld temp=%ld thread_temp=%ld pairs=%ld peak_big=%ld peak_small=%ld hold_ms=%ld", &e.keep,
           &e.temp, &e.thread_temp, &e.pairs, &e.peak_big, &e.peak_small, &e.hold_ms);
  at = out.find("peak_window ");
  if (at != std::string::npos) sscanf(out.c_str() + at, "peak_window %llu %llu", &e.before, &e.after);
  return e;
}

// The entry of list (analysis.peak.stacks, ...) whose innermost frame is fn.
const json* by_function(const json& list, const std::string& fn) {
  for (const auto& e : list)
    if (!e["stack"].empty() && e["stack"][0]["function"] == fn) return &e;
  return nullptr;
}

class Analysis : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    dir_ = "/tmp/memtrace-analysis-" + std::to_string(getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) (void)!system(("rm -rf " + dir_).c_str());
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

// Everything the target knows, in one process of a JSON report.
void check_analysis(const json& p, const Expected& x) {
  const json& s = p["summary"];
  const json& a = p["analysis"];
  // Temporary allocations: exactly the target's, per stack and in total.
  EXPECT_EQ(s["temporary_allocs"], x.temp + x.thread_temp);
  EXPECT_EQ(a["temporary_allocs"], x.temp + x.thread_temp);
  const json* t = by_function(a["temporary"]["stacks"], "temp_site");
  ASSERT_NE(t, nullptr) << a["temporary"].dump();
  EXPECT_EQ((*t)["temporary"], x.temp);
  EXPECT_EQ((*t)["allocs"], x.temp);
  if (x.thread_temp) {
    const json* tt = by_function(a["temporary"]["stacks"], "thread_temp");
    ASSERT_NE(tt, nullptr) << a["temporary"].dump();
    EXPECT_EQ((*tt)["temporary"], x.thread_temp);
  }
  // Churn: every stack with its allocations; pair_a/pair_b are never temporary.
  for (const char* fn : {"pair_a", "pair_b"}) {
    const json* c = by_function(a["churn"]["stacks"], fn);
    ASSERT_NE(c, nullptr) << fn << " " << a["churn"].dump();
    EXPECT_EQ((*c)["allocs"], x.pairs) << fn;
    EXPECT_EQ((*c)["temporary"], 0) << fn;
  }
  const json* ct = by_function(a["churn"]["stacks"], "temp_site");
  ASSERT_NE(ct, nullptr);
  double traced = a["traced_s"];
  ASSERT_GT(traced, x.hold_ms / 1000.0);
  EXPECT_NEAR((*ct)["allocs_per_s"].get<double>(), x.temp / traced, 1e-6 * x.temp / traced);

  // The peak: when the last peak block came, and which stacks held what.
  uint64_t peak = s["peak_in_use_bytes"], peak_ts = a["peak"]["ts_ns"];
  EXPECT_EQ(a["peak"]["bytes"], peak);
  EXPECT_GE(peak_ts, x.before);
  EXPECT_LE(peak_ts, x.after);
  EXPECT_EQ(s["peak_ts_ns"], peak_ts);
  struct Want {
    const char* fn;
    long bytes, blocks;
  } wants[] = {{"peak_big", x.peak_big, 100}, {"peak_small", x.peak_small, 50}, {"keep_site", x.keep * 1000, x.keep}};
  for (const auto& w : wants) {
    const json* e = by_function(a["peak"]["stacks"], w.fn);
    ASSERT_NE(e, nullptr) << w.fn << " " << a["peak"].dump();
    EXPECT_EQ((*e)["bytes"], w.bytes) << w.fn;
    EXPECT_EQ((*e)["blocks"], w.blocks) << w.fn;
  }
  ASSERT_LE(a["peak"]["stacks_total"].get<size_t>(), a["peak"]["stacks"].size());  // all listed (--top 50)
  uint64_t sum = 0;
  for (const auto& e : a["peak"]["stacks"]) sum += e["bytes"].get<uint64_t>();
  EXPECT_EQ(sum, peak);
  EXPECT_LT(peak - (x.peak_big + x.peak_small + x.keep * 1000), 65536u);  // the rest: glibc's own (a thread's dtv)

  // Lifetimes: the temporary and pair blocks lived well under 2^27 ns (134
  // ms), the peak's blocks HOLD_MS (150 ms) or more.
  const json& l = a["lifetimes"];
  uint64_t short_lived = 0, long_bytes = 0;
  for (int i = 0; i < 64; i++) {
    if (i < 27) short_lived += l["freed"][i].get<uint64_t>();
    else long_bytes += l["freed_bytes"][i].get<uint64_t>();
  }
  EXPECT_GE(short_lived, static_cast<uint64_t>(x.temp + x.thread_temp + 2 * x.pairs));
  EXPECT_GE(long_bytes, static_cast<uint64_t>(x.peak_big + x.peak_small));
  EXPECT_EQ(l["live_at_end"], s["in_use_blocks"]);

  // Memory over time: bounded, its maximum is the peak, at the peak's interval.
  const json& tl = a["timeline"];
  uint64_t step = tl["step_ns"];
  ASSERT_GT(step, 0u);
  ASSERT_FALSE(tl["points"].empty());
  EXPECT_LE(tl["points"].size(), 512u);
  uint64_t tl_max = 0, at_peak = 0;
  for (const auto& pt : tl["points"]) {
    uint64_t ts = pt[0], in_use = pt[1];
    tl_max = std::max(tl_max, in_use);
    if (ts <= peak_ts && peak_ts < ts + step) at_peak = in_use;
  }
  EXPECT_EQ(tl_max, peak);
  EXPECT_EQ(at_peak, peak);

  // Spans: at the peak's bucket, peak_big's blocks are all live (alloc
  // bucket <= b <= free bucket); keep_site's never died.
  const json& sp = a["spans"];
  uint64_t t0 = sp["t0_ns"], w = sp["bucket_ns"], live = sp["live_bucket"];
  ASSERT_GT(w, 0u);
  uint64_t b = (peak_ts - t0) / w;
  EXPECT_LT(b, 128u);
  const json* big = by_function(a["peak"]["stacks"], "peak_big");
  const json* keep = by_function(a["peak"]["stacks"], "keep_site");
  ASSERT_TRUE(big && keep);
  ASSERT_TRUE(sp["by_stack"].contains((*big)["stack_id"].get<std::string>())) << sp.dump();
  uint64_t live_at_peak = 0, all_big = 0;
  for (const auto& e : sp["by_stack"][(*big)["stack_id"].get<std::string>()]) {
    uint64_t ab = e[0], fb = e[1], bytes = e[2];
    all_big += bytes;
    if (ab <= b && fb >= b) live_at_peak += bytes;
    EXPECT_NE(fb, live);  // all freed
  }
  EXPECT_EQ(live_at_peak, static_cast<uint64_t>(x.peak_big));
  EXPECT_EQ(all_big, static_cast<uint64_t>(x.peak_big));
  uint64_t keep_live = 0;
  for (const auto& e : sp["by_stack"][(*keep)["stack_id"].get<std::string>()]) {
    EXPECT_EQ(e[1], live);
    keep_live += e[3].get<uint64_t>();
  }
  EXPECT_EQ(keep_live, static_cast<uint64_t>(x.keep));
}

}  // namespace

// One trace, JSON and text; then `replay` of its recording: the same analyses.
TEST_F(Analysis, TargetsNumbersInEveryReportLiveAndFromReplay) {
  ToolRun r = run_argv({tool(), "--top", "50", "--record", path("t.mtr"), "-o", path("a.json"), "-o", path("a.txt"),
                        "--", target("analysis_target")});
  ASSERT_EQ(r.code, 0) << r.err;
  Expected x = parse_expected(r.out);
  ASSERT_EQ(x.temp, 1000) << r.out;
  ASSERT_GT(x.before, 0u) << r.out;
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  const json* p = find_comm(rep, "analysis_target");
  ASSERT_NE(p, nullptr) << slurp(path("a.json"));
  {
    SCOPED_TRACE("trace");
    check_analysis(*p, x);
  }

  // The text report: the summary's lines and the three sections.
  std::string text = slurp(path("a.txt"));
  uint64_t peak = (*p)["summary"]["peak_in_use_bytes"];
  EXPECT_NE(text.find("temporary allocations: " + std::to_string(x.temp + x.thread_temp) + " ("), std::string::npos)
      << text;
  EXPECT_NE(text.find("PEAK: " + std::to_string(peak) + " bytes at "), std::string::npos) << text;
  EXPECT_NE(text.find("    " + std::to_string(x.peak_big) + " bytes in 100 blocks: peak_big ("), std::string::npos)
      << text;
  EXPECT_NE(text.find(std::to_string(x.temp) + " of " + std::to_string(x.temp) + " allocations (100.0%): temp_site ("),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(std::to_string(x.pairs) + " allocations ("), std::string::npos) << text;
  EXPECT_NE(text.find("lifetimes: "), std::string::npos) << text;

  // replay feeds the recorded records to the same model: the same analyses.
  ToolRun rp = run_argv({tool(), "replay", path("t.mtr"), "--top", "50", "-o", path("b.json")});
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rep2 = json::parse(slurp(path("b.json")), nullptr, false);
  const json* p2 = find_comm(rep2, "analysis_target");
  ASSERT_NE(p2, nullptr) << slurp(path("b.json"));
  {
    SCOPED_TRACE("replay");
    check_analysis(*p2, x);
  }
  EXPECT_EQ((*p2)["analysis"], (*p)["analysis"]);
  EXPECT_EQ((*p2)["summary"], (*p)["summary"]);
}

// heaptrack on the same target (single-threaded: heaptrack counts one stream
// per process, so with two threads its count depends on their interleaving):
// the same temporary allocations, per stack and in total, and the same
// bytes per stack at the peak. heaptrack's total peak also holds what its
// own preloaded library brings (libstdc++'s 72 KB emergency pool), so the
// totals are compared through the target's stacks only.
TEST_F(Analysis, AgreesWithHeaptrack) {
  if (system("command -v heaptrack >/dev/null && command -v heaptrack_print >/dev/null") != 0)
    MEMTRACE_SKIP_OR_FAIL("heaptrack not installed (Debian heaptrack)");
  ToolRun r = run_argv({tool(), "--top", "50", "-o", path("a.json"), "--", target("analysis_target"), "--one-thread"});
  ASSERT_EQ(r.code, 0) << r.err;
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  const json* p = find_comm(rep, "analysis_target");
  ASSERT_NE(p, nullptr);
  const json& a = (*p)["analysis"];

  ToolRun h = run_argv({"/bin/sh", "-c",
                        "heaptrack -o " + path("ht") + " " + target("analysis_target") + " --one-thread >/dev/null && " +
                            "heaptrack_print " + path("ht") + ".zst"});
  ASSERT_EQ(h.code, 0) << h.err << h.out.substr(0, 2000);
  // heaptrack unwinds from inside its own preloaded malloc: a return probe
  // there (another tracer running at the same time, such as a system-wide
  // memtrace-bpf, which probes every object that defines malloc) replaces
  // the return addresses it walks through, and every stack is one frame.
  ASSERT_NE(h.out.find("\ntemp_site\n"), std::string::npos)
      << "heaptrack's stacks are not the target's (is another tracer probing malloc?):\n" << h.out.substr(0, 1500);
  // "temporary memory allocations: 1000 (8387/s)"
  std::smatch m;
  ASSERT_TRUE(std::regex_search(h.out, m, std::regex(R"(temporary memory allocations: (\d+))"))) << h.out;
  EXPECT_EQ(std::stoull(m[1]), a["temporary_allocs"].get<uint64_t>()) << h.out;
  // "1000 temporary allocations of 1000 allocations in total (100.00%) from\ntemp_site\n"
  std::map<std::string, uint64_t> ht_temp, ht_peak;
  static const std::regex temp_re(R"((\d+) temporary allocations of \d+ allocations in total \([\d.]+%\) from\n(\S+)\n)");
  for (auto it = std::sregex_iterator(h.out.begin(), h.out.end(), temp_re); it != std::sregex_iterator(); ++it)
    ht_temp.emplace((*it)[2], std::stoull((*it)[1]));
  // "1000.00K peak memory consumed over 100 calls from\npeak_big\n" (K = 1000)
  static const std::regex peak_re(R"(([\d.]+)([KMG]?)B? peak memory consumed over \d+ calls from\n(\S+)\n)");
  for (auto it = std::sregex_iterator(h.out.begin(), h.out.end(), peak_re); it != std::sregex_iterator(); ++it) {
    double v = std::stod((*it)[1]);
    std::string unit = (*it)[2];
    v *= unit == "K" ? 1e3 : unit == "M" ? 1e6 : unit == "G" ? 1e9 : 1;
    ht_peak.emplace((*it)[3], std::llround(v));
  }
  for (const char* fn : {"temp_site"}) {
    const json* e = by_function(a["temporary"]["stacks"], fn);
    ASSERT_NE(e, nullptr) << fn;
    ASSERT_TRUE(ht_temp.count(fn)) << h.out;
    EXPECT_EQ(ht_temp[fn], (*e)["temporary"].get<uint64_t>()) << fn;
  }
  for (const char* fn : {"peak_big", "peak_small", "keep_site"}) {
    const json* e = by_function(a["peak"]["stacks"], fn);
    ASSERT_NE(e, nullptr) << fn;
    ASSERT_TRUE(ht_peak.count(fn)) << h.out;
    EXPECT_EQ(ht_peak[fn], (*e)["bytes"].get<uint64_t>()) << fn;
  }
}
