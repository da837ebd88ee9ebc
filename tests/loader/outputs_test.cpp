// Several -o files in one run (issue 19, outputs): JSON, text, folded stacks
// and pprof from one trace of tests/targets/alloc_rounds (which knows its
// counts), and from `replay` of its recording. The folded and pprof totals
// must be the JSON's; pprof is read by Go's own `go tool pprof`.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "harness.h"
#include "heap/heap_model.h"
#include "report/folded.h"
#include "report/outputs.h"
#include "report/pprof.h"
#include "slurp.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

constexpr long kRounds = 200;

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

using ToolOut = ToolRun;  // harness.h

ToolOut run(const std::vector<std::string>& argv) { return run_argv(argv); }

// `go tool pprof ARGS FILE`'s stdout (pprof writes nothing anywhere else
// with -raw and -top).
ToolOut pprof(const std::vector<std::string>& args, const std::string& file) {
  std::vector<std::string> argv = {go_binary(), "tool", "pprof"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back(file);
  return run(argv);
}

// Sums of the four values over the samples of `go tool pprof -raw`:
// "   alloc_objects alloc_space inuse_objects inuse_space: loc loc ...".
struct RawTotals {
  uint64_t alloc_objects = 0, alloc_space = 0, inuse_objects = 0, inuse_space = 0;
  size_t samples = 0;
  std::string sample_types, locations;
};
RawTotals raw_totals(const std::string& raw) {
  RawTotals t;
  std::istringstream in(raw);
  std::string line;
  static const std::regex sample(R"(^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+):)");
  bool in_samples = false, in_locations = false;
  while (std::getline(in, line)) {
    if (line == "Samples:") {
      in_samples = true;
      std::getline(in, t.sample_types);
      continue;
    }
    if (line == "Locations") {
      in_samples = false;
      in_locations = true;
      continue;
    }
    if (line == "Mappings") in_locations = false;
    std::smatch m;
    if (in_samples && std::regex_search(line, m, sample)) {
      t.alloc_objects += std::stoull(m[1]);
      t.alloc_space += std::stoull(m[2]);
      t.inuse_objects += std::stoull(m[3]);
      t.inuse_space += std::stoull(m[4]);
      t.samples++;
    }
    if (in_locations) t.locations += line + "\n";
  }
  return t;
}

struct Folded {
  std::map<std::string, uint64_t> by_root;  // "comm (pid)" -> sum of values
  std::map<std::string, uint64_t> by_leak;  // root -> sum of lines through leak_here
  size_t lines = 0, malformed = 0;
};
Folded parse_folded(const std::string& text) {
  Folded f;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    size_t sp = line.rfind(' ');
    size_t semi = line.find(';');
    if (sp == std::string::npos || semi == std::string::npos || semi > sp) {
      f.malformed++;
      continue;
    }
    uint64_t v = std::stoull(line.substr(sp + 1));
    std::string root = line.substr(0, semi);
    f.by_root[root] += v;
    if (line.find(";leak_here") != std::string::npos) f.by_leak[root] += v;
    f.lines++;
  }
  return f;
}

