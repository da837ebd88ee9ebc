// memtrace-singlestep end to end: the target (access_script.c) prints the exact
// list of region accesses it performed; the helper's log must equal it, nothing
// missing, nothing extra, and the target's own output and exit status must be
// what they are untraced.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_env.h"

namespace {

using nlohmann::json;

struct Proc {
  int status = -1;  // exit code, or 128+signal
  std::string out, err;
};

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tmp(const std::string& name) {
  return ::testing::TempDir() + "ss_" + std::to_string(getpid()) + "_" + name;
}

pid_t spawn(const std::vector<std::string>& argv, const std::string& out, const std::string& err, int stdin_fd = -1) {
  pid_t p = fork();
  if (p == 0) {
    int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    if (stdin_fd >= 0) dup2(stdin_fd, 0);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(126);
  }
  return p;
}

int wait_status(pid_t p) {
  int st = 0;
  waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

Proc run(const std::vector<std::string>& argv) {
  std::string o = tmp("out"), e = tmp("err");
  Proc r;
  r.status = wait_status(spawn(argv, o, e));
  r.out = slurp(o);
  r.err = slurp(e);
  return r;
}

// "T<t> <off> <size> <access>" lines of the target, per thread.
std::map<int, std::vector<std::string>> expected(const std::string& out) {
  std::map<int, std::vector<std::string>> m;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() < 2 || line[0] != 'T') continue;
    int t = std::stoi(line.substr(1));
    m[t].push_back(line.substr(line.find(' ') + 1));
  }
  return m;
}

// Helper records as the same lines. Thread 0 is the main thread; the others are
// told apart by their slice of the region (thread t works on 512+128*(t-1)).
std::map<int, std::vector<std::string>> recorded(const json& j, pid_t main_tid) {
  std::map<int, std::vector<std::string>> m;
  uint64_t base = std::stoull(j["regions"][0]["address"].get<std::string>(), nullptr, 16);
  for (const auto& a : j["accesses"]) {
    long off = static_cast<long>(std::stoull(a["address"].get<std::string>(), nullptr, 16) - base);
    int t = a["tid"].get<int>() == main_tid ? 0 : 1 + static_cast<int>((off - 512) / 128);
    char b[128];
    std::snprintf(b, sizeof b, "%+ld %d %s", off, a["size"].get<int>(), a["access"].get<std::string>().c_str());
    m[t].push_back(b);
  }
  return m;
}

pid_t main_tid_of(const json& j) {
  // The main thread makes the first access (script_single runs before any thread).
  return j["accesses"].empty() ? 0 : j["accesses"][0]["tid"].get<int>();
}

void expect_exact(const std::vector<std::string>& target_args, const std::vector<std::string>& helper_args) {
  std::vector<std::string> plain{SS_TARGET};
  plain.insert(plain.end(), target_args.begin(), target_args.end());
  Proc untraced = run(plain);
  ASSERT_EQ(untraced.status, 7) << untraced.out << untraced.err;

  std::string js = tmp("report.json");
  std::vector<std::string> argv{SS_HELPER, "--format", "json", "-o", js, "--symbol", "ss_region"};
  argv.insert(argv.end(), helper_args.begin(), helper_args.end());
  argv.push_back("--");
  argv.insert(argv.end(), plain.begin(), plain.end());
  Proc traced = run(argv);
  EXPECT_EQ(traced.status, 7) << traced.err;
  EXPECT_EQ(traced.out, untraced.out) << "the target's own output changed under tracing";
  json j = json::parse(slurp(js));
  auto want = expected(traced.out);
  auto got = recorded(j, main_tid_of(j));
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(got.size(), want.size());
  for (auto& [t, lines] : want) {
    EXPECT_EQ(got[t], lines) << "thread " << t;
  }
  EXPECT_EQ(j["dropped"], 0);
  EXPECT_EQ(j["stop_reason"], "exit");
  EXPECT_EQ(j["exit_code"], 7);
  // Every access is symbolized: script functions, or read/write for the system calls.
  for (const auto& a : j["accesses"]) EXPECT_FALSE(a["function"].get<std::string>().empty()) << a.dump();
}

class Singlestep : public ::testing::Test {
 protected:
  void SetUp() override { MEMTRACE_REQUIRE_ROOT(); }
};

