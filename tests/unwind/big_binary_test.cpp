// The unwind tables on the largest binary on the machine: clang-14 maps
// libLLVM and libclang-cpp (~2M CFI rows, 20 MiB of shards), more than the
// shards added at load. The tool grows the row space at run time; stacks
// through LLVM come out complete. A cap (--unwind-mb) below what clang needs
// leaves files to frame pointers, says which, and counts them.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "loader/harness.h"  // tests/loader: runs memtrace-bpf
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

constexpr const char* kClang = "/usr/bin/clang-14";

struct Compile {
  std::string src, obj;
  Compile() {
    std::string base = "/tmp/memtrace-bigbin-" + std::to_string(getpid());
    src = base + ".c";
    obj = base + ".o";
    std::ofstream(src) << "#include <stdio.h>\n#include <stdlib.h>\n"
                          "int main(int argc, char **argv) { char *p = malloc(argc * 10);\n"
                          "  snprintf(p, 10, \"%d\", argc); puts(p); free(p); return 0; }\n";
  }
  ~Compile() {
    unlink(src.c_str());
    unlink(obj.c_str());
  }
  std::vector<std::string> argv() const { return {"--", kClang, "-O2", "-c", src, "-o", obj}; }
};

uint64_t stat_of(const json& rep, const char* group, const char* key) {
  if (!rep.contains(group) || !rep[group].contains(key)) return UINT64_MAX;
  return rep[group][key].get<uint64_t>();
}

}  // namespace

TEST(BigBinary, ClangStacksCompleteAsTheRowSpaceGrows) {
  MEMTRACE_REQUIRE_ROOT();
  ASSERT_EQ(access(kClang, X_OK), 0) << kClang << " (scripts/deps.txt: clang)";
  Compile c;
  ToolRun t = run_tool(c.argv());
  ASSERT_EQ(t.code, 0) << t.err;
  struct stat st {};
  EXPECT_EQ(stat(c.obj.c_str(), &st), 0) << "clang did not produce its object";
  const json& r = t.report;
  ASSERT_TRUE(r.is_object()) << t.err;
  EXPECT_EQ(stat_of(r, "dropped", "unwind_table_failed"), 0u) << t.err;
  EXPECT_EQ(stat_of(r, "dropped", "unwind_table_over_cap"), 0u) << t.err;
  EXPECT_EQ(r.value("errors", json::array()).dump().find("unwind"), std::string::npos) << r["errors"].dump();
  // Beyond the 4 shards added at load: libLLVM alone needs ~4 more.
  EXPECT_GT(stat_of(r, "stats", "unwind_shards"), 4u) << r["stats"].dump();
  EXPECT_GT(stat_of(r, "stats", "unwind_table_peak_bytes"), uint64_t(16) << 20) << r["stats"].dump();
  uint64_t stacks = stat_of(r, "stats", "unwind_stacks"), cut = stat_of(r, "stats", "stack_truncated");
  uint64_t no_table = stat_of(r, "stats", "unwind_trunc_no_table");
  ASSERT_GT(stacks, 5000u) << r["stats"].dump();
  // Before the shards: 14,586 of 15,955 truncated (rows array full). Now
  // only the depth limit cuts a few (deep recursion in the parser).
  EXPECT_LT(cut * 100, stacks) << "more than 1% of stacks truncated: " << r["stats"].dump();
  EXPECT_EQ(no_table, 0u) << r["stats"].dump();
  // A stack that goes through LLVM reaches main.
  const json* p = find_comm(r, "clang-14");
  if (!p) p = find_comm(r, "clang");
  ASSERT_TRUE(p) << r.dump().substr(0, 2000);
  bool llvm_to_main = false;
  for (const auto& g : (*p)["leaks"]) {
    bool llvm = false, main = false;
    for (const auto& f : g["stack"]) {
      std::string fn = f.value("function", "");
      llvm |= fn.rfind("llvm::", 0) == 0 || fn.rfind("clang::", 0) == 0;
      main |= fn == "main";
    }
    llvm_to_main |= llvm && main;
  }
  EXPECT_TRUE(llvm_to_main) << (*p)["leaks"].dump().substr(0, 4000);
}

TEST(BigBinary, CapLeavesFilesToFramePointersAndSaysWhich) {
  MEMTRACE_REQUIRE_ROOT();
  ASSERT_EQ(access(kClang, X_OK), 0) << kClang << " (scripts/deps.txt: clang)";
  Compile c;
  std::vector<std::string> args = {"--unwind-mb", "8"};
  for (auto& a : c.argv()) args.push_back(a);
  ToolRun t = run_tool(args);
  ASSERT_EQ(t.code, 0) << t.err;
  struct stat st {};
  EXPECT_EQ(stat(c.obj.c_str(), &st), 0) << "clang did not produce its object";
  const json& r = t.report;
  ASSERT_TRUE(r.is_object()) << t.err;
  uint64_t over = stat_of(r, "dropped", "unwind_table_over_cap");
  EXPECT_GE(over, 1u) << r["dropped"].dump();
  EXPECT_NE(over, UINT64_MAX);
  EXPECT_LE(stat_of(r, "stats", "unwind_shards"), 4u) << r["stats"].dump();
  // One error per file left out, naming it (not one per process or retry).
  size_t llvm = 0, capped = 0;
  for (const auto& e : r.value("errors", json::array())) {
    std::string s = e.get<std::string>();
    if (s.find("would pass the cap on unwind tables (8.0 MiB, --unwind-mb)") == std::string::npos) continue;
    capped++;
    llvm += s.find("/libLLVM-14.so") != std::string::npos;
  }
  EXPECT_EQ(llvm, 1u) << r["errors"].dump();
  EXPECT_EQ(capped, std::min<uint64_t>(over, 5)) << r["errors"].dump();  // the report keeps 5 unwind errors
}
