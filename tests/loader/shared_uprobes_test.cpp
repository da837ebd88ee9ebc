// Perf-event uprobes shared by every traced process (src/loader/shared_uprobes.h),
// the mechanism of kernels before 6.6, forced here with
// MEMTRACE_UPROBE_ATTACH=perf (and the 5.10 object with
// MEMTRACE_BPF_VARIANT=compat): one tracefs uprobe event per probe for the
// whole run, each process only in its filter. Counts stay exact process by
// process, the events are not made again per process, and once the tool
// and its guardian are gone no event of the run is left in uprobe_events.
#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "harness.h"
#include "proc_tasks.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

std::string uprobe_events_file() {
  for (int pass = 0; pass < 2; pass++) {
    for (const char* d : {"/sys/kernel/tracing", "/sys/kernel/debug/tracing"})
      if (access((std::string(d) + "/uprobe_events").c_str(), W_OK) == 0) return std::string(d) + "/uprobe_events";
    mount("nodev", "/sys/kernel/tracing", "tracefs", 0, nullptr);  // a fresh machine's (the tool does the same)
  }
  return "";
}

// One command, one write (an ofstream's seek to the end fails on tracefs).
void write_events(const std::string& file, const std::string& cmd) {
  int fd = open(file.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0) << file;
  EXPECT_EQ(write(fd, cmd.data(), cmd.size()), static_cast<ssize_t>(cmd.size())) << cmd;
  close(fd);
}

// The lines of uprobe_events whose group is memtrace_<owner>.
std::vector<std::string> events_of(pid_t owner) {
  std::vector<std::string> out;
  std::ifstream f(uprobe_events_file());
  std::string line, want = ":memtrace_" + std::to_string(owner) + "/";
  while (std::getline(f, line))
    if (line.find(want) != std::string::npos) out.push_back(line);
  return out;
}

bool alive_as(pid_t pid, const std::string& comm) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/comm");
  std::string c;
  return std::getline(f, c) && c == comm;
}

pid_t guardian_of(pid_t tool) {
  for (const ProcTask& t : proc_tasks())
    if (t.comm == "memtrace-guard" && t.ppid == tool) return t.pid;
  return -1;
}

std::string run_target(const std::vector<std::string>& argv, pid_t* pid) {
  Child t = spawn(argv);
  close(t.in);
  std::string out = read_all(t.out);
  EXPECT_EQ(wait_exit(t.pid), 0);
  *pid = t.pid;
  return out;
}

class SharedUprobes : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    setenv("MEMTRACE_UPROBE_ATTACH", "perf", 1);
    if (std::string(GetParam()) == "compat") setenv("MEMTRACE_BPF_VARIANT", "compat", 1);
  }
  void TearDown() override {
    unsetenv("MEMTRACE_UPROBE_ATTACH");
    unsetenv("MEMTRACE_BPF_VARIANT");
  }
};

}  // namespace

TEST_P(SharedUprobes, CommRunOverShortProcessesIsExactAndLeavesNoEventBehind) {
  std::string rep = tmpfile("shared");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "-c", "mt_comm_target"});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  pid_t guard = guardian_of(m.pid);
  ASSERT_GT(guard, 0) << "no guardian process";

  const long R = 20;
  const int N = 12;
  pid_t p0 = -1;
  run_target({target("mt_comm_target"), "--rounds", "0"}, &p0);
  // The first process made the run's events; the next ones make none.
  const size_t made = events_of(m.pid).size();
  EXPECT_GT(made, 2u) << "no shared uprobe event of this run in uprobe_events";
  std::vector<pid_t> pids(N);
  std::string out;
  for (int i = 0; i < N; i++) out = run_target({target("mt_comm_target"), "--rounds", std::to_string(R)}, &pids[i]);
  EXPECT_EQ(events_of(m.pid).size(), made) << "events made again for later processes";
  pid_t other = -1;
  run_target({target("alloc_rounds"), "--rounds", "3"}, &other);
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;

  std::ifstream f(rep);
  json j = json::parse(f, nullptr, false);
  ASSERT_TRUE(j.is_object()) << "no report";
  EXPECT_EQ(j["kernel"]["uprobes"], "perf_event_shared");
  PerRound per = parse_per_round(out);
  const json* q0 = find_proc(j, p0);
  ASSERT_TRUE(q0) << j.dump();
  for (pid_t pid : pids) {
    const json* q = find_proc(j, pid);
    ASSERT_TRUE(q) << "process " << pid << " not traced";
    EXPECT_EQ(u(*q, "allocs") - u(*q0, "allocs"), R * per.allocs) << pid;
    EXPECT_EQ(u(*q, "frees") - u(*q0, "frees"), R * per.frees) << pid;
    EXPECT_EQ(u(*q, "bytes_allocated") - u(*q0, "bytes_allocated"), R * per.bytes) << pid;
  }
  EXPECT_EQ(find_proc(j, other), nullptr) << "a process of another name was traced";
  expect_no_losses(j);

  // The guardian closes the carriers (a grace period each), then removes the events.
  for (int i = 0; i < 300 && alive_as(guard, "memtrace-guard"); i++) usleep(50000);
  EXPECT_FALSE(alive_as(guard, "memtrace-guard")) << "the guardian did not exit";
  std::vector<std::string> left = events_of(m.pid);
  EXPECT_TRUE(left.empty()) << left.size() << " events left, the first: " << left[0];
  unlink(rep.c_str());
}

// A tool killed before its guardian could clean up (a guest powered off)
// leaves its events; the next run removes those of tools that are gone.
TEST_P(SharedUprobes, EventsOfAToolThatIsGoneAreRemovedAtTheNextStart) {
  std::string file = uprobe_events_file();
  ASSERT_FALSE(file.empty()) << "no tracefs uprobe_events";
  std::string libc;
  {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line) && libc.empty())
      if (line.find("/libc.so.6") != std::string::npos) libc = line.substr(line.find('/'));
  }
  ASSERT_FALSE(libc.empty());
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  write_events(file, "p:memtrace_" + std::to_string(dead) + "/p0 " + libc + ":0x1000\n");
  ASSERT_EQ(events_of(dead).size(), 1u) << "could not make a stale event";
  ToolRun r = run_tool({"--", target("alloc_rounds"), "--rounds", "1"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(events_of(dead).empty()) << "the stale event of pid " << dead << " is still there";
  if (!events_of(dead).empty()) write_events(file, "-:memtrace_" + std::to_string(dead) + "/p0\n");
}

INSTANTIATE_TEST_SUITE_P(Objects, SharedUprobes, ::testing::Values("full", "compat"),
                         [](const auto& info) { return std::string(info.param); });
