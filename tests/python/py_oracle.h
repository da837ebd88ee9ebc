// The oracle of the Python-frames tests (issue 32): tracemalloc inside the
// traced interpreter (tests/python/py_frames_target.py prints what it charges
// to its line and the chain of lines above it), and the tool's report read
// the same way: the bytes, blocks and Python frames of the stacks that name
// that line. Shared by python_frames_test (Debian 12's 3.11) and
// python313_frames_test (Debian 13's 3.13 in a chroot).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "harness.h"

namespace memtrace::testing {

using json = nlohmann::json;

// "line 17 all 122600 bytes 81 blocks big 120040 bytes 40 blocks"
struct Oracle {
  int line = 0;
  long all_bytes = 0, all_blocks = 0, big_bytes = 0, big_blocks = 0;
  std::string chain;
};
inline Oracle parse_oracle(const std::string& out) {
  Oracle o;
  auto at = out.find("line ");
  if (at != std::string::npos)
    sscanf(out.c_str() + at, "line %d all %ld bytes %ld blocks big %ld bytes %ld blocks", &o.line, &o.all_bytes,
           &o.all_blocks, &o.big_bytes, &o.big_blocks);
  if (auto c = out.find("chain "); c != std::string::npos) o.chain = out.substr(c + 6, out.find('\n', c) - c - 6);
  return o;
}

// A report stack's Python frames, innermost first: "name:line" of frames in module "python".
inline std::string py_chain(const json& stack, std::vector<std::string>* names = nullptr) {
  std::string s;
  for (const auto& f : stack) {
    if (f.value("module", "") != "python") continue;
    std::string file = f.value("file", "");
    file = file.substr(file.rfind('/') + 1);
    if (!s.empty()) s += " < ";
    s += file + ":" + std::to_string(f.value("line", 0));
    if (names) names->push_back(f.value("function", ""));
  }
  return s;
}

// The stacks that hold the 40 blocks of 3,000 bytes: their Python frames as
// tracemalloc's traceback names them, and the bytes charged to the line.
struct Charged {
  long bytes = 0, blocks = 0;
  std::string chain;
  std::vector<std::string> names;
};
inline Charged charged(const json& rep, const std::string& comm, int line, long min_size) {
  Charged ch;
  const json* p = find_comm(rep, comm);
  if (!p) return ch;
  for (const auto& g : p->value("leaks", json::array())) {
    if (g.value("bytes", 0l) / std::max(1l, g.value("blocks", 1l)) <= min_size) continue;
    std::vector<std::string> names;
    std::string c = py_chain(g["stack"], &names);
    if (c.rfind("py_frames_target.py:" + std::to_string(line) + " ", 0) != 0) continue;
    ch.bytes += g.value("bytes", 0l);
    ch.blocks += g.value("blocks", 0l);
    ch.chain = c;
    ch.names = names;
  }
  return ch;
}

inline void expect_same_as_tracemalloc(const ToolRun& r, const Oracle& o, const std::string& comm = "python3.11") {
  ASSERT_GT(o.line, 0) << r.out;
  ASSERT_TRUE(r.report.is_object()) << r.err;
  Charged ch = charged(r.report, comm, o.line, 512);
  EXPECT_EQ(ch.chain, o.chain) << r.err;
  EXPECT_EQ(ch.names, (std::vector<std::string>{"inner", "middle", "outer", "<module>"}));
  EXPECT_NEAR(double(ch.bytes), double(o.big_bytes), 0.01 * o.big_bytes);
  EXPECT_NEAR(double(ch.blocks), double(o.big_blocks), 0.01 * o.big_blocks);
  // A few hits at start-up find a thread state not filled in yet (16 here): counted, not hidden.
  EXPECT_LT(r.report["dropped"].value("python_frames_unreadable", 1000), 100) << r.report["dropped"].dump();
  EXPECT_EQ(r.report["dropped"].value("python_code_unreadable", 1), 0);
}

}  // namespace memtrace::testing
