// System-wide mode and statically linked programs (issue 35): a static
// program started while the tool traces has its allocator in its own file,
// which no library mapping brings. Its first exec is stopped until that
// file's probes are in, so it is counted exactly, as launch mode counts it;
// a stripped one is counted as static_without_symbols. Part of
// loader_integration_test (the real BPF programs, real targets).
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

class SystemWideStatic : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

struct SystemWideRun {
  json rep;
  std::string err;                // the tool's stderr
  std::vector<pid_t> pids;        // of the programs, in order
  std::vector<std::string> outs;  // their stdout
};

// memtrace-bpf system-wide; once it traces, each program in turn, run to
// its end (none waits for anything: a static program's whole life is a few
// ms, over before a read of its maps could attach anything); then SIGINT.
SystemWideRun system_wide(const std::vector<std::vector<std::string>>& progs) {
  SystemWideRun r;
  std::string rep = tmpfile("static");
  Child m = spawn({tool(), "--format", "json", "-o", rep});
  close(m.in);
  std::string err;
  EXPECT_TRUE(read_until(m.err, "tracing", &err)) << err;
  std::thread drain([&] { err += read_all(m.err); });  // never a full pipe
  for (const auto& argv : progs) {
    Child t = spawn(argv);
    close(t.in);
    std::thread e([&] { read_all(t.err); });
    r.outs.push_back(read_all(t.out));
    e.join();
    close(t.out);
    close(t.err);
    EXPECT_EQ(wait_exit(t.pid), 0) << argv[0];
    r.pids.push_back(t.pid);
  }
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0);
  drain.join();
  close(m.out);
  close(m.err);
  r.err = err;
  std::ifstream f(rep);
  r.rep = json::parse(f, nullptr, false);
  unlink(rep.c_str());
  return r;
}

void expect_same_counts(const json& got, const json& want) {
  for (const char* k : {"allocs", "frees", "bytes_allocated", "in_use_blocks", "in_use_bytes", "failed_allocs"})
    EXPECT_EQ(u(got, k), u(want, k)) << k;
}

}  // namespace

// The first run of the file is stopped at its exec until its probes are in
// (static_exec_stops); the next ones run on those probes, unstopped. Each is
// counted as launch mode counts the same run, and the rounds exactly.
TEST_F(SystemWideStatic, StaticProgramStartedMidRunIsCountedAsLaunchModeCountsIt) {
  const long R = 20;
  const std::string prog = target("alloc_rounds_static");
  ToolRun launched = run_tool({"--", prog, "--rounds", std::to_string(R)});
  ASSERT_EQ(launched.code, 0) << launched.err;
  const json* pl = find_comm(launched.report, "alloc_rounds_st");
  ASSERT_TRUE(pl) << launched.report.dump();
  ASSERT_GT(u(*pl, "allocs"), R);

  SystemWideRun s = system_wide({{prog, "--rounds", std::to_string(R)},
                                 {prog, "--rounds", "0"},
                                 {prog, "--rounds", std::to_string(R)}});
  ASSERT_TRUE(s.rep.is_object()) << s.err;
  PerRound per = parse_per_round(s.outs[0]);
  ASSERT_GT(per.allocs, 0) << s.outs[0];
  const json* first = find_proc(s.rep, s.pids[0]);
  const json* none = find_proc(s.rep, s.pids[1]);
  const json* again = find_proc(s.rep, s.pids[2]);
  ASSERT_TRUE(first && none && again) << s.err;
  {
    SCOPED_TRACE("first exec (stopped for its probes)");
    expect_same_counts(*first, *pl);
  }
  {
    SCOPED_TRACE("a later exec (the file's probes already in)");
    expect_same_counts(*again, *pl);
  }
  EXPECT_EQ(u(*again, "allocs") - u(*none, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*again, "frees") - u(*none, "frees"), R * per.frees);
  EXPECT_EQ(u(*again, "bytes_allocated") - u(*none, "bytes_allocated"), R * per.bytes);
  // The constructor's block, allocated before main, is there.
  bool ctor = false;
  for (const auto& l : (*first)["leaks"]) ctor = ctor || (l["bytes"] == 12345 && l["blocks"] == 1);
  EXPECT_TRUE(ctor) << (*first)["leaks"].dump();
  EXPECT_GE(s.rep["stats"]["static_exec_stops"].get<long>(), 1);
  EXPECT_EQ(s.rep["dropped"]["stop_failed"], 0);
  EXPECT_EQ(s.rep["dropped"]["static_without_symbols"], 0) << s.err;
}

// A stripped static program: nothing names its malloc. Each exec is counted
// (dropped: static_without_symbols), the file named once on stderr; the
// program runs as it would untraced.
TEST_F(SystemWideStatic, StrippedStaticProgramIsCountedAsStaticWithoutSymbols) {
  const std::string prog = target("alloc_rounds_static_stripped");
  SystemWideRun s = system_wide({{prog, "--rounds", "3"}, {prog, "--rounds", "3"}});
  ASSERT_TRUE(s.rep.is_object()) << s.err;
  EXPECT_NE(s.outs[1].find("per_round"), std::string::npos) << s.outs[1];
  EXPECT_EQ(s.rep["dropped"]["static_without_symbols"], 2) << s.err;
  size_t lines = 0;
  for (size_t at = 0; (at = s.err.find("alloc_rounds_static_stripped (pid", at)) != std::string::npos; at++) lines++;
  EXPECT_EQ(lines, 1u) << s.err;
  EXPECT_NE(s.err.find("statically linked and stripped"), std::string::npos) << s.err;
  for (pid_t pid : s.pids) {
    if (const json* p = find_proc(s.rep, pid)) {
      EXPECT_EQ(u(*p, "allocs"), 0);
    }
  }
}
