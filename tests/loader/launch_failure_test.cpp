// A program that cannot be started (memtrace-bpf -- PROG): one line naming
// what failed, exit code 2, and no report of a process that never ran.
// Most cases are caught before anything is loaded (Launcher::check_executable);
// a script whose interpreter is missing passes that check and fails at the
// exec itself, after the BPF programs are loaded: the same line and code.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;

namespace {

struct Case {
  std::string what;
  std::vector<std::string> command;
  std::string line;  // the whole of stderr
};

std::string file_text(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

class LaunchFailure : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    dir_ = "/tmp/memtrace-launch-" + std::to_string(getpid());
    ASSERT_EQ(mkdir(dir_.c_str(), 0755), 0);
    { std::ofstream(dir_ + "/not-executable") << "#!/bin/sh\nexit 0\n"; }
    ASSERT_EQ(chmod((dir_ + "/not-executable").c_str(), 0644), 0);
    { std::ofstream(dir_ + "/bad-interpreter") << "#!/nonexistent/interpreter\n"; }
    ASSERT_EQ(chmod((dir_ + "/bad-interpreter").c_str(), 0755), 0);
  }
  void TearDown() override {
    unlink((dir_ + "/not-executable").c_str());
    unlink((dir_ + "/bad-interpreter").c_str());
    rmdir(dir_.c_str());
  }
  std::string dir_;
};

TEST_F(LaunchFailure, OneLineExitTwoAndNoReport) {
  std::vector<Case> cases = {
      {"no such file", {"/nonexistent/prog"},
       "memtrace-bpf: cannot execute /nonexistent/prog: No such file or directory\n"},
      {"not executable", {dir_ + "/not-executable"},
       "memtrace-bpf: cannot execute " + dir_ + "/not-executable: Permission denied\n"},
      {"a directory", {dir_, "arg"}, "memtrace-bpf: cannot execute " + dir_ + ": Permission denied\n"},
      {"not in PATH", {"memtrace-no-such-program"},
       "memtrace-bpf: cannot execute memtrace-no-such-program: not found in PATH\n"},
      // Passes the check (an executable file): execve itself fails, after
      // the BPF side is armed for the held child.
      {"missing interpreter", {dir_ + "/bad-interpreter"},
       "memtrace-bpf: cannot execute " + dir_ + "/bad-interpreter: No such file or directory\n"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    // The text report goes to stderr in launch mode: nothing but the line.
    std::vector<std::string> argv = {tool(), "--"};
    argv.insert(argv.end(), c.command.begin(), c.command.end());
    ToolRun r = run_argv(argv);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(r.err, c.line);
    EXPECT_EQ(r.out, "");
    // With -o: no report in the file either (at most an empty file, created
    // before anything was traced).
    std::string rep = tmpfile("fail");
    argv = {tool(), "--format", "json", "-o", rep, "--"};
    argv.insert(argv.end(), c.command.begin(), c.command.end());
    r = run_argv(argv);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(r.err, c.line);
    EXPECT_EQ(file_text(rep), "");
    unlink(rep.c_str());
  }
}

// A program found through PATH still runs (the check follows execvp).
TEST_F(LaunchFailure, ProgramInPathStillRuns) {
  ToolRun r = run_tool({"--", "true"});
  EXPECT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(find_comm(r.report, "true")) << r.report.dump() << r.err;
  // A program's own exit code is the tool's, as before.
  r = run_tool({"--", "sh", "-c", "exit 7"});
  EXPECT_EQ(r.code, 7) << r.err;
}

}  // namespace
