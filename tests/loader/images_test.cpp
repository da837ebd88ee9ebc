// Ended images on the real tool (issue 17): a program run many times under
// one trace is sealed when each run ends and merged past --max-images; the
// sums stay exact and the merged stacks keep their names and lines.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

int leak_line() {
  std::ifstream f(std::string(SOURCE_DIR) + "/tests/targets/alloc_rounds.c");
  std::string line;
  for (int n = 1; std::getline(f, line); n++)
    if (line.find("/* LEAK-SITE */") != std::string::npos) return n;
  return 0;
}

// A leak group whose innermost frames are leak_here (alloc_rounds.c, the
// leak site) < one_round: symbolized from sealed locations.
bool has_leak_here(const json& p) {
  for (const auto& l : p["leaks"]) {
    const auto& st = l["stack"];
    if (st.size() >= 2 && st[0]["function"] == "leak_here" && st[1]["function"] == "one_round" &&
        st[0].value("line", 0) == leak_line() &&
        st[0]["address"].get<std::string>().rfind("0x", 0) == 0 && st[0]["address"] != "0x0")
      return true;
  }
  return false;
}

}  // namespace

TEST(EndedImagesTraced, ManyRunsOfOneProgramAreMergedAndTheSumsStayExact) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  const int runs = 20, last = 9;
  ToolRun r0 = run_tool({"--", target("alloc_rounds"), "--rounds", "0"});
  ASSERT_EQ(r0.code, 0) << r0.err;
  const json* base = find_comm(r0.report, "alloc_rounds");
  ASSERT_TRUE(base) << r0.report.dump();
  std::string loop = "i=0; while [ $i -lt " + std::to_string(runs) + " ]; do " + target("alloc_rounds") +
                     " --rounds 1 >/dev/null; i=$((i+1)); done; " + target("alloc_rounds") + " --rounds " +
                     std::to_string(last);
  std::string rec = "/tmp/memtrace-test-" + std::to_string(getpid()) + "-images.mtr";
  ToolRun r = run_tool({"--max-images", "4", "--record", rec, "--", "/bin/sh", "-c", loop});
  ASSERT_EQ(r.code, 0) << r.err;
  PerRound per = parse_per_round(r.out);
  ASSERT_GT(per.allocs, 0) << r.out;

  long processes = 0, merged_entries = 0, individual = 0;
  long allocs = 0, frees = 0, bytes = 0, in_use = 0, blocks = 0, one_round_peak = -1;
  const json* merged = nullptr;
  for (const auto& p : r.report["processes"]) {
    if (p["comm"] != "alloc_rounds") continue;
    if (p["ended"] == "merged") {
      merged = &p;
      merged_entries++;
      processes += p["merged"]["processes"].get<long>();
      EXPECT_LE(p["merged"]["pids"].size(), 16u);
    } else {
      individual++;
      processes++;
      EXPECT_EQ(p["ended"], "exit");
      EXPECT_TRUE(has_leak_here(p)) << p["leaks"].dump();
      if (u(p, "allocs") == u(*base, "allocs") + per.allocs) one_round_peak = u(p, "peak_in_use_bytes");
    }
    allocs += u(p, "allocs");
    frees += u(p, "frees");
    bytes += u(p, "bytes_allocated");
    in_use += u(p, "in_use_bytes");
    blocks += u(p, "in_use_blocks");
  }
  const long n = runs + 1, rounds = runs + last;
  EXPECT_EQ(processes, n);
  EXPECT_EQ(merged_entries, 1);
  EXPECT_EQ(individual, 4);  // --max-images: the newest runs stay one by one
  EXPECT_EQ(allocs, n * u(*base, "allocs") + rounds * per.allocs);
  EXPECT_EQ(frees, n * u(*base, "frees") + rounds * per.frees);
  EXPECT_EQ(bytes, n * u(*base, "bytes_allocated") + rounds * per.bytes);
  EXPECT_EQ(in_use, n * u(*base, "in_use_bytes") + rounds * per.leaked_bytes);
  EXPECT_EQ(blocks, n * u(*base, "in_use_blocks") + rounds * per.leaked_blocks);
  ASSERT_TRUE(merged) << r.report.dump();
  // Its leaks by stack: the members' sums, named from their sealed locations.
  EXPECT_TRUE(has_leak_here(*merged)) << (*merged)["leaks"].dump();
  long leaked = 0;
  for (const auto& l : (*merged)["leaks"]) leaked += l["bytes"].get<long>();
  if ((*merged)["leak_groups_total"] == (*merged)["leaks"].size()) {
    EXPECT_EQ(leaked, u(*merged, "in_use_bytes"));
  }
  // Its peak is one member's (the largest), not a sum: every member ran one round.
  EXPECT_EQ(u(*merged, "peak_in_use_bytes"), one_round_peak);
  EXPECT_EQ(r.report["stats"]["model_merged_images"].get<long>(), n - 4);
  EXPECT_GT(r.report["stats"]["model_sealed_stacks"].get<long>(), 0);
  for (const auto& [k, v] : r.report["dropped"].items()) EXPECT_EQ(v, 0) << k;

  // The recording replays to the same entries: sealed and merged at the
  // end as the trace did (the cap is in the recording's header).
  std::string rj = tmpfile("replay");
  ToolRun rp = run_argv({tool(), "replay", rec, "--format", "json", "-o", rj});
  unlink(rec.c_str());
  ASSERT_EQ(rp.code, 0) << rp.err;
  std::ifstream f(rj);
  json replayed = json::parse(f, nullptr, false);
  unlink(rj.c_str());
  ASSERT_TRUE(replayed.is_object());
  auto entries = [](const json& rep) {
    std::map<std::string, json> m;  // "merged" or the pid: the counts
    for (const auto& p : rep["processes"])
      if (p["comm"] == "alloc_rounds")
        m[p["ended"] == "merged" ? std::string("merged") : std::to_string(p["pid"].get<long>())] = {
            p["summary"], p.value("merged", json()), has_leak_here(p)};
    return m;
  };
  EXPECT_EQ(entries(replayed).size(), 5u);
  EXPECT_EQ(entries(replayed), entries(r.report));
}

