// `memtrace-bpf diff A B` and the console's snapshot/diff (issue 19) on the
// real tool: tests/targets/alloc_rounds leaks 33 bytes from leak_here per
// round and makes 11 other allocations per round that it frees, so two runs
// of 10 and 30 rounds differ by exactly 20 rounds, and so does the console
// between a snapshot and a diff around N rounds. The diff's HTML page is
// used in headless Chromium (tests/report/html_check.js).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "harness.h"
#include "html_check.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

class Diff : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// alloc_rounds --rounds N launched under the tool: a recording and a JSON report.
struct Recorded {
  std::string mtr, json_path;
  PerRound per;
  bool make(long rounds) {
    mtr = tmpfile("diff") + ".mtr";
    json_path = tmpfile("diff");
    ToolRun r = run_argv({tool(), "--record", mtr, "-o", json_path, "--", target("alloc_rounds"), "--rounds",
                          std::to_string(rounds)});
    per = parse_per_round(r.out);
    return r.code == 0 && per.allocs > 0;
  }
  ~Recorded() {
    unlink(mtr.c_str());
    unlink(json_path.c_str());
  }
};

const json* group(const json& d, const std::string& label) {
  for (const auto& g : d["diff"]["groups"])
    if (g["label"] == label) return &g;
  return nullptr;
}

json diff_json(const std::vector<std::string>& args, int* code = nullptr) {
  std::vector<std::string> argv = {tool(), "diff", "--format", "json"};
  argv.insert(argv.end(), args.begin(), args.end());
  ToolRun r = run_argv(argv);
  if (code) *code = r.code;
  EXPECT_EQ(r.err, "") << r.err;
  return json::parse(r.out, nullptr, false);
}

TEST_F(Diff, TwoRecordingsDifferByExactlyTheirExtraRounds) {
  constexpr long kA = 10, kB = 30, kD = kB - kA;
  Recorded a, b;
  ASSERT_TRUE(a.make(kA));
  ASSERT_TRUE(b.make(kB));
  const PerRound& per = a.per;
  int code = -1;
  json d = diff_json({a.mtr, b.mtr}, &code);
  ASSERT_EQ(code, 0);
  const json* g = group(d, "alloc_rounds");
  ASSERT_TRUE(g) << d.dump(1);
  EXPECT_EQ(d["diff"]["groups"].size(), 1u) << d.dump(1);
  EXPECT_EQ((*g)["delta"]["in_use_bytes"], kD * per.leaked_bytes);
  EXPECT_EQ((*g)["delta"]["in_use_blocks"], kD * per.leaked_blocks);
  EXPECT_EQ((*g)["delta"]["allocs"], kD * per.allocs);
  EXPECT_EQ((*g)["delta"]["frees"], kD * per.frees);
  EXPECT_EQ((*g)["delta"]["bytes_allocated"], kD * per.bytes);
  // What grew: one stack, leak_here's, by exactly the extra leaks; and
  // every other allocation stack of the rounds allocated kD times more.
  ASSERT_EQ((*g)["grew"]["total"], 1) << g->dump(1);
  const json& row = (*g)["grew"]["stacks"][0];
  EXPECT_EQ(row["stack"][0]["function"], "leak_here");
  EXPECT_EQ(row["delta"]["live_bytes"], kD * per.leaked_bytes);
  EXPECT_EQ(row["delta"]["live_blocks"], kD * per.leaked_blocks);
  EXPECT_EQ(row["delta"]["allocs"], kD);
  EXPECT_EQ(row["a"]["live_blocks"], kA);
  EXPECT_EQ(row["b"]["live_blocks"], kB);
  EXPECT_EQ((*g)["shrank"]["total"], 0);
  EXPECT_EQ((*g)["churn"]["delta"]["allocs"], kD * (per.allocs - per.leaked_blocks));
  EXPECT_EQ((*g)["churn"]["delta"]["live_bytes"], 0);

  // Frames matched by function only: the same.
  json df = diff_json({a.mtr, b.mtr, "--by", "function"});
  const json* gf = group(df, "alloc_rounds");
  ASSERT_TRUE(gf);
  EXPECT_EQ((*gf)["grew"]["stacks"][0]["delta"]["live_bytes"], kD * per.leaked_bytes);
  EXPECT_EQ((*gf)["churn"]["delta"]["allocs"], kD * (per.allocs - per.leaked_blocks));

  // The two JSON reports: in use by stack (they hold no allocation counts per stack).
  json dj = diff_json({a.json_path, b.json_path});
  const json* gj = group(dj, "alloc_rounds");
  ASSERT_TRUE(gj) << dj.dump(1);
  EXPECT_EQ((*gj)["allocs_by_stack"], false);
  ASSERT_EQ((*gj)["grew"]["total"], 1);
  EXPECT_EQ((*gj)["grew"]["stacks"][0]["stack"][0]["function"], "leak_here");
  EXPECT_EQ((*gj)["grew"]["stacks"][0]["delta"]["live_bytes"], kD * per.leaked_bytes);
  EXPECT_TRUE((*gj)["grew"]["stacks"][0]["delta"]["allocs"].is_null());
  EXPECT_EQ((*gj)["delta"]["allocs"], kD * per.allocs);

  // A run against itself: nothing.
  json ds = diff_json({b.mtr, b.mtr});
  const json* gs = group(ds, "alloc_rounds");
  ASSERT_TRUE(gs);
  EXPECT_EQ((*gs)["grew"]["total"].get<int>() + (*gs)["shrank"]["total"].get<int>() +
                (*gs)["churn"]["total"].get<int>(),
            0);

  // Text: B - A the other way round: leak_here shrank.
  ToolRun t = run_argv({tool(), "diff", b.mtr, a.mtr});
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("SHRANK: 1 stack, " + std::to_string(-kD * per.leaked_bytes) + " bytes"), std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("leak_here"), std::string::npos);
}

