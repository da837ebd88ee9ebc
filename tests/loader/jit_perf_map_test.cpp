// JIT code named through perf maps (src/symbolize/perf_map.h): node
// --perf-basic-prof writes /tmp/perf-PID.map; the Buffers a named JS
// function keeps (their backing stores calloc'd by node's ArrayBuffer
// allocator, outside V8's heap) are charged to a stack that names it, live
// and in the replay of a recording. The BPF walk goes through V8's code by
// frame pointer (no CFI rows in anonymous memory).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

const char* kNode = "/usr/bin/node";
std::string script() { return std::string(SOURCE_DIR) + "/tests/targets/node_buffers.js"; }

class JitPerfMap : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (access(kNode, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/node");
  }
};

// Blocks of 64 KiB in leak groups whose stack names fn in a perf map
// (V8 runs keepBuffersHere interpreted, then compiled: a group for each).
long named_buffers(const json& rep, const std::string& fn, std::string* why) {
  long n = 0;
  if (!rep.is_object() || !rep.contains("processes")) return -1;
  for (const auto& p : rep["processes"])
    for (const auto& g : p["leaks"]) {
      if (g["bytes"].get<long>() != g["blocks"].get<long>() * 65536) continue;
      bool named = false;
      for (const auto& f : g["stack"])
        if (f["function"].get<std::string>().find(fn) != std::string::npos &&
            f["module"].get<std::string>().rfind("/tmp/perf-", 0) == 0)
          named = true;
      if (named) n += g["blocks"].get<long>();
      else *why += g.dump().substr(0, 1500) + "\n";
    }
  return n;
}

}  // namespace

TEST_F(JitPerfMap, BuffersKeptByAJsFunctionAreChargedToItLiveAndInReplay) {
  const long N = 40;
  std::string rec = "/tmp/memtrace-test-jit-" + std::to_string(getpid()) + ".mtr";
  ToolRun r = run_tool({"--top", "50", "--record", rec, "--", kNode, "--perf-basic-prof",
                        "--interpreted-frames-native-stack", script(), std::to_string(N)});
  ASSERT_EQ(r.code, 128 + 9) << r.err;  // the target ends itself with SIGKILL (no teardown)
  ASSERT_NE(r.out.find("kept " + std::to_string(N)), std::string::npos) << r.out;
  std::string why;
  EXPECT_EQ(named_buffers(r.report, "keepBuffersHere", &why), N) << why;

  // The recording keeps the perf map: replay names the same frames.
  std::string out = "/tmp/memtrace-test-jit-" + std::to_string(getpid()) + ".json";
  ToolRun rp = run_argv({tool(), "replay", rec, "--format", "json", "--top", "50", "-o", out});
  ASSERT_EQ(rp.code, 0) << rp.err;
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  json rj = json::parse(ss.str(), nullptr, false);
  why.clear();
  EXPECT_EQ(named_buffers(rj, "keepBuffersHere", &why), N) << why;
  unlink(rec.c_str());
  unlink(out.c_str());
}
