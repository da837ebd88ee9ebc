// Helpers the --inject tests share (inject_test.cpp, entries_test.cpp):
// reading a target's "ready PID" and "expect ..." lines, exit codes, counts
// in a report.
#pragma once
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "../loader/harness.h"

namespace memtrace::testing {


inline std::string slurp_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Expect {
  long allocs = -1, frees = -1, bytes = -1, leaked_blocks = -1, leaked_bytes = -1;
};

inline Expect parse_expect(const std::string& out) {
  Expect e;
  auto at = out.find("expect ");
  if (at != std::string::npos)
    sscanf(out.c_str() + at, "expect allocs=%ld frees=%ld bytes=%ld leaked_blocks=%ld leaked_bytes=%ld", &e.allocs,
           &e.frees, &e.bytes, &e.leaked_blocks, &e.leaked_bytes);
  return e;
}

inline pid_t ready_pid(Child& c, std::string* acc) {
  if (!read_until(c.out, "ready ", acc) || !read_until(c.out, "\n", acc)) return -1;
  return static_cast<pid_t>(atoi(acc->c_str() + acc->find("ready ") + 6));
}

// Exit code of pid within timeout_ms, or -1 (then it is killed).
inline int exit_within(pid_t pid, int timeout_ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

inline size_t count_of(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

inline void expect_report_exact(const nlohmann::json& p, const Expect& e) {
  ASSERT_GT(e.allocs, 0);
  EXPECT_EQ(u(p, "allocs"), e.allocs);
  EXPECT_EQ(u(p, "frees"), e.frees);
  EXPECT_EQ(u(p, "bytes_allocated"), e.bytes);
  EXPECT_EQ(u(p, "in_use_blocks"), e.leaked_blocks);
  EXPECT_EQ(u(p, "in_use_bytes"), e.leaked_bytes);
}

// Two runs of the target started at their exec (ld.so's and libc's own
// start-up allocations in both): their difference is exactly the rounds'.
inline void expect_rounds_exact(const nlohmann::json& p, const nlohmann::json& p0, const Expect& e, const Expect& e0) {
  EXPECT_EQ(u(p, "allocs") - u(p0, "allocs"), e.allocs - e0.allocs);
  EXPECT_EQ(u(p, "frees") - u(p0, "frees"), e.frees - e0.frees);
  EXPECT_EQ(u(p, "bytes_allocated") - u(p0, "bytes_allocated"), e.bytes - e0.bytes);
  EXPECT_EQ(u(p, "in_use_blocks") - u(p0, "in_use_blocks"), e.leaked_blocks - e0.leaked_blocks);
  EXPECT_EQ(u(p, "in_use_bytes") - u(p0, "in_use_bytes"), e.leaked_bytes - e0.leaked_bytes);
}

inline void expect_nothing_dropped(const nlohmann::json& j) {
  for (const char* k : {"inject_ring_full", "inject_malformed", "stack_record_missing", "malformed"})
    EXPECT_EQ(j["dropped"][k].get<long>(), 0) << k << " in " << j["dropped"].dump();
}

}  // namespace memtrace::testing
