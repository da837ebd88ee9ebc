// Continuous profiles (issue 19): --pprof-dir DIR --pprof-every S writes a
// pprof per traced process every S seconds and at the end. A target that
// runs for a few seconds (tests/targets/paced_leak) gets several files, each
// read by Go's own `go tool pprof`; the last one's in-use totals are the JSON
// report's, the alloc counts of all of them add up to its totals (each file
// counts the allocations since the previous one); --pprof-keep N leaves
// exactly N; a DIR that cannot be used is refused before anything runs.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <regex>
#include <sstream>

#include "harness.h"
#include "slurp.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

std::string go_binary() {
  for (const char* p : {"/usr/bin/go", "/usr/lib/go/bin/go", "/usr/local/go/bin/go"})
    if (access(p, X_OK) == 0) return p;
  return "";
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> v;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) v.push_back(e->d_name);
    closedir(d);
  }
  std::sort(v.begin(), v.end());  // one process: name order is time order
  return v;
}

// The four values summed over the samples of `go tool pprof -raw FILE`.
struct Totals {
  uint64_t alloc_objects = 0, alloc_space = 0, inuse_objects = 0, inuse_space = 0;
  bool ok = false;
  std::string text;
};
Totals pprof_totals(const std::string& file) {
  Totals t;
  ToolRun r = run_argv({go_binary(), "tool", "pprof", "-raw", file});
  t.text = r.out.substr(0, 3000) + r.err.substr(0, 1000);
  if (r.code != 0) return t;
  std::istringstream in(r.out);
  std::string line;
  static const std::regex sample(R"(^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+):)");
  bool samples = false;
  while (std::getline(in, line)) {
    if (line == "Samples:") {
      samples = true;
      std::getline(in, line);
      t.ok = line.find("alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes") !=
             std::string::npos;
      continue;
    }
    if (line == "Locations") samples = false;
    std::smatch m;
    if (samples && std::regex_search(line, m, sample)) {
      t.alloc_objects += std::stoull(m[1]);
      t.alloc_space += std::stoull(m[2]);
      t.inuse_objects += std::stoull(m[3]);
      t.inuse_space += std::stoull(m[4]);
    }
  }
  return t;
}

