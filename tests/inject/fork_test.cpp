// --inject and fork: what a fork's child does before the agent's own atfork
// child handler has switched its hooks off.
#include <gtest/gtest.h>

#include <string>

#include "test_env.h"
#include "../loader/harness.h"

namespace {

using json = nlohmann::json;
using namespace memtrace::testing;  // NOLINT(google-build-using-namespace)

bool stack_has(const json& leak, const std::string& fn) {
  for (const auto& f : leak["stack"])
    if (f.contains("function") && f["function"] == fn) return true;
  return false;
}

}  // namespace

// atfork_lib's child handler (registered in a constructor, before the agent)
// makes 3 allocations in each child, with the parent's hooks still patched
// in. Before: the child wrote them into the parent's ring under the parent's
// pid (3 x N blocks the parent "leaked", a stack through
// atfork_child_handler). Now the hooks call straight through there and count
// the calls: DROPPED inject_fork_child_calls = 3 x N exactly; no report
// holds them (the BPF path alone gives each child its 3: the child's
// entries are still patched there, so its uprobes do not see them); every
// process exits 0.
TEST(InjectFork, ChildCallsBeforeTheAgentsAtforkHandlerAreCountedNotGivenToTheParent) {
  MEMTRACE_REQUIRE_ROOT();
  const int N = 12;
  ToolRun r = run_tool({"--inject", "--", ATFORK_TARGET, std::to_string(N)});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("forks " + std::to_string(N)), std::string::npos) << r.out;
  ASSERT_TRUE(r.report.is_object()) << r.err;
  EXPECT_EQ(r.report["dropped"]["inject_fork_child_calls"].get<long>(), 3L * N) << r.report["dropped"].dump();
  int procs = 0;
  for (const auto& p : r.report["processes"]) {
    if (p["comm"] != "atfork_target") continue;
    procs++;
    EXPECT_EQ(p["exit_code"], 0) << p.dump();
    for (const auto& l : p["leaks"]) EXPECT_FALSE(stack_has(l, "atfork_child_handler")) << p["pid"] << ": " << l.dump();
  }
  EXPECT_EQ(procs, N + 1) << r.err;
}