class Outputs : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (go_binary().empty()) MEMTRACE_SKIP_OR_FAIL("no Go toolchain for `go tool pprof` (Debian golang-go)");
    dir_ = "/tmp/memtrace-outputs-" + std::to_string(getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) (void)!system(("rm -rf " + dir_).c_str());
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // The four files of one run (tracing or replay) against its JSON report.
  void check_outputs(const std::string& what) {
    SCOPED_TRACE(what);
    json rep = json::parse(slurp(path("a.json")), nullptr, false);
    ASSERT_TRUE(rep.is_object()) << slurp(path("a.json"));
    const json* p = find_comm(rep, "alloc_rounds");
    ASSERT_NE(p, nullptr) << rep.dump();
    const json& s = (*p)["summary"];
    uint64_t in_use = s["in_use_bytes"], blocks = s["in_use_blocks"], allocs = s["allocs"],
             allocated = s["bytes_allocated"];
    // What alloc_rounds says: its constructor's 12345 bytes and 33 per round
    // (plus the round it measures with) are never freed.
    EXPECT_EQ(in_use, 12345u + 33u * (kRounds + 1));
    std::string root = "alloc_rounds (" + std::to_string((*p)["pid"].get<int>()) + ")";

    // Folded: live bytes at the end, per process and through leak_here.
    Folded f = parse_folded(slurp(path("b.folded")));
    EXPECT_EQ(f.malformed, 0u);
    EXPECT_GT(f.lines, 0u);
    EXPECT_EQ(f.by_root[root], in_use) << slurp(path("b.folded"));
    EXPECT_EQ(f.by_leak[root], 33u * (kRounds + 1)) << slurp(path("b.folded"));
    // Outermost first: main before leak_here on its line.
    std::string folded = slurp(path("b.folded"));
    size_t leak = folded.find(";leak_here");
    ASSERT_NE(leak, std::string::npos);
    size_t line_start = folded.rfind('\n', leak);
    line_start = line_start == std::string::npos ? 0 : line_start + 1;
    EXPECT_NE(folded.substr(line_start, leak - line_start).find(";main"), std::string::npos) << folded;

    // pprof, read by Go's pprof: the four sample types, totals equal to the JSON's.
    ToolOut raw = pprof({"-raw"}, path("c.pb.gz"));
    ASSERT_EQ(raw.code, 0) << raw.err;
    RawTotals t = raw_totals(raw.out);
    EXPECT_NE(t.sample_types.find("alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes"),
              std::string::npos)
        << raw.out.substr(0, 2000);
    EXPECT_EQ(t.inuse_space, in_use);
    EXPECT_EQ(t.inuse_objects, blocks);
    EXPECT_EQ(t.alloc_objects, allocs);
    EXPECT_EQ(t.alloc_space, allocated);
    EXPECT_NE(t.locations.find("leak_here"), std::string::npos) << t.locations.substr(0, 4000);
    EXPECT_NE(raw.out.find("comm:[alloc_rounds]"), std::string::npos) << raw.out.substr(0, 4000);
    ToolOut top = pprof({"-top", "-sample_index=inuse_space", "-unit=B", "-nodecount=100"}, path("c.pb.gz"));
    ASSERT_EQ(top.code, 0) << top.err;
    EXPECT_NE(top.out.find("leak_here"), std::string::npos) << top.out;
    EXPECT_NE(top.out.find(" of " + std::to_string(in_use) + "B total"), std::string::npos) << top.out;

    std::string text = slurp(path("d.txt"));
    EXPECT_NE(text.find("in use at exit: " + std::to_string(in_use) + " bytes"), std::string::npos) << text;
  }

  std::string dir_;
};

