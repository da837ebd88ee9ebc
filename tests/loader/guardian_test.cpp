// No process stays stopped, whatever happens to the tool: memtrace-bpf is
// killed with SIGKILL (what the OOM killer does) at random moments, 50
// times, while it launches a program, while it follows an exec storm (-c),
// and while it follows a fork storm. The BPF side stops processes at exec,
// fork and new code for the loader; its guardian (src/loader/guardian.h)
// must resume every one of them, and the targets must run to their end.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "harness.h"
#include "proc_tasks.h"
#include "test_env.h"

using namespace memtrace::testing;

namespace {

struct Task {
  pid_t pid;
  std::string comm;
  char state;
};

std::vector<Task> tasks_named(const std::set<std::string>& comms) {
  std::vector<Task> out;
  for (const ProcTask& t : proc_tasks())
    if (comms.count(t.comm)) out.push_back({t.pid, t.comm, t.state});
  return out;
}

// Fails for every process of these names in state T (and resumes it, so
// that one failure does not hang the rest).
void expect_none_stopped(const std::set<std::string>& comms, const std::string& when) {
  for (const Task& t : tasks_named(comms))
    if (t.state == 'T') {
      std::ifstream st("/proc/" + std::to_string(t.pid) + "/status");
      std::string line, sig;
      while (std::getline(st, line))
        if (line.rfind("SigPnd", 0) == 0 || line.rfind("ShdPnd", 0) == 0 || line.rfind("PPid", 0) == 0)
          sig += " " + line;
      std::ifstream ss("/proc/" + std::to_string(t.pid) + "/stat");
      std::string stat;
      std::getline(ss, stat);
      double up = 0;
      std::ifstream("/proc/uptime") >> up;
      long start = 0;
      {
        std::istringstream is(stat.substr(stat.rfind(')') + 2));
        std::string f;
        for (int i = 3; i <= 22 && is >> f; i++)
          if (i == 22) start = std::stol(f);
      }
      for (const char* f : {"syscall", "stack", "wchan"}) {
        std::ifstream x("/proc/" + std::to_string(t.pid) + "/" + f);
        std::string all((std::istreambuf_iterator<char>(x)), std::istreambuf_iterator<char>());
        sig += std::string(" ") + f + ": " + all;
      }
      ADD_FAILURE() << "pid " << t.pid << " (" << t.comm << ") left stopped " << when << "; started "
                    << (up - start / double(sysconf(_SC_CLK_TCK))) << " s ago;" << sig;
      kill(t.pid, SIGCONT);
    }
}

// Waits until no process of these names is left (the targets ran on to their end).
bool all_exit(const std::set<std::string>& comms, int timeout_ms) {
  for (int waited = 0; waited < timeout_ms; waited += 50) {
    if (tasks_named(comms).empty()) return true;
    usleep(50000);
  }
  return false;
}

// memtrace-bpf ARGS, SIGKILL'ed after `ms`; then the guardian's time to resume.
void kill_tool_after(const std::vector<std::string>& args, int ms) {
  std::vector<std::string> argv = {tool(), "-o", "/dev/null"};
  argv.insert(argv.end(), args.begin(), args.end());
  Child c = spawn(argv);
  close(c.in);
  usleep(ms * 1000);
  kill(c.pid, SIGKILL);
  wait_exit(c.pid);
  close(c.out);
  close(c.err);
  usleep(400000);  // the guardian resumes at once, then again after 20 and 220 ms
}

class Guardian : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
  std::mt19937 rng{std::random_device{}()};
  int between(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
};

}  // namespace

TEST_F(Guardian, KilledDuringLaunchLeavesNothingStopped) {
  for (int i = 0; i < 17; i++) {
    int ms = between(0, 700);
    kill_tool_after({"--", target("alloc_rounds"), "--rounds", "20", "--threads", "2"}, ms);
    expect_none_stopped({"alloc_rounds"}, "after a kill at " + std::to_string(ms) + " ms into a launch");
    EXPECT_TRUE(all_exit({"alloc_rounds"}, 10000)) << "the launched program did not run to its end (kill at " << ms
                                                  << " ms)";
  }
}

TEST_F(Guardian, KilledDuringExecStormLeavesNothingStopped) {
  // A shell that exec's the target again and again, counting the runs.
  std::string count = tmpfile("runs");
  Child storm = spawn({"/bin/sh", "-c",
                       "while :; do " + target("mt_comm_target") + " --rounds 1 >/dev/null; echo x >> " + count +
                           "; done"});
  close(storm.in);
  auto runs = [&] {
    std::ifstream f(count);
    return std::count(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>(), 'x');
  };
  for (int i = 0; i < 17; i++) {
    int ms = between(50, 900);
    kill_tool_after({"-c", "mt_comm_target"}, ms);
    expect_none_stopped({"mt_comm_target", "sh"}, "after a kill at " + std::to_string(ms) + " ms into -c");
  }
  // The storm runs on.
  long before = runs();
  usleep(500000);
  EXPECT_GT(runs(), before) << "the exec storm stopped running";
  kill(storm.pid, SIGKILL);
  wait_exit(storm.pid);
  close(storm.out);
  close(storm.err);
  all_exit({"mt_comm_target"}, 5000);
  unlink(count.c_str());
}

TEST_F(Guardian, KilledDuringForkStormLeavesNothingStopped) {
  for (int i = 0; i < 16; i++) {
    int ms = between(0, 900);
    kill_tool_after({"--", target("fork_storm"), "300"}, ms);
    expect_none_stopped({"fork_storm"}, "after a kill at " + std::to_string(ms) + " ms into a fork storm");
    EXPECT_TRUE(all_exit({"fork_storm"}, 20000)) << "the fork storm did not run to its end (kill at " << ms << " ms)";
  }
}