TEST_F(Diff, BadInputIsOneLineAndACutRecordingIsComparedAsFarAsItGoes) {
  Recorded a;
  ASSERT_TRUE(a.make(5));
  ToolRun r = run_argv({tool(), "diff", "/nonexistent.mtr", a.mtr});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "memtrace-bpf: diff: cannot open /nonexistent.mtr: No such file or directory\n");
  r = run_argv({tool(), "diff", "/etc/hostname", a.mtr});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "memtrace-bpf: diff: /etc/hostname: neither a memtrace-bpf recording nor a JSON report\n");
  std::string cut = tmpfile("cut") + ".mtr";
  {
    std::ifstream in(a.mtr, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string all = ss.str();
    std::ofstream(cut, std::ios::binary) << all.substr(0, all.size() - 100);
  }
  r = run_argv({tool(), "diff", cut, a.mtr});
  unlink(cut.c_str());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("memtrace-bpf: diff: " + cut + ": "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("; compared the "), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.out.find("DIFF " + cut + " -> " + a.mtr), std::string::npos) << r.out;
}

// 1234567 -> "1,234,567", as the page writes counts.
std::string grouped(long v) {
  // Appended digit by digit: gcc 12's -Wrestrict misreads string::insert
  // here (a false positive in libstdc++'s inlined memcpy).
  std::string d = std::to_string(std::abs(v)), s;
  for (size_t i = 0; i < d.size(); i++) {
    if (i && (d.size() - i) % 3 == 0) s += ',';
    s += d[i];
  }
  return (v < 0 ? "-" : "") + s;
}