TEST_F(Singlestep, OneThreadExact) { expect_exact({}, {"--mode", "step"}); }
TEST_F(Singlestep, OneThreadExactWithoutEmulation) { expect_exact({}, {"--mode", "step", "--no-emulate"}); }
TEST_F(Singlestep, FourThreadsExact) { expect_exact({"--threads", "4", "--rounds", "100"}, {"--mode", "step"}); }
TEST_F(Singlestep, FourThreadsExactWithoutEmulation) {
  expect_exact({"--threads", "4", "--rounds", "50"}, {"--mode", "step", "--no-emulate"});
}

TEST_F(Singlestep, SignalsDeliveredAsUntraced) { expect_exact({"--signals"}, {"--mode", "step"}); }

TEST_F(Singlestep, TextReportHasSummaryAndByteMap) {
  Proc r = run({SS_HELPER, "--mode", "step", "--symbol", "ss_region", "--", SS_TARGET});
  EXPECT_EQ(r.status, 7);
  EXPECT_NE(r.out.find("accesses recorded"), std::string::npos);
  EXPECT_NE(r.out.find("## accesses by instruction"), std::string::npos);
  EXPECT_NE(r.out.find("lock add qword ptr"), std::string::npos);
  EXPECT_NE(r.out.find("## byte map"), std::string::npos);
}

TEST_F(Singlestep, MaxStopsTrackingAndTargetRunsOn) {
  std::string js = tmp("max.json");
  Proc r = run({SS_HELPER, "--mode", "step", "--max", "5", "--format", "json", "-o", js, "--symbol", "ss_region", "--",
               SS_TARGET, "--threads", "4"});
  EXPECT_EQ(r.status, 7) << r.err;
  EXPECT_NE(r.out.find("done"), std::string::npos);
  json j = json::parse(slurp(js));
  EXPECT_EQ(j["accesses"].size(), 5u);
  EXPECT_EQ(j["stop_reason"], "max");
  auto want = expected(r.out);
  auto got = recorded(j, main_tid_of(j));
  EXPECT_EQ(got[0], std::vector<std::string>(want[0].begin(), want[0].begin() + 5));
}

TEST_F(Singlestep, SeveralRegionsAndAddrLen) {
  // Two --addr regions inside ss_region, found through the symbol on a first run.
  std::string js = tmp("sym.json");
  Proc probe = run({SS_HELPER, "--mode", "step", "--max", "1", "--format", "json", "-o", js, "--symbol", "ss_region",
                   "--", SS_TARGET});
  ASSERT_EQ(probe.status, 7);
  // ASLR moves it on the next run: attach instead, to a target waiting on stdin.
  int in[2];
  ASSERT_EQ(pipe(in), 0);
  std::string to = tmp("t.out"), te = tmp("t.err");
  pid_t target = spawn({SS_TARGET, "--wait-stdin"}, to, te, in[0]);
  close(in[0]);
  for (int i = 0; i < 200 && slurp(to).find("ready") == std::string::npos; i++)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // Region address from the target's maps + symbol: let the helper resolve it, then
  // give two --addr regions derived from it.
  std::string js1 = tmp("attach.json");
  std::string base_s;
  {
    Proc q = run({SS_HELPER, "-p", std::to_string(target), "--mode", "step", "--duration", "0.2", "--format", "json",
                 "-o", js1, "--symbol", "ss_region"});
    ASSERT_EQ(q.status, 0) << q.err;
    base_s = json::parse(slurp(js1))["regions"][0]["address"];
  }
  uint64_t base = std::stoull(base_s, nullptr, 16);
  char a1[32], a2[32];
  std::snprintf(a1, sizeof a1, "0x%llx", (unsigned long long)(base + 0));
  std::snprintf(a2, sizeof a2, "0x%llx", (unsigned long long)(base + 160));
  std::string js2 = tmp("attach2.json");
  std::string ho = tmp("h.out"), he = tmp("h.err");
  pid_t helper = spawn({SS_HELPER, "-p", std::to_string(target), "--mode", "step", "--format", "json", "-o", js2,
                        "--addr", a1, "--len", "8", "--addr", a2, "--len", "24", "--ready-fd", "3"},
                       ho, he);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(write(in[1], "go\n", 3), 3);
  close(in[1]);
  EXPECT_EQ(wait_status(target), 7);
  EXPECT_EQ(wait_status(helper), 0) << slurp(he);
  json j = json::parse(slurp(js2));
  ASSERT_EQ(j["regions"].size(), 2u);
  std::vector<std::string> got;
  for (const auto& a : j["accesses"]) {
    long off = static_cast<long>(std::stoull(a["address"].get<std::string>(), nullptr, 16) - base);
    got.push_back(std::to_string(off) + " " + std::to_string(a["size"].get<int>()) + " " + a["access"].get<std::string>());
  }
  std::vector<std::string> want{"0 1 read", "2 2 write", "4 4 read", "160 8 read-write", "168 4 read-write",
                                "176 8 read-write", "-4 8 read"};
  EXPECT_EQ(got, want);
  EXPECT_EQ(j["stop_reason"], "exit");
}

