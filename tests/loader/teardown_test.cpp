// The tool exits when its report is written, not when the kernel has
// detached its probes: the guardian (src/loader/guardian.h) holds the links
// and closes them after the tool. Meanwhile the traced process runs on
// unharmed, a second run works, and in the end no program or link of the
// first run is left in the kernel and the guardian is gone.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <set>

#include "harness.h"
#include "proc_tasks.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

// The child of `parent` named `comm` (the tool's guardian), or -1.
pid_t child_named(pid_t parent, const std::string& comm) {
  pid_t found = -1;
  for (const ProcTask& t : proc_tasks())
    if (t.comm == comm && t.ppid == parent) found = t.pid;
  return found;
}

bool alive_as(pid_t pid, const std::string& comm) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/comm");
  std::string c;
  return std::getline(f, c) && c == comm;
}

std::set<std::string> links_of(const std::set<std::string>& ids) {
  std::set<std::string> l;
  for (const auto& id : ids)
    if (id.rfind("link", 0) == 0) l.insert(id);
  return l;
}

class Teardown : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

}  // namespace

TEST_F(Teardown, TheGuardianClosesTheLinksAfterTheToolAndTheTargetRunsOn) {
  Child t = spawn({target("alloc_rounds"), "--wait", "--rounds", "20"});
  std::string tout;
  ASSERT_TRUE(read_until(t.out, "ready", &tout));
  std::string rep = tmpfile("teardown");
  // The guardian waits 1.5 s before each close: the links are still
  // attached, held by it alone, when the tool has exited.
  setenv("MEMTRACE_TEST_GUARDIAN_HOLD_MS", "1500", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "-p", std::to_string(t.pid)});
  unsetenv("MEMTRACE_TEST_GUARDIAN_HOLD_MS");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  std::set<std::string> ids = bpf_ids_of(m.pid);
  std::set<std::string> links = links_of(ids);
  EXPECT_GE(links.size(), 3u) << "the tool holds uprobe and tracepoint links";
  pid_t guard = child_named(m.pid, "memtrace-guard");
  ASSERT_GT(guard, 0) << "no guardian process";

  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;
  {
    std::ifstream f(rep);
    json j = json::parse(f, nullptr, false);
    EXPECT_TRUE(find_proc(j, t.pid)) << "the report is written before the tool exits";
  }
  // Every link the tool held is the guardian's now, and still in the kernel.
  std::set<std::string> held = links_of(bpf_ids_of(guard));
  for (const auto& l : links) EXPECT_TRUE(held.count(l)) << l << " not handed to the guardian";
  EXPECT_EQ(still_loaded(links), links);

  // Meanwhile the target runs (its allocations hit probes that are still
  // attached) and ends normally, with its own counts.
  ASSERT_EQ(write(t.in, "\n\n", 2), 2);
  ASSERT_TRUE(read_until(t.out, "per_round", &tout)) << tout;
  EXPECT_EQ(wait_exit(t.pid), 0);
  PerRound per = parse_per_round(tout);
  EXPECT_GT(per.allocs, 0) << tout;

  // A second run right after works, while the first run's links are still
  // being closed: its counts are its program's.
  const long R = 50;
  ToolRun r0 = run_tool({"--", target("alloc_rounds"), "--rounds", "0"});
  ToolRun rn = run_tool({"--", target("alloc_rounds"), "--rounds", std::to_string(R)});
  ASSERT_EQ(r0.code, 0) << r0.err;
  ASSERT_EQ(rn.code, 0) << rn.err;
  PerRound pn = parse_per_round(rn.out);
  const json* p0 = find_comm(r0.report, "alloc_rounds");
  const json* p1 = find_comm(rn.report, "alloc_rounds");
  ASSERT_TRUE(p0 && p1) << rn.report.dump();
  EXPECT_EQ(u(*p1, "allocs") - u(*p0, "allocs"), R * pn.allocs);
  EXPECT_EQ(u(*p1, "frees") - u(*p0, "frees"), R * pn.frees);

  // The teardown finishes: no program or link of the first run is left,
  // and the guardian has exited.
  std::set<std::string> left = still_loaded(ids);
  for (int i = 0; i < 300 && (!left.empty() || alive_as(guard, "memtrace-guard")); i++) {
    usleep(50000);
    left = still_loaded(left);
  }
  EXPECT_TRUE(left.empty()) << "programs/links left behind: " << *left.begin();
  EXPECT_FALSE(alive_as(guard, "memtrace-guard")) << "the guardian did not exit";
  unlink(rep.c_str());
}