// A daemon over short processes collects their raw stacks while it runs
// (every 30 s once 4,096 more are held; MEMTRACE_STACKS_GC_MS=20 here), not
// only once 65,536 are held: the collection changes no figure, and stacks
// of later runs (BPF sends a dropped stack again) are charged as before.
TEST(EndedImagesTraced, RawStacksOfEndedRunsAreCollectedWhileTheTraceRunsAndNoFigureChanges) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  const int runs = 8;
  std::string loop = "i=0; while [ $i -lt " + std::to_string(runs) + " ]; do " + target("alloc_rounds") +
                     " --rounds 2 >/dev/null; sleep 0.1; i=$((i+1)); done";
  auto sums = [](const ToolRun& r) {
    std::map<std::string, long> s;
    for (const auto& p : r.report["processes"])
      if (p["comm"] == "alloc_rounds")
        for (const char* k : {"allocs", "frees", "bytes_allocated", "in_use_bytes", "in_use_blocks"}) s[k] += u(p, k);
    return s;
  };
  ToolRun plain = run_tool({"--", "/bin/sh", "-c", loop});
  ASSERT_EQ(plain.code, 0) << plain.err;
  setenv("MEMTRACE_STACKS_GC_MS", "20", 1);
  ToolRun gc = run_tool({"--", "/bin/sh", "-c", loop});
  unsetenv("MEMTRACE_STACKS_GC_MS");
  ASSERT_EQ(gc.code, 0) << gc.err;
  EXPECT_EQ(plain.report["stats"]["model_stacks_collected"].get<long>(), 0);
  EXPECT_GT(gc.report["stats"]["model_stacks_collected"].get<long>(), 0) << gc.report["stats"].dump();
  auto a = sums(plain), b = sums(gc);
  EXPECT_GT(a["allocs"], 0);
  EXPECT_EQ(a, b);
  for (const auto* r : {&plain, &gc})
    for (const auto& [k, v] : r->report["dropped"].items()) EXPECT_EQ(v, 0) << k;
  // Every run's leak is still named from its sealed stacks.
  long named = 0;
  for (const auto& p : gc.report["processes"])
    if (p["comm"] == "alloc_rounds") named += has_leak_here(p);
  EXPECT_EQ(named, runs);
}