// The diff as a page (-o d.html), in Chromium: the differential flame graph
// shows leak_here grown by exactly the extra rounds' leaks, in red; a click
// zooms; the values switch to allocations (B - A: the extra rounds'); the
// grew table names leak_here with its file:line and its delta; nothing is
// fetched. Two JSON reports: in use only. Bad input: one line, exit 2.
TEST_F(Diff, HtmlPageOfTwoRecordingsInChromium) {
  if (access(CHROMIUM_BIN, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no headless Chromium (Debian chromium)");
  if (access(NODE_BIN, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no node");
  constexpr long kA = 10, kB = 30, kD = kB - kA;
  Recorded a, b;
  ASSERT_TRUE(a.make(kA));
  ASSERT_TRUE(b.make(kB));
  const PerRound& per = a.per;
  std::string page = tmpfile("diff") + ".html";
  ToolRun r = run_argv({tool(), "diff", a.mtr, b.mtr, "-o", page});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  auto check = [&](const std::string& file, const std::vector<std::string>& more = {}) {
    std::vector<std::string> argv = {NODE_BIN, CHECK_JS, "--chromium", CHROMIUM_BIN, "--page", file, "--names",
                                     "leak_here,main", "--click", "leak_here"};
    argv.insert(argv.end(), more.begin(), more.end());
    ToolRun c = run_argv(argv);
    EXPECT_EQ(c.code, 0) << c.out << c.err;
    return json::parse(c.out, nullptr, false);
  };
  json o = check(page, {"--text", "#grew tr", "--text", "#shrank", "--text", "#summary"});
  ASSERT_TRUE(o.is_object());
  SCOPED_TRACE(o.dump(1).substr(0, 4000));
  expect_page_used(o, page);  // no error, nothing fetched, a click on leak_here zooms, a search
  EXPECT_EQ(o["title"], "memtrace-bpf diff: alloc_rounds");
  EXPECT_NE(o["drawn_names"].dump().find("\"leak_here\""), std::string::npos);

  // In use: B - A is leak_here's extra leaks, and nothing else.
  const long grew = kD * per.leaked_bytes;
  const json& init = o["initial"];
  EXPECT_EQ(init["total"]["kind"], "live_bytes");
  EXPECT_EQ(init["total"]["value"], grew);
  EXPECT_EQ(init["deltas"]["leak_here"], grew);
  EXPECT_EQ(init["deltas"]["main"], grew);
  EXPECT_GE(init["values"]["leak_here"], kB * per.leaked_bytes);  // as wide as B, the larger
  // Red (d3-flame-graph's differential colours: rgb(220, x, x), the less x the more of it grew).
  int rgb[3] = {};
  EXPECT_EQ(sscanf(init["frames"]["leak_here"]["fill"].get<std::string>().c_str(), "rgb(%d,%d,%d)", &rgb[0], &rgb[1],
                   &rgb[2]),
            3);
  EXPECT_TRUE(rgb[0] == 220 && rgb[1] == rgb[2] && rgb[1] < 120) << init["frames"]["leak_here"];
  EXPECT_EQ(init["frames"]["leak_here"]["title"].get<std::string>().rfind("leak_here: +" + grouped(grew) + " bytes", 0),
            0u);

  // The tables: leak_here grew by exactly that, named to its line; nothing shrank.
  ASSERT_EQ(o["text"]["#grew tr"].size(), 2u);  // the header, one stack
  std::string row = o["text"]["#grew tr"][1];
  EXPECT_EQ(row.rfind("+" + grouped(grew) + "+" + grouped(kD * per.leaked_blocks) + grouped(kA * per.leaked_bytes) +
                          " → " + grouped(kB * per.leaked_bytes),
                      0),
            0u)
      << row;
  size_t fn = row.find("leak_here"), loc = row.find("alloc_rounds.c:");  // the innermost frame, its file:line
  EXPECT_TRUE(fn != std::string::npos && loc != std::string::npos && fn < loc &&
              isdigit(static_cast<unsigned char>(row[loc + 15])))
      << row;
  EXPECT_NE(row.find("+" + grouped(kD) + " (" + grouped(kA) + " → " + grouped(kB) + ")"), std::string::npos) << row;
  EXPECT_EQ(o["text"]["#shrank"], json::array({"Nothing."}));
  EXPECT_NE(o["text"]["#summary"][0].get<std::string>().find("A: " + a.mtr), std::string::npos);

  // Every value: B - A is the extra rounds'.
  const json& k = o["kinds"];
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k["alloc_count"]["total"]["value"], kD * per.allocs);
  EXPECT_EQ(k["alloc_count"]["deltas"]["leak_here"], kD);
  EXPECT_EQ(k["alloc_bytes"]["total"]["value"], kD * per.bytes);
  EXPECT_EQ(k["alloc_bytes"]["deltas"]["leak_here"], grew);
  EXPECT_EQ(k["live_bytes"]["total"]["value"], grew);

  // Two JSON reports: --format html names the format (here of stdout); in use by stack only.
  r = run_argv({tool(), "diff", a.json_path, b.json_path, "--format", "html"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::string jpage = tmpfile("diff") + ".html";
  std::ofstream(jpage) << r.out;
  json oj = check(jpage);
  expect_page_used(oj, jpage);
  EXPECT_EQ(oj["kinds"].size(), 1u);
  EXPECT_EQ(oj["initial"]["deltas"]["leak_here"], grew);
  unlink(page.c_str());
  unlink(jpage.c_str());

  // Bad input: one line, exit 2.
  r = run_argv({tool(), "diff", "/nonexistent.mtr", a.mtr, "-o", page});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "memtrace-bpf: diff: cannot open /nonexistent.mtr: No such file or directory\n");
  r = run_argv({tool(), "diff", a.mtr, "/etc/hostname", "--format", "html"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "memtrace-bpf: diff: /etc/hostname: neither a memtrace-bpf recording nor a JSON report\n");
  EXPECT_EQ(r.out, "");
  unlink(page.c_str());
}

// The console: snapshot, N rounds, diff: leak_here grew by exactly N leaks.
TEST_F(Diff, ConsoleSnapshotThenDiffShowsTheGrowthByStack) {
  constexpr long kN = 25;
  Child t = spawn({target("alloc_rounds"), "--wait", "--rounds", std::to_string(kN)});
  std::string tout, mout, merr;
  ASSERT_TRUE(read_until(t.out, "ready", &tout));
  std::string rep = tmpfile("console") + ".txt";  // text answers (a .json -o makes them JSON)
  Child m = spawn({tool(), "-p", std::to_string(t.pid), "--console", "-o", rep});
  auto cmd = [&](const std::string& c, const std::string& until) {
    mout.clear();
    EXPECT_EQ(write(m.in, (c + "\n").data(), c.size() + 1), static_cast<ssize_t>(c.size() + 1));
    EXPECT_TRUE(read_until(m.out, until, &mout)) << c << ": " << mout << merr;
    return mout;
  };
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  EXPECT_NE(cmd("diff", "no snapshot").find("no snapshot: type snapshot first"), std::string::npos) << mout;
  EXPECT_NE(cmd("snapshot", "Snapshot taken").find("Snapshot taken"), std::string::npos) << mout;
  ASSERT_EQ(write(t.in, "\n", 1), 1);  // the rounds
  ASSERT_TRUE(read_until(t.out, "mmap_direct=", &tout));
  PerRound per = parse_per_round(tout);
  ASSERT_GT(per.allocs, 0);
  // The console has no end-of-answer mark: status after diff is one.
  std::string d = cmd("diff\nstatus", "HEAP SUMMARY");
  std::string pid = std::to_string(t.pid);
  EXPECT_NE(d.find("pid " + pid + " (alloc_rounds)\n    in use: 0 -> " + std::to_string(kN * per.leaked_bytes) +
                   " bytes (+" + std::to_string(kN * per.leaked_bytes) + ")"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("allocs: 0 -> " + std::to_string(kN * per.allocs)), std::string::npos) << d;
  EXPECT_NE(d.find("GREW: 1 stack, +" + std::to_string(kN * per.leaked_bytes) + " bytes, +" +
                   std::to_string(kN * per.leaked_blocks) + " blocks in use, +" + std::to_string(kN) + " allocs"),
            std::string::npos)
      << d;
  size_t grew = d.find("GREW:");
  ASSERT_NE(grew, std::string::npos);
  EXPECT_EQ(d.find("leak_here", grew) < d.find("SHRANK:"), true) << d;  // the stack that grew is leak_here's
  EXPECT_NE(d.find("SHRANK: nothing"), std::string::npos) << d;
  // Each allocation of a round has a call site (a stack) of its own.
  EXPECT_NE(d.find("ALLOCATIONS CHANGED, IN USE THE SAME: " + std::to_string(per.allocs - per.leaked_blocks) +
                   " stacks, +" + std::to_string(kN * (per.allocs - per.leaked_blocks)) + " allocs"),
            std::string::npos)
      << d;
  // A second snapshot: nothing changed since.
  cmd("snapshot", "Snapshot taken");
  EXPECT_NE(cmd("diff", "no change").find("no change"), std::string::npos) << mout;
  cmd("quit", "Detaching");
  if (write(t.in, "\n", 1) != 1) {}
  wait_exit(t.pid);
  close(m.in);
  EXPECT_EQ(wait_exit(m.pid), 0);
  unlink(rep.c_str());
}

}  // namespace