class PprofDir : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (go_binary().empty()) MEMTRACE_SKIP_OR_FAIL("no Go toolchain for `go tool pprof` (Debian golang-go)");
    dir_ = "/tmp/memtrace-pprofdir-" + std::to_string(getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) (void)!system(("rm -rf " + dir_).c_str());
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(PprofDir, PeriodicFilesAddUpToTheReport) {
  std::string out = path("profiles/sub");  // created, parents too
  ToolRun r = run_argv({tool(), "--pprof-dir", out, "--pprof-every", "0.5", "--pprof-keep", "100", "-o",
                        path("a.json"), "--", target("paced_leak"), "--seconds", "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  ASSERT_TRUE(rep.is_object());
  const json* p = find_comm(rep, "paced_leak");
  ASSERT_NE(p, nullptr) << rep.dump();
  const json& s = (*p)["summary"];
  int pid = (*p)["pid"];

  std::vector<std::string> files = list_dir(out);
  // 3 s at one round per 0.5 s, and the last at the end; a loaded machine
  // may lose a round or two to the program's start.
  ASSERT_GE(files.size(), 4u) << r.err;
  static const std::regex name("paced_leak-" + std::to_string(pid) + R"(-\d{8}T\d{6}\.\d{3}Z\.pb\.gz)");
  uint64_t allocs = 0, allocated = 0, last_inuse = 0;
  for (const auto& f : files) {
    SCOPED_TRACE(f);
    EXPECT_TRUE(std::regex_match(f, name));  // no temporary left, nothing else
    struct stat st;
    ASSERT_EQ(::stat((out + "/" + f).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0644u);
    Totals t = pprof_totals(out + "/" + f);
    ASSERT_TRUE(t.ok) << t.text;
    allocs += t.alloc_objects;
    allocated += t.alloc_space;
    // A block kept every 10 ms: each file holds at least what the one before held.
    EXPECT_GE(t.inuse_space, last_inuse) << t.text;
    last_inuse = t.inuse_space;
    if (&f == &files.back()) {
      EXPECT_EQ(t.inuse_space, s["in_use_bytes"].get<uint64_t>()) << t.text;
      EXPECT_EQ(t.inuse_objects, s["in_use_blocks"].get<uint64_t>()) << t.text;
    } else if (&f == &files.front()) {
      EXPECT_GT(t.inuse_space, 0u);
    }
  }
  // Each file counts the allocations since the previous one.
  EXPECT_EQ(allocs, s["allocs"].get<uint64_t>());
  EXPECT_EQ(allocated, s["bytes_allocated"].get<uint64_t>());
  // The kept blocks are the program's own stack in the last file.
  ToolRun top = run_argv({go_binary(), "tool", "pprof", "-top", "-sample_index=inuse_space", "-unit=B",
                          out + "/" + files.back()});
  ASSERT_EQ(top.code, 0) << top.err;
  EXPECT_NE(top.out.find("leak_here"), std::string::npos) << top.out;
  const json& st = rep["stats"];
  EXPECT_EQ(st["pprof_dir_files"].get<size_t>(), files.size());
  EXPECT_EQ(st["pprof_dir_files_removed"].get<uint64_t>(), 0u);
  EXPECT_EQ(st["pprof_dir_write_errors"].get<uint64_t>(), 0u);
  EXPECT_GE(st["pprof_dir_rounds"].get<uint64_t>(), files.size());
}

// A process that exits while tracing goes on (-c): its image is sealed
// (heap_model.h: its stacks get other ids); its last file, in the next
// round, still counts only the allocations since its previous one.
TEST_F(PprofDir, AProcessThatEndsGetsItsLastFile) {
  std::string out = path("p");
  Child t = spawn({tool(), "-c", "paced_leak", "--duration", "4.5", "--pprof-dir", out, "--pprof-every", "0.5",
                   "--pprof-keep", "100", "-o", path("a.json")});
  close(t.in);
  std::string err;
  ASSERT_TRUE(read_until(t.err, "tracing", &err)) << err;
  ToolRun prog = run_argv({target("paced_leak"), "--seconds", "2"});
  ASSERT_EQ(prog.code, 0);
  std::thread drain([&] { err += read_all(t.err); });
  read_all(t.out);
  drain.join();
  ASSERT_EQ(wait_exit(t.pid), 0) << err;
  close(t.out);
  close(t.err);
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  ASSERT_TRUE(rep.is_object());
  const json* p = find_comm(rep, "paced_leak");
  ASSERT_NE(p, nullptr) << rep.dump();
  const json& s = (*p)["summary"];
  std::string prefix = "paced_leak-" + std::to_string((*p)["pid"].get<int>()) + "-";
  std::vector<std::string> files;
  for (const auto& f : list_dir(out))
    if (f.rfind(prefix, 0) == 0) files.push_back(f);
  ASSERT_GE(files.size(), 3u) << err;
  uint64_t allocs = 0, allocated = 0;
  Totals last;
  for (const auto& f : files) {
    Totals t = pprof_totals(out + "/" + f);
    ASSERT_TRUE(t.ok) << f << "\n" << t.text;
    allocs += t.alloc_objects;
    allocated += t.alloc_space;
    last = t;
  }
  EXPECT_EQ(allocs, s["allocs"].get<uint64_t>());
  EXPECT_EQ(allocated, s["bytes_allocated"].get<uint64_t>());
  EXPECT_EQ(last.inuse_space, s["in_use_bytes"].get<uint64_t>());
  // Its last file came in the round after its end, while tracing went on
  // (the rounds after it, and the end's, had nothing to write).
  EXPECT_EQ(rep["stats"]["pprof_dir_files"].get<size_t>(), files.size());
  EXPECT_GE(rep["stats"]["pprof_dir_rounds"].get<size_t>(), files.size() + 2) << err;
}

TEST_F(PprofDir, RotationKeepsTheNewestN) {
  ToolRun r = run_argv({tool(), "--pprof-dir", dir_ + "/p", "--pprof-every", "0.3", "--pprof-keep", "2", "-o",
                        path("a.json"), "--", target("paced_leak"), "--seconds", "2.5"});
  ASSERT_EQ(r.code, 0) << r.err;
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  ASSERT_TRUE(rep.is_object());
  const json* p = find_comm(rep, "paced_leak");
  ASSERT_NE(p, nullptr);
  std::vector<std::string> files = list_dir(dir_ + "/p");
  ASSERT_EQ(files.size(), 2u);
  const json& st = rep["stats"];
  uint64_t written = st["pprof_dir_files"];
  EXPECT_GT(written, 2u);
  EXPECT_EQ(st["pprof_dir_files_removed"].get<uint64_t>(), written - 2);
  // The two kept are the newest: the last one is the end's.
  Totals t = pprof_totals(dir_ + "/p/" + files.back());
  ASSERT_TRUE(t.ok) << t.text;
  EXPECT_EQ(t.inuse_space, (*p)["summary"]["in_use_bytes"].get<uint64_t>());
}

TEST_F(PprofDir, BadDirIsRefusedBeforeTracing) {
  ASSERT_EQ(system(("touch " + path("file")).c_str()), 0);
  struct Case {
    std::vector<std::string> args;
    const char* says;
  };
  std::vector<Case> cases = {
      {{"--pprof-dir", path("file")}, ": not a directory"},
      {{"--pprof-dir", path("file/sub")}, "cannot create directory"},
      {{"--pprof-every", "1"}, "are for --pprof-dir"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {tool()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.insert(argv.end(), {"-o", path("a.json"), "--", target("paced_leak"), "--seconds", "0"});
    ToolRun r = run_argv(argv);
    SCOPED_TRACE(c.args[1]);
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");  // paced_leak never ran (it prints kept=N)
    if (c.args[0] == "--pprof-dir") {
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
  }
}

}  // namespace