TEST_F(Outputs, EveryFormatFromOneTrace) {
  ToolOut r = run({tool(), "-o", path("a.json"), "-o", path("b.folded"), "-o", path("c.pb.gz"), "-o", path("d.txt"),
               "--", target("alloc_rounds"), "--rounds", std::to_string(kRounds)});
  ASSERT_EQ(r.code, 0) << r.err;
  // The report went to the files, not to stderr.
  EXPECT_EQ(r.err.find("HEAP SUMMARY"), std::string::npos) << r.err;
  check_outputs("trace");
  struct stat st;
  ASSERT_EQ(::stat(path("c.pb.gz").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

// --sample-bytes: pprof carries the rate (period, as Go's heap profiles
// give MemProfileRate) and says its values are estimates (a comment); a
// full trace has period 1 and no comment.
TEST_F(Outputs, SampledPprofCarriesItsRateAndSaysItEstimates) {
  if (go_binary().empty()) MEMTRACE_SKIP_OR_FAIL("no Go toolchain for `go tool pprof` (Debian golang-go)");
  for (bool sampled : {true, false}) {
    std::vector<std::string> argv = {tool(), "-o", path("s.pb.gz"), "--", target("alloc_rounds"), "--rounds", "20"};
    if (sampled) argv.insert(argv.begin() + 1, {"--sample-bytes", "65536"});
    ToolOut r = run(argv);
    ASSERT_EQ(r.code, 0) << r.err;
    ToolOut raw = pprof({"-raw"}, path("s.pb.gz"));
    ASSERT_EQ(raw.code, 0) << raw.err;
    EXPECT_NE(raw.out.find(sampled ? "Period: 65536\n" : "Period: 1\n"), std::string::npos) << raw.out.substr(0, 600);
    EXPECT_EQ(raw.out.find("Comment: memtrace-bpf: sampled, one allocation per 65536 bytes on average; every value "
                           "is an unbiased estimate") != std::string::npos,
              sampled)
        << raw.out.substr(0, 600);
  }
}

TEST_F(Outputs, EveryFormatFromReplay) {
  ToolOut r = run({tool(), "--record", path("run.mtr"), "--format", "json", "-o", path("live.json"), "--",
               target("alloc_rounds"), "--rounds", std::to_string(kRounds)});
  ASSERT_EQ(r.code, 0) << r.err;
  ToolOut p = run({tool(), "replay", path("run.mtr"), "-o", path("a.json"), "-o", path("b.folded"), "-o",
               path("c.pb.gz"), "-o", path("d.txt")});
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(p.out, "");  // every report went to its file
  check_outputs("replay");
  json live = json::parse(slurp(path("live.json")), nullptr, false);
  json rep = json::parse(slurp(path("a.json")), nullptr, false);
  const json* a = find_comm(live, "alloc_rounds");
  const json* b = find_comm(rep, "alloc_rounds");
  ASSERT_TRUE(a && b);
  EXPECT_EQ((*a)["summary"], (*b)["summary"]);
  // --folded-value on replay: allocation counts per stack sum to the JSON's.
  ToolOut c = run({tool(), "replay", path("run.mtr"), "-o", path("count.folded"), "--folded-value", "alloc_count"});
  ASSERT_EQ(c.code, 0) << c.err;
  Folded f = parse_folded(slurp(path("count.folded")));
  std::string root = "alloc_rounds (" + std::to_string((*b)["pid"].get<int>()) + ")";
  EXPECT_EQ(f.by_root[root], (*b)["summary"]["allocs"].get<uint64_t>());
  EXPECT_EQ(f.by_leak[root], uint64_t(kRounds + 1));
}

// --trace lines go to the first text or JSON file (the primary output), as
// they went to the single -o; the profiles hold only their own format.
TEST_F(Outputs, TraceLinesGoToTheFirstTextOrJsonFile) {
  ToolOut r = run({tool(), "--trace", "-o", path("b.folded"), "-o", path("a.json"), "-o", path("d.txt"), "--",
                   target("alloc_rounds"), "--rounds", "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::string a = slurp(path("a.json"));
  size_t at = report_offset(a);
  EXPECT_GT(at, 0u);  // trace lines, then the report
  EXPECT_NE(a.substr(0, at).find("{\"trace\":"), std::string::npos) << a.substr(0, 2000);
  json rep = json::parse(a.substr(at), nullptr, false);
  ASSERT_TRUE(rep.is_object());
  EXPECT_GT(rep["trace"]["lines"].get<long>(), 0);
  std::string d = slurp(path("d.txt"));
  EXPECT_EQ(d.find("{\"trace\":"), std::string::npos);
  EXPECT_NE(d.find("HEAP SUMMARY"), std::string::npos);
  Folded f = parse_folded(slurp(path("b.folded")));
  EXPECT_EQ(f.malformed, 0u) << slurp(path("b.folded"));
  EXPECT_GT(f.lines, 0u);
}

TEST_F(Outputs, BadOutputsAreRefusedBeforeTracing) {
  struct Case {
    std::vector<std::string> args;
    const char* says;
  };
  std::vector<Case> cases = {
      {{"-o", path("a.json"), "-o", path("b.xyz")}, "unknown extension"},
      {{"--format", "html", "-o", path("a.json"), "-o", path("b.html")}, "different formats"},
      {{"--format", "json", "-o", path("a.json"), "-o", path("b.folded")}, "different formats"},
      {{"-o", path("a.json"), "-o", path("a.json")}, "given twice"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {tool()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.insert(argv.end(), {"--", target("alloc_rounds"), "--rounds", "1"});
    ToolOut r = run(argv);
    SCOPED_TRACE(c.args.back());
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out, "");  // alloc_rounds never ran (it prints its counts)
    EXPECT_FALSE(exists(path("a.json")));
  }
  // replay too, before the recording is read.
  ToolOut r = run({tool(), "replay", path("none.mtr"), "-o", path("a.txt"), "-o", path("b.xyz")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("unknown extension"), std::string::npos) << r.err;
  EXPECT_FALSE(exists(path("a.txt")));
}

// pprof's encoding on a hand-made model: an inlined frame is a second line of
// its location, innermost first; Go's pprof reads it back.
TEST(OutputsFormat, PprofLinesOfInlinedFramesAndFoldedEscapes) {
  if (go_binary().empty()) MEMTRACE_SKIP_OR_FAIL("no Go toolchain for `go tool pprof` (Debian golang-go)");
  memtrace::heap::HeapModel m;
  mt_stack st{};
  st.h.kind = MT_EV_STACK;
  st.h.pid = 10;
  st.stack_id = 7;
  st.nr = 2;
  st.ips[0] = 0x401234;
  st.ips[1] = 0x401300;
  m.apply(&st, sizeof st);
  mt_event e{};
  e.h.kind = MT_EV_ALLOC;
  e.h.pid = 10;
  e.h.tid = 10;
  e.role = MT_ROLE_MALLOC;
  e.stack_id = 7;
  for (uint64_t a : {0x1000, 0x2000, 0x3000}) {
    e.addr = a;
    e.size = 100;
    m.apply(&e, sizeof e);
  }
  e.h.kind = MT_EV_FREE;
  e.addr = 0x1000;
  e.size = 0;
  e.role = MT_ROLE_FREE;
  m.apply(&e, sizeof e);
  m.process(10).comm = "t;x";
  memtrace::report::Resolver r = [](const memtrace::heap::Process&, uint64_t addr, const memtrace::heap::Loc*, bool) {
    std::vector<memtrace::report::FrameOut> v;
    memtrace::report::FrameOut f;
    f.address = addr;
    f.module = "/bin/t";
    f.module_offset = addr - 0x400000 - 1;
    if (addr == 0x401234) {
      f.function = "inner;fn";
      f.file = "t.c";
      f.line = 5;
      f.inlined = true;
      v.push_back(f);
      f.function = "outer";
      f.line = 9;
      f.inlined = false;
      v.push_back(f);
    } else {
      f.function = "main";
      f.line = 20;
      v.push_back(f);
    }
    return v;
  };
  memtrace::report::Options o;
  std::ostringstream folded;
  memtrace::report::write_folded(folded, m, r, o, memtrace::report::FoldedValue::LiveBytes);
  EXPECT_EQ(folded.str(), "t%3Bx (10);main;outer;inner%3Bfn 200\n");

  std::string file = "/tmp/memtrace-outputs-" + std::to_string(getpid()) + ".pb.gz";
  {
    std::ofstream out(file, std::ios::binary);
    memtrace::report::PprofOptions po;
    po.build_id = [](const std::string&) { return std::string("0123abcd"); };
    ASSERT_TRUE(memtrace::report::write_pprof(out, m, r, o, po));
  }
  ToolOut raw = pprof({"-raw"}, file);
  unlink(file.c_str());
  ASSERT_EQ(raw.code, 0) << raw.err;
  RawTotals t = raw_totals(raw.out);
  EXPECT_EQ(t.samples, 1u);
  EXPECT_EQ(t.alloc_objects, 3u);
  EXPECT_EQ(t.alloc_space, 300u);
  EXPECT_EQ(t.inuse_objects, 2u);
  EXPECT_EQ(t.inuse_space, 200u);
  // Location 1 (0x401234): inner;fn, then outer, the function it was inlined into.
  size_t inner = t.locations.find("inner;fn t.c:5");
  size_t outer = t.locations.find("outer t.c:9");
  EXPECT_NE(inner, std::string::npos) << raw.out;
  EXPECT_NE(outer, std::string::npos) << raw.out;
  EXPECT_LT(inner, outer) << raw.out;
  EXPECT_NE(raw.out.find("0123abcd"), std::string::npos) << raw.out;  // the mapping's build-id
}

TEST(OutputsFormat, PlanOutputs) {
  using memtrace::report::Format;
  using memtrace::report::plan_outputs;
  auto one = plan_outputs({"/dev/null"}, "");  // one -o, any name: text, as before
  ASSERT_TRUE(one);
  EXPECT_EQ((*one)[0].format, Format::Text);
  auto json_one = plan_outputs({"r.txt"}, "json");
  ASSERT_TRUE(json_one);
  EXPECT_EQ((*json_one)[0].format, Format::Json);
  auto many = plan_outputs({"a.json", "b.folded", "c.pb.gz", "d.txt", "e.html"}, "");
  ASSERT_TRUE(many);
  EXPECT_EQ((*many)[1].format, Format::Folded);
  EXPECT_EQ((*many)[2].format, Format::Pprof);
  EXPECT_EQ((*many)[4].format, Format::Html);
  EXPECT_EQ(memtrace::report::primary_output(*many)->path, "a.json");
  auto none = plan_outputs({}, "");
  ASSERT_TRUE(none);
  EXPECT_EQ((*none)[0].path, "");
  EXPECT_FALSE(plan_outputs({}, "pprof"));  // binary to a terminal
  EXPECT_EQ(memtrace::report::folded_escape("a;b\nc%"), "a%3Bb%0Ac%25");
}

}  // namespace