TEST_F(Singlestep, HardwareWatchpointPath) {
  std::string js = tmp("hw.json");
  Proc r = run({SS_HELPER, "--mode", "hw", "--format", "json", "-o", js, "--symbol", "ss_word", "--", SS_TARGET, "--hw",
               "20"});
  EXPECT_EQ(r.status, 7) << r.err;
  json j = json::parse(slurp(js));
  EXPECT_EQ(j["mode"], "hw-watchpoint");
  std::vector<std::string> want, got;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("W ", 0) == 0) want.push_back(line.substr(2));
  for (const auto& a : j["accesses"])
    got.push_back("+0 " + std::to_string(a["size"].get<int>()) + " " + a["access"].get<std::string>());
  EXPECT_EQ(got, want);
}

TEST_F(Singlestep, AutoModePicksHardwareForOneWord) {
  std::string js = tmp("auto.json");
  Proc r = run({SS_HELPER, "--format", "json", "-o", js, "--symbol", "ss_word", "--", SS_TARGET, "--hw", "3"});
  EXPECT_EQ(r.status, 7);
  EXPECT_EQ(json::parse(slurp(js))["mode"], "hw-watchpoint");
}

// Bad input: one clear line on stderr, non-zero status.
void expect_error(const std::vector<std::string>& argv, const std::string& needle) {
  Proc r = run(argv);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(Singlestep, ErrorsAreOneLine) {
  expect_error({SS_HELPER, "-p", "999999", "--addr", "0x1000", "--len", "4"}, "does not exist");
  expect_error({SS_HELPER, "--symbol", "no_such_variable", "--", SS_TARGET}, "symbol no_such_variable not found");
  expect_error({SS_HELPER, "--addr", "0x10", "--len", "4", "--", SS_TARGET}, "is not mapped");
  expect_error({SS_HELPER, "--symbol", "x", "--", "/nonexistent/program"}, "cannot start program");
  expect_error({SS_HELPER, "--addr", "0x10", "--", SS_TARGET}, "--len");
}

// Interrupting the helper restores the pages and detaches: the tracee completes
// with its normal output and status.
void interrupt_helper(int sig, bool attach) {
  std::string to = tmp("it.out"), te = tmp("it.err"), ho = tmp("ih.out"), he = tmp("ih.err");
  std::string js = tmp("int.json");
  pid_t helper, target = 0;
  int in[2] = {-1, -1};
  if (attach) {
    ASSERT_EQ(pipe(in), 0);
    target = spawn({SS_TARGET, "--wait-stdin", "--spin", "200000"}, to, te, in[0]);
    close(in[0]);
    for (int i = 0; i < 200 && slurp(to).find("ready") == std::string::npos; i++)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    helper = spawn({SS_HELPER, "-p", std::to_string(target), "--mode", "step", "--format", "json", "-o", js, "--symbol",
                    "ss_region"},
                   ho, he);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ASSERT_EQ(write(in[1], "go\n", 3), 3);
    close(in[1]);
  } else {
    helper = spawn({SS_HELPER, "--mode", "step", "--format", "json", "-o", js, "--symbol", "ss_region", "--", SS_TARGET,
                    "--spin", "200000", "--threads", "4"},
                   to, he);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  auto t0 = std::chrono::steady_clock::now();
  kill(helper, sig);
  int hs = wait_status(helper);
  if (attach) {
    EXPECT_EQ(hs, 0) << slurp(he);
    EXPECT_EQ(wait_status(target), 7);
  } else {
    EXPECT_EQ(hs, 7) << slurp(he);  // launch mode: the helper waits and returns the program's status
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 5.0) << "the tracee did not run on at full speed after the interrupt";
  std::string out = slurp(to);
  EXPECT_NE(out.find("done"), std::string::npos) << out;
  json j = json::parse(slurp(js));
  EXPECT_EQ(j["stop_reason"], "signal");
  EXPECT_GT(j["accesses"].size(), 0u);
}

TEST_F(Singlestep, SigintRestoresAndDetachesLaunched) { interrupt_helper(SIGINT, false); }
TEST_F(Singlestep, SigtermRestoresAndDetachesAttached) { interrupt_helper(SIGTERM, true); }
TEST_F(Singlestep, SighupRestoresAndDetachesAttached) { interrupt_helper(SIGHUP, true); }

// SIGKILL cannot be caught: the guardian process notices the helper's death and
// restores the protections. Here the helper is killed while the tracee is not
// stopped on a fault (blocked in read(2)); without the guardian the tracee's
// first access to the still-protected region would kill it with SIGSEGV.
// (A thread that is *in* a fault stop when the helper dies gets that SIGSEGV
// delivered by the kernel; nothing can prevent that - see the README.)
TEST_F(Singlestep, SigkillOfHelperGuardianRestores) {
  for (bool threads : {false, true}) {
    std::string to = tmp("k.out"), te = tmp("k.err"), ho = tmp("kh.out"), he = tmp("kh.err");
    int in[2];
    ASSERT_EQ(pipe(in), 0);
    std::vector<std::string> targv{SS_TARGET, "--wait-stdin", "--spin", "1000"};
    if (threads) targv.insert(targv.end(), {"--threads", "4", "--rounds", "100"});
    pid_t target = spawn(targv, to, te, in[0]);
    close(in[0]);
    for (int i = 0; i < 200 && slurp(to).find("ready") == std::string::npos; i++)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    pid_t helper = spawn({SS_HELPER, "-p", std::to_string(target), "--mode", "step", "--symbol", "ss_region"}, ho, he);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    kill(helper, SIGKILL);
    wait_status(helper);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the guardian restores
    ASSERT_EQ(write(in[1], "go\n", 3), 3);
    close(in[1]);
    EXPECT_EQ(wait_status(target), 7) << "threads=" << threads << " " << slurp(te);
    EXPECT_NE(slurp(to).find("done"), std::string::npos);
    // Tracing without the guardian shows what it prevents.
  }
}

TEST_F(Singlestep, DurationStopsTracking) {
  std::string js = tmp("dur.json");
  auto t0 = std::chrono::steady_clock::now();
  Proc r = run({SS_HELPER, "--mode", "step", "--duration", "0.5", "--format", "json", "-o", js, "--symbol", "ss_region",
               "--", SS_TARGET, "--spin", "100000"});
  EXPECT_EQ(r.status, 7);
  EXPECT_EQ(json::parse(slurp(js))["stop_reason"], "duration");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

}  // namespace

namespace {

// --track-allocs-from: blocks returned to make_blocks are tracked until freed.
TEST(SinglestepAllocs, PerBlockCountsFromCallSite) {
  MEMTRACE_REQUIRE_ROOT();
  std::string js = tmp("allocs.json");
  Proc r = run({SS_HELPER, "--track-allocs-from", "make_blocks", "--format", "json", "-o", js, "--", SS_ALLOC_TARGET});
  ASSERT_EQ(r.status, 0) << r.err;
  json j = json::parse(slurp(js));
  ASSERT_EQ(j["blocks"].size(), 3u) << j.dump();
  std::string got;
  int i = 0;
  for (const auto& b : j["blocks"])
    got += "B" + std::to_string(i++) + " " + std::to_string(b["size"].get<int>()) + " reads " +
           std::to_string(b["reads"].get<int>()) + " writes " + std::to_string(b["writes"].get<int>()) + "\n";
  EXPECT_EQ(got + "done\n", r.out);
  for (const auto& b : j["blocks"]) EXPECT_GT(b["free_time_ns"].get<uint64_t>(), 0u);
}

}  // namespace
