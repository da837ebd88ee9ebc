// `memtrace-bpf top` (issue 34) in a real terminal: tmux runs it, send-keys
// types, capture-pane reads the screen. Two targets that know their counts
// (alloc_rounds: 33 bytes kept per round, 12 calls a round); what the view
// shows is checked against them, and the report written after `q`.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "harness.h"
#include "shell.h"
#include "slurp.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

class LiveView : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (access("/usr/bin/tmux", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/tmux (Debian tmux)");
  }
};

// tmux on a server of the test's own (-L), so that nobody's sessions are touched.
struct Tmux {
  std::string sock = "memtrace-lv-" + std::to_string(getpid());
  std::string cmd(const std::string& args) const { return "tmux -L " + sock + " " + args; }
  void start(const std::string& command) const {
    shell_output(cmd("new-session -d -s view -x 160 -y 40 " + quote(command)));
  }
  std::string screen() const { return shell_output(cmd("capture-pane -p -t view")); }
  void keys(const std::string& k) const { shell_output(cmd("send-keys -t view " + k)); }
  // Until the screen shows every one of wants (true), or 20 s pass (false; *last: the screen).
  bool wait_for(std::initializer_list<std::string> wants, std::string* last) const {
    auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < 20s) {
      *last = screen();
      bool all = true;
      for (const auto& w : wants) all = all && last->find(w) != std::string::npos;
      if (all) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
  ~Tmux() { shell_output(cmd("kill-server 2>/dev/null")); }
  static std::string quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  }
};

TEST_F(LiveView, TopShowsProcessesAndStacksAndQuitsWithTheReport) {
  const long R1 = 50, R2 = 10;
  Child a = spawn({target("alloc_rounds"), "--wait", "--rounds", std::to_string(R1)});
  Child b = spawn({target("alloc_rounds"), "--wait", "--rounds", std::to_string(R2)});
  std::string ao, bo;
  ASSERT_TRUE(read_until(a.out, "ready", &ao));
  ASSERT_TRUE(read_until(b.out, "ready", &bo));
  std::string rep = tmpfile("lv"), err = tmpfile("lverr"), rc = tmpfile("lvrc");
  Tmux t;
  t.start(tool() + " top -p " + std::to_string(a.pid) + " -p " + std::to_string(b.pid) + " -o " + rep + " 2>" + err +
          "; echo EXIT=$? > " + rc + "; sleep 60");
  std::string s;
  ASSERT_TRUE(t.wait_for({"memtrace-bpf top: 0 processes, malloc domain, by in use"}, &s)) << s << slurp(err);
  // The rounds, while the view is up: the kept blocks of each.
  ASSERT_EQ(write(a.in, "\n", 1), 1);
  ASSERT_EQ(write(b.in, "\n", 1), 1);
  ASSERT_TRUE(read_until(a.out, "per_round", &ao));
  ASSERT_TRUE(read_until(b.out, "per_round", &bo));
  PerRound per = parse_per_round(ao);
  ASSERT_EQ(per.leaked_blocks, 1);
  ASSERT_TRUE(t.wait_for({"memtrace-bpf top: 2 processes", "   " + std::to_string(R1) + "   ",
                          "   " + std::to_string(R1 * per.allocs) + "\n", "   " + std::to_string(R2 * per.allocs) + "\n"},
                         &s))
      << s;
  // By bytes in use: a (50 rounds) first, under the cursor.
  size_t pa = s.find(" " + std::to_string(a.pid) + "  alloc_rounds"), pb = s.find(" " + std::to_string(b.pid) + "  alloc_rounds");
  ASSERT_NE(pa, std::string::npos) << s;
  ASSERT_NE(pb, std::string::npos) << s;
  EXPECT_LT(pa, pb) << s;
  std::string apid = std::to_string(a.pid);  // right-aligned in 7 columns after the cursor's "  >  "
  EXPECT_NE(s.find("  >  " + std::string(apid.size() < 7 ? 7 - apid.size() : 0, ' ') + apid), std::string::npos) << s;
  // Down to b, its stacks: its kept bytes exactly, from leak_here.
  t.keys("j");
  t.keys("Enter");
  ASSERT_TRUE(t.wait_for({"pid " + std::to_string(b.pid) + " (alloc_rounds), malloc domain: " +
                              std::to_string(R2 * per.leaked_bytes) + " bytes",
                          "in use in " + std::to_string(R2) + " blocks, " + std::to_string(R2 * per.allocs) +
                              " allocations",
                          "BY IN USE", std::to_string(R2) + " blk  leak_here (alloc_rounds.c:", "BY ALLOCATION RATE"},
                         &s))
      << s;
  // Back, sorted by allocation rate, the python domain (none), malloc again.
  t.keys("b");
  ASSERT_TRUE(t.wait_for({"memtrace-bpf top: 2 processes, malloc domain, by in use"}, &s)) << s;
  t.keys("a");
  ASSERT_TRUE(t.wait_for({"malloc domain, by allocation rate"}, &s)) << s;
  t.keys("d");
  ASSERT_TRUE(t.wait_for({"0 processes, python domain", "no process has allocated in the python domain yet"}, &s))
      << s;
  t.keys("d");
  ASSERT_TRUE(t.wait_for({"2 processes, malloc domain"}, &s)) << s;
  // q: the run ends as at Ctrl-C, with its report.
  t.keys("q");
  auto t0 = std::chrono::steady_clock::now();
  while (slurp(rc).empty() && std::chrono::steady_clock::now() - t0 < 20s) std::this_thread::sleep_for(100ms);
  EXPECT_EQ(slurp(rc), "EXIT=0\n") << slurp(err);
  // The normal screen is back (the view was on the alternate one).
  EXPECT_EQ(t.screen().find("memtrace-bpf top:"), std::string::npos) << t.screen();
  json j = json::parse(slurp(rep), nullptr, false);
  const json* ja = find_proc(j, a.pid);
  const json* jb = find_proc(j, b.pid);
  ASSERT_TRUE(ja && jb) << j.dump().substr(0, 2000);
  EXPECT_EQ((*ja)["summary"]["in_use_blocks"], R1);
  EXPECT_EQ((*jb)["summary"]["in_use_bytes"], R2 * per.leaked_bytes);
  EXPECT_EQ((*jb)["summary"]["allocs"], R2 * per.allocs);
  for (Child* c : {&a, &b}) {
    if (write(c->in, "\n", 1) != 1) {
    }
    close(c->in);
    read_all(c->out);
    EXPECT_EQ(wait_exit(c->pid), 0);
  }
  for (const auto& f : {rep, err, rc}) unlink(f.c_str());
}

// Bad input: in launch mode the keys would be the program's stdin.
TEST_F(LiveView, LaunchModeIsRefusedWithOneLine) {
  ToolRun r = run_argv({tool(), "top", "--", target("alloc_rounds"), "--rounds", "1"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the live view (top) reads its keys from stdin"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
