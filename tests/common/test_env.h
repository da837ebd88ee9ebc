// Environment checks shared by the tests. A test that cannot run here (not
// root, no BPF) skips on a laptop, but under CI=true a skip is a failure.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace memtrace::testing {

inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

#define MEMTRACE_SKIP_OR_FAIL(why)                                   \
  do {                                                               \
    if (::memtrace::testing::under_ci()) FAIL() << "cannot run under CI: " << (why); \
    GTEST_SKIP() << (why);                                           \
  } while (0)

#define MEMTRACE_REQUIRE_ROOT()                                      \
  do {                                                               \
    if (geteuid() != 0) MEMTRACE_SKIP_OR_FAIL("needs root (BPF, uprobes, ptrace)"); \
  } while (0)

}  // namespace memtrace::testing
