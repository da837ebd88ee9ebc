// The capabilities of the older tools (seeds 001, 002, 004) on the real tool:
// --console, --trace, --live/--dump-bytes, --record + replay. Counts are
// compared exactly with what tests/targets/alloc_rounds says it did.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <regex>

#include "harness.h"
#include "memtrace.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

class Features : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Result {
  int code = -1;
  std::string out, err, file;
};

// memtrace-bpf ARGS to completion, stdin closed; the -o file's content in .file.
Result run(std::vector<std::string> args, const std::string& outfile = "") {
  std::vector<std::string> argv = {tool()};
  if (!outfile.empty()) {
    argv.push_back("-o");
    argv.push_back(outfile);
  }
  argv.insert(argv.end(), args.begin(), args.end());
  ToolRun t = run_argv(argv);
  Result r;
  r.code = t.code;
  r.out = std::move(t.out);
  r.err = std::move(t.err);
  if (!outfile.empty()) {
    r.file = slurp(outfile);
    unlink(outfile.c_str());
  }
  return r;
}

long count_of(const std::string& s, const std::string& needle) {
  long n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) n++;
  return n;
}

// A target waiting at "ready" with the tool attached by -p and a console.
struct Session {
  Child t, m;
  std::string tout, mout, merr;
  PerRound per;
  bool start(long rounds, std::vector<std::string> extra) {
    t = spawn({target("alloc_rounds"), "--wait", "--rounds", std::to_string(rounds)});
    if (!read_until(t.out, "ready", &tout)) return false;
    std::vector<std::string> argv = {tool(), "-p", std::to_string(t.pid), "--console"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    m = spawn(argv);
    if (!read_until(m.err, "tracing", &merr)) return false;
    if (write(t.in, "\n", 1) != 1) return false;  // the rounds run, traced
    if (!read_until(t.out, "per_round", &tout) || !read_until(t.out, "\n", &tout)) return false;
    per = parse_per_round(tout);
    return true;
  }
  // Sends a console command; returns the output up to `until`.
  std::string cmd(const std::string& c, const std::string& until) {
    mout.clear();
    EXPECT_EQ(write(m.in, (c + "\n").data(), c.size() + 1), static_cast<ssize_t>(c.size() + 1));
    EXPECT_TRUE(read_until(m.out, until, &mout)) << c << ": " << mout << merr;
    return mout;
  }
  void finish() {
    if (t.pid > 0) {
      if (write(t.in, "\n", 1) != 1) {}
      wait_exit(t.pid);
      t.pid = -1;
    }
  }
  ~Session() {
    finish();
    if (m.pid > 0) {
      kill(m.pid, SIGTERM);
      wait_exit(m.pid);
    }
  }
};

long field(const std::string& s, const std::string& re) {
  std::smatch mm;
  if (!std::regex_search(s, mm, std::regex(re))) return -1;
  return std::stol(mm[1]);
}

}  // namespace

// ------------------------------------------------------------------ console

TEST_F(Features, ConsoleRefusedInLaunchMode) {
  Result r = run({"--console", "--", target("alloc_rounds")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--console reads commands from stdin, which belongs to the launched program"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_of(r.err, "\n"), 1) << r.err;  // one line
}

TEST_F(Features, ConsoleStatusLiveClearMonitorReportQuit) {
  const long R = 30;
  Session s;
  ASSERT_TRUE(s.start(R, {})) << s.tout << s.merr;
  ASSERT_GT(s.per.allocs, 0);

  // status: seed 004's words, exact counts of what ran after the attach.
  std::string st = s.cmd("status", "total heap usage");
  EXPECT_NE(st.find("HEAP SUMMARY"), std::string::npos) << st;
  EXPECT_EQ(field(st, R"(total heap usage: (\d+) allocs)"), R * s.per.allocs) << st;
  EXPECT_EQ(field(st, R"(allocs, (\d+) frees)"), R * s.per.frees) << st;
  EXPECT_EQ(field(st, R"(frees, (\d+) bytes allocated)"), R * s.per.bytes) << st;
  EXPECT_EQ(field(st, R"(in use: (\d+) bytes)"), R * s.per.leaked_bytes) << st;
  EXPECT_EQ(field(st, R"(bytes in (\d+) blocks)"), R * s.per.leaked_blocks) << st;
  EXPECT_EQ(st.find("> "), std::string::npos) << "no prompt when stdin is not a TTY: " << st;

  // live: every live block, grouped by stack (the R leaks of leak_here).
  std::string lv = s.cmd("live", "\n\n");
  EXPECT_NE(lv.find("LIVE BLOCKS for pid " + std::to_string(s.t.pid)), std::string::npos) << lv;
  EXPECT_NE(lv.find(std::to_string(R * 33) + " bytes in " + std::to_string(R) + " blocks from stack"),
            std::string::npos)
      << lv;
  EXPECT_NE(lv.find("leak_here"), std::string::npos) << lv;
  EXPECT_EQ(count_of(lv, "  33 bytes  age "), R) << lv;

  // report: the full report with leaks by stack.
  std::string rp = s.cmd("report", "nothing dropped");
  EXPECT_NE(rp.find(std::to_string(R * 33) + " bytes in " + std::to_string(R) + " blocks were not freed"),
            std::string::npos)
      << rp;

  // clear: counters and live blocks forgotten.
  EXPECT_NE(s.cmd("clear", "Clearing").find("Clearing list of allocations"), std::string::npos);
  st = s.cmd("status", "total heap usage");
  EXPECT_NE(st.find("in use: 0 bytes in 0 blocks"), std::string::npos) << st;
  EXPECT_NE(st.find("total heap usage: 0 allocs, 0 frees, 0 bytes allocated"), std::string::npos) << st;
  EXPECT_NE(s.cmd("live", "\n").find("no live blocks"), std::string::npos);

  // monitor 1: a summary now and one a second; monitor 0 stops them.
  s.cmd("monitor 1", "total heap usage");
  std::string mon = s.mout;
  read_until(s.m.out, "XXX-never", &mon, 2600);  // collects for 2.6 s
  EXPECT_GE(count_of(mon, "HEAP SUMMARY"), 3) << mon;
  s.cmd("monitor 0", "Stop monitoring");
  std::string after;
  read_until(s.m.out, "XXX-never", &after, 1500);
  EXPECT_EQ(count_of(after, "HEAP SUMMARY"), 0) << after;

  EXPECT_NE(s.cmd("help", "clear").find("monitor N"), std::string::npos);
  EXPECT_NE(s.cmd("frobnicate", "help").find("unknown command"), std::string::npos);

  // quit: detach, print the final report, exit 0; the target keeps running.
  ASSERT_EQ(write(s.m.in, "quit\n", 5), 5);
  std::string rest = read_all(s.m.out);
  EXPECT_EQ(wait_exit(s.m.pid), 0) << s.merr;
  s.m.pid = -1;
  EXPECT_NE(rest.find("Detaching"), std::string::npos) << rest;
  EXPECT_NE(rest.find("in use at exit: 0 bytes in 0 blocks"), std::string::npos) << rest;
  EXPECT_EQ(kill(s.t.pid, 0), 0);  // still alive, waiting for its line
  s.finish();
}

TEST_F(Features, ConsoleLiveDumpBytesMatchProcessMemory) {
  const long R = 5;
  Session s;
  ASSERT_TRUE(s.start(R, {"--dump-bytes", "16"})) << s.tout << s.merr;
  std::string lv = s.cmd("live", "\n\n");
  // "    0xADDR  33 bytes  age ..." then "      0000  xx xx ... |....|"
  std::regex blk(R"(    (0x[0-9a-f]+)  (\d+) bytes  age [0-9.]+s\n      0000 ((?: +[0-9a-f]{2})+))");
  int fd = open(("/proc/" + std::to_string(s.t.pid) + "/mem").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  long checked = 0;
  for (auto it = std::sregex_iterator(lv.begin(), lv.end(), blk); it != std::sregex_iterator(); ++it) {
    uint64_t addr = std::stoull((*it)[1], nullptr, 16);
    size_t n = std::min<size_t>(16, std::stoul((*it)[2]));
    unsigned char b[16];
    ASSERT_EQ(pread(fd, b, n, static_cast<off_t>(addr)), static_cast<ssize_t>(n));
    std::string want;
    char h[8];
    for (size_t i = 0; i < n; i++) {
      if (i == 8) want += ' ';
      snprintf(h, sizeof h, " %02x", b[i]);
      want += h;
    }
    std::string got = (*it)[3];
    EXPECT_EQ(got.substr(0, want.size()), want) << lv;
    checked++;
  }
  close(fd);
  EXPECT_EQ(checked, R) << lv;  // the R leaked blocks (all live blocks since the attach)
  s.finish();                   // the target exits: the tool ends by itself
  EXPECT_EQ(wait_exit(s.m.pid), 0);
  s.m.pid = -1;
}

// ------------------------------------------------------------------ --trace

TEST_F(Features, TraceJsonLinesMatchTheReportExactly) {
  const long R = 25;
  std::string f = tmpfile("trace");
  Result r = run({"--trace", "--format", "json", "--", target("alloc_rounds"), "--rounds", std::to_string(R)}, f);
  ASSERT_EQ(r.code, 0) << r.err;
  // Trace lines first, then the report.
  std::istringstream in(r.file);
  std::string line, rest;
  std::map<long, std::map<std::string, long>> per_pid;
  long lines = 0, leak_lines = 0;
  while (std::getline(in, line)) {
    if (line.rfind("{\"trace\":", 0) != 0) {
      rest += line + "\n";
      continue;
    }
    json t = json::parse(line)["trace"];
    lines++;
    auto& c = per_pid[t["pid"].get<long>()];
    std::string ev = t["event"];
    for (const char* k : {"time", "comm", "pid", "tid", "event", "address", "caller"})
      EXPECT_TRUE(t.contains(k)) << k << " in " << line;
    if (ev == "free" || ev.rfind("free(", 0) == 0) {
      c["frees"]++;
    } else if (ev.find("-failed") != std::string::npos) {
      c["failed"]++;
    } else if (ev == "mmap") {
      if (!t.value("allocator_internal", false)) c["mmap_direct"] += t["size"].get<long>();
    } else if (ev == "munmap" || ev == "brk" || ev == "mremap") {
    } else {
      c["allocs"]++;
      c["bytes"] += t["size"].get<long>();
      if (ev == "realloc") {
        EXPECT_TRUE(t.contains("old_address")) << line;
      }
      if (t["size"] == 33 && t["caller"].is_object() && t["caller"]["function"] == "leak_here") leak_lines++;
    }
  }
  json rep = json::parse(rest, nullptr, false);
  ASSERT_TRUE(rep.is_object()) << rest.substr(0, 2000);
  PerRound per = parse_per_round(r.out);
  const json* p = find_comm(rep, "alloc_rounds");
  ASSERT_TRUE(p) << rep.dump();
  auto& c = per_pid[(*p)["pid"].get<long>()];
  EXPECT_EQ(c["allocs"], u(*p, "allocs"));
  EXPECT_EQ(c["frees"], u(*p, "frees"));
  EXPECT_EQ(c["bytes"], u(*p, "bytes_allocated"));
  EXPECT_EQ(c["failed"], u(*p, "failed_allocs"));
  EXPECT_EQ(c["mmap_direct"], u(*p, "mmap_bytes_direct"));
  EXPECT_EQ(leak_lines, R + 1);  // the rounds and the prologue's round
  EXPECT_EQ(rep["trace"]["lines"].get<long>(), lines);
  EXPECT_EQ(rep["trace"]["write_errors"].get<long>(), 0);
  EXPECT_GE(u(*p, "allocs"), R * per.allocs);
  expect_no_losses(rep);
}

TEST_F(Features, TraceTextLineNamesTheCaller) {
  Result r = run({"--trace", "--", target("alloc_rounds"), "--rounds", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  // Launch mode: the program owns stdout; trace and report go to stderr.
  EXPECT_NE(r.err.find("TRACE time comm pid tid event address size old_address caller"), std::string::npos);
  std::regex leak(R"(\d\d:\d\d:\d\d\.\d{6} alloc_rounds \d+ \d+ malloc 0x[0-9a-f]+ 33 - 0x[0-9a-f]+ leak_here\+0x)");
  EXPECT_TRUE(std::regex_search(r.err, leak)) << r.err.substr(0, 4000);
  std::regex realloc(R"( realloc 0x[0-9a-f]+ 5000 0x[0-9a-f]+ 0x[0-9a-f]+ one_round\+0x)");
  EXPECT_TRUE(std::regex_search(r.err, realloc)) << r.err.substr(0, 4000);
}

// ------------------------------------------------------------------ --live

TEST_F(Features, LiveBlocksInTheFinalReportCappedAndGoneProcess) {
  const long R = 20;
  ToolRun all = run_tool({"--live", "--dump-bytes", "8", "--", target("alloc_rounds"), "--rounds", std::to_string(R)});
  ASSERT_EQ(all.code, 0) << all.err;
  const json* p = find_comm(all.report, "alloc_rounds");
  ASSERT_TRUE(p) << all.report.dump();
  ASSERT_TRUE(p->contains("live")) << p->dump();
  EXPECT_EQ((*p)["live_total"].get<long>(), u(*p, "in_use_blocks"));
  EXPECT_EQ((long)(*p)["live"].size(), u(*p, "in_use_blocks"));
  EXPECT_EQ((*p)["live_omitted"], 0);
  long leaks = 0, sum = 0;
  for (const auto& b : (*p)["live"]) {
    sum += b["size"].get<long>();
    EXPECT_EQ(b["address"].get<std::string>().rfind("0x", 0), 0u);
    EXPECT_EQ(b["bytes_error"], "process gone") << b.dump();  // the program has exited
    if (b["size"] == 33 && !b["stack"].empty() && b["stack"][0]["function"] == "leak_here") leaks++;
  }
  EXPECT_EQ(sum, u(*p, "in_use_bytes"));
  EXPECT_EQ(leaks, R + 1);

  ToolRun capped = run_tool({"--live", "--live-max", "5", "--", target("alloc_rounds"), "--rounds", std::to_string(R)});
  const json* q = find_comm(capped.report, "alloc_rounds");
  ASSERT_TRUE(q);
  EXPECT_EQ((*q)["live"].size(), 5u);
  EXPECT_EQ((*q)["live_omitted"].get<long>(), u(*q, "in_use_blocks") - 5);

  Result text = run({"--live", "--live-max", "3", "--dump-bytes", "8", "--", target("alloc_rounds"), "--rounds", "4"});
  EXPECT_NE(text.err.find("LIVE BLOCKS for pid"), std::string::npos) << text.err;
  EXPECT_NE(text.err.find("more live blocks omitted (--live-max 3)"), std::string::npos) << text.err;
  EXPECT_NE(text.err.find("(process gone)"), std::string::npos) << text.err;
}

// ------------------------------------------------------------------ --record / replay

namespace {

json leak_summary(const json& p) {
  json out = json::array();
  for (const auto& l : p["leaks"]) {
    json fns = json::array();
    for (const auto& f : l["stack"]) fns.push_back(f.value("function", "") + "@" + f.value("module", ""));
    out.push_back({{"bytes", l["bytes"]}, {"blocks", l["blocks"]}, {"stack", fns}});
  }
  return out;
}

Result replay(std::vector<std::string> args, const std::string& outfile = "") {
  args.insert(args.begin(), "replay");
  return run(args, outfile);
}

}  // namespace

TEST_F(Features, RecordThenReplayGivesTheSameReport) {
  const long R = 40;
  std::string rec = "/tmp/memtrace-test-" + std::to_string(getpid()) + ".mtr";
  ToolRun live = run_tool({"--record", rec, "--", target("alloc_rounds"), "--rounds", std::to_string(R), "--exit-code", "3"});
  ASSERT_EQ(live.code, 3) << live.err;
  ASSERT_TRUE(live.report.contains("recording")) << live.report.dump();
  Result rp = replay({rec, "--format", "json", "--top", "10"});
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rj = json::parse(rp.out, nullptr, false);
  ASSERT_TRUE(rj.is_object()) << rp.out;
  const json* a = find_comm(live.report, "alloc_rounds");
  const json* b = find_comm(rj, "alloc_rounds");
  ASSERT_TRUE(a && b) << rj.dump();
  EXPECT_EQ((*a)["pid"], (*b)["pid"]);
  EXPECT_EQ((*a)["exit_code"], (*b)["exit_code"]);
  for (const char* k : {"allocs", "frees", "bytes_allocated", "in_use_bytes", "in_use_blocks", "peak_in_use_bytes",
                        "failed_allocs", "mmap_bytes_allocator", "mmap_bytes_direct"})
    EXPECT_EQ((*a)["summary"][k], (*b)["summary"][k]) << k;
  EXPECT_EQ((*a)["summary"], (*b)["summary"]);
  EXPECT_EQ(leak_summary(*a), leak_summary(*b));
  EXPECT_EQ((*a)["leaks"], (*b)["leaks"]);  // frames symbolized identically (files unchanged)
  EXPECT_EQ(live.report["dropped"], rj["dropped"]);
  EXPECT_EQ(rj["replay"]["complete"], true);
  EXPECT_TRUE(rj["notes"].empty()) << rj["notes"].dump();

  // Text replay, with the live blocks of the end of the recording.
  Result tx = replay({rec, "--live", "--live-max", "2"});
  EXPECT_EQ(tx.code, 0) << tx.err;
  EXPECT_NE(tx.out.find("in use at exit:"), std::string::npos) << tx.out;
  EXPECT_NE(tx.out.find(std::to_string(R * 33) + " bytes in " + std::to_string(R) + " blocks were not freed"),
            std::string::npos)
      << tx.out;
  EXPECT_NE(tx.out.find("LIVE BLOCKS for pid"), std::string::npos);
  EXPECT_NE(tx.out.find("REPLAY: " + rec), std::string::npos);

  // Truncated: a clear one-line error, non-zero exit, and what could be read.
  std::string data = slurp(rec);
  std::string cut = rec + ".cut";
  std::ofstream(cut, std::ios::binary) << data.substr(0, data.size() / 2);
  Result t = replay({cut, "--format", "json"});
  EXPECT_EQ(t.code, 1);
  EXPECT_EQ(count_of(t.err, "\n"), 1) << t.err;
  EXPECT_NE(t.err.find("truncated"), std::string::npos) << t.err;
  EXPECT_NE(t.err.find("records"), std::string::npos) << t.err;
  json tj = json::parse(t.out, nullptr, false);
  ASSERT_TRUE(tj.is_object()) << t.out;
  EXPECT_EQ(tj["replay"]["complete"], false);
  EXPECT_GT(tj["replay"]["records"].get<long>(), 0);

  // Corrupt: one byte flipped in the middle of a record.
  std::string bad = data;
  bad[bad.size() / 2] ^= 0x5a;
  std::string badf = rec + ".bad";
  std::ofstream(badf, std::ios::binary) << bad;
  Result c = replay({badf});
  EXPECT_EQ(c.code, 1);
  EXPECT_EQ(count_of(c.err, "\n"), 1) << c.err;
  EXPECT_TRUE(c.err.find("corrupt") != std::string::npos || c.err.find("truncated") != std::string::npos) << c.err;
  EXPECT_NE(c.out.find("HEAP SUMMARY"), std::string::npos);  // what was read is reported

  // Not a recording at all.
  std::string junk = rec + ".junk";
  std::ofstream(junk) << "hello, not a recording\n";
  Result j = replay({junk});
  EXPECT_NE(j.code, 0);
  EXPECT_NE(j.err.find("not a memtrace-bpf recording"), std::string::npos) << j.err;
  for (const auto& f : {rec, cut, badf, junk}) unlink(f.c_str());
}

TEST_F(Features, ReplaySaysWhenABinaryChangedAndFindsItByBuildId) {
  // A private copy of the target, recorded, then replaced by another program.
  std::string dir = "/tmp/memtrace-test-bid-" + std::to_string(getpid());
  std::string keep = dir + "/keep";
  ASSERT_EQ(system(("mkdir -p " + keep + " && cp " + target("alloc_rounds") + " " + dir + "/prog && cp " +
                    target("alloc_rounds") + " " + keep + "/prog")
                       .c_str()),
            0);
  std::string rec = dir + "/r.mtr";
  ToolRun live = run_tool({"--record", rec, "--", dir + "/prog", "--rounds", "3"});
  ASSERT_EQ(live.code, 0) << live.err;
  ASSERT_EQ(system(("cp " + target("no_allocator") + " " + dir + "/prog.new && mv " + dir + "/prog.new " + dir +
                    "/prog")
                       .c_str()),
            0);
  Result rp = replay({rec, "--format", "json"});
  EXPECT_EQ(rp.code, 0) << rp.err;
  json rj = json::parse(rp.out, nullptr, false);
  ASSERT_TRUE(rj.is_object()) << rp.out;
  EXPECT_NE(rj["notes"].dump().find(dir + "/prog changed since the recording"), std::string::npos)
      << rj["notes"].dump();
  const json* p = find_comm(rj, "prog");
  ASSERT_TRUE(p) << rj.dump();
  bool leak_named = false;
  for (const auto& l : (*p)["leaks"])
    for (const auto& f : l["stack"]) leak_named |= f["function"] == "leak_here";
  EXPECT_FALSE(leak_named) << "frames of a changed file must not be symbolized with the new one";

  // The original, found by build-id under --symbols DIR.
  Result ok = replay({rec, "--format", "json", "--symbols", keep});
  json oj = json::parse(ok.out, nullptr, false);
  ASSERT_TRUE(oj.is_object()) << ok.out;
  p = find_comm(oj, "prog");
  ASSERT_TRUE(p);
  const json* lp = find_comm(live.report, "prog");
  ASSERT_TRUE(lp);
  EXPECT_EQ(leak_summary(*p).dump().find("leak_here") != std::string::npos, true) << oj.dump();
  EXPECT_EQ((*p)["summary"], (*lp)["summary"]);
  EXPECT_NE(oj["notes"].dump().find("same build-id"), std::string::npos) << oj["notes"].dump();
  ASSERT_EQ(system(("rm -rf " + dir).c_str()), 0);
}

// ------------------------------------------------------------------ hostile recordings

namespace {

// A recording's records, walked as recording.h describes the format.
struct RecAt {
  size_t off;
  uint32_t type, len;
};
std::vector<RecAt> records_of(const std::string& d) {
  std::vector<RecAt> v;
  uint32_t hl;
  memcpy(&hl, d.data() + 12, 4);
  for (size_t o = 16 + hl; o + 12 <= d.size();) {
    uint32_t h[3];
    memcpy(h, d.data() + o, 12);
    v.push_back({o, h[0], h[1]});
    o += 12 + h[1];
  }
  return v;
}

uint32_t fnv1a(const char* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) h = (h ^ static_cast<unsigned char>(p[i])) * 16777619u;
  return h;
}

void put32(std::string& d, size_t at, uint32_t v) { memcpy(&d[at], &v, 4); }

struct Replayed {
  Result r;
  json rep;            // the JSON report (null when none)
  long offset = -1;    // the offset the error line names
  json proc, summary;  // alloc_rounds' process object and summary
};

// replay FILE (with `data` as FILE's content) --format json.
Replayed replay_bytes(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
  Replayed x;
  x.r = run({"replay", path, "--format", "json"});
  unlink(path.c_str());
  x.rep = json::parse(x.r.out, nullptr, false);
  x.offset = field(x.r.err, R"(at offset (\d+))");
  if (const json* p = find_comm(x.rep, "alloc_rounds")) {
    x.proc = *p;
    x.summary = (*p)["summary"];
  }
  return x;
}

}  // namespace

// Issue 17: a recording cut short or with a damaged record header gives one
// error line naming the offset where it went wrong, a non-zero exit, and the
// report of every record before that offset (nothing already read is lost).
TEST_F(Features, ReplayOfACutOrCorruptRecordingNamesTheOffsetAndReportsWhatCameBefore) {
  const long R = 6;
  std::string rec = "/tmp/memtrace-test-" + std::to_string(getpid()) + "-hostile.mtr";
  ToolRun live = run_tool({"--record", rec, "--", target("alloc_rounds"), "--rounds", std::to_string(R)});
  ASSERT_EQ(live.code, 0) << live.err;
  PerRound per = parse_per_round(live.out);
  ASSERT_GT(per.allocs, 0) << live.out;
  const json* lp = find_comm(live.report, "alloc_rounds");
  ASSERT_TRUE(lp) << live.report.dump();
  const uint32_t pid = (*lp)["pid"].get<uint32_t>();
  const std::string data = slurp(rec);
  unlink(rec.c_str());
  std::vector<RecAt> recs = records_of(data);
  ASSERT_FALSE(recs.empty());
  ASSERT_EQ(recs.back().type, 4u) << "the end record is the last";
  ASSERT_EQ(recs.back().off + 12 + recs.back().len, data.size());
  const size_t end_off = recs.back().off;

  // Each round ends with leak_here's malloc(33): the records after the
  // prologue's and each round's are round boundaries (round_end[k]: k rounds done).
  std::vector<size_t> round_end;
  for (const auto& r : recs) {
    if (r.type != 1 || r.len != sizeof(mt_event)) continue;
    mt_event e;
    memcpy(&e, data.data() + r.off + 12, sizeof e);
    if (e.h.kind == MT_EV_ALLOC && e.h.pid == pid && e.size == 33) round_end.push_back(r.off + 12 + r.len);
  }
  ASSERT_EQ(round_end.size(), static_cast<size_t>(R + 1));
  const size_t k2 = round_end[2], k5 = round_end[5];
  ASSERT_LT(k5, end_off);
  std::string tmp = "/tmp/memtrace-test-" + std::to_string(getpid()) + "-cut.mtr";

  auto expect_stopped_at = [&](const Replayed& x, size_t off, const std::string& what, const char* word) {
    EXPECT_EQ(x.r.code, 1) << what << ": " << x.r.err;
    EXPECT_EQ(count_of(x.r.err, "\n"), 1) << what << ": " << x.r.err;
    EXPECT_EQ(x.r.err.rfind("memtrace-bpf: replay " + tmp + ": ", 0), 0u) << what << ": " << x.r.err;
    EXPECT_NE(x.r.err.find(word), std::string::npos) << what << ": " << x.r.err;
    EXPECT_EQ(x.offset, static_cast<long>(off)) << what << ": " << x.r.err;
    ASSERT_TRUE(x.rep.is_object()) << what << ": " << x.r.out;
    EXPECT_EQ(x.rep["replay"]["complete"], false) << what;
    EXPECT_EQ(x.rep["replay"]["error_offset"], off) << what;
    ASSERT_TRUE(x.summary.is_object()) << what << ": " << x.rep.dump();
  };

  // (a) Cut on record boundaries: after 2 rounds, after 5, and before the end record.
  Replayed c2 = replay_bytes(tmp, data.substr(0, k2));
  expect_stopped_at(c2, k2, "cut after 2 rounds", "truncated at offset");
  Replayed c5 = replay_bytes(tmp, data.substr(0, k5));
  expect_stopped_at(c5, k5, "cut after 5 rounds", "truncated at offset");
  // Exactly what the target says 3 rounds do, between the two.
  EXPECT_EQ(u(c5.proc, "allocs") - u(c2.proc, "allocs"), 3 * per.allocs);
  EXPECT_EQ(u(c5.proc, "frees") - u(c2.proc, "frees"), 3 * per.frees);
  EXPECT_EQ(u(c5.proc, "bytes_allocated") - u(c2.proc, "bytes_allocated"), 3 * per.bytes);
  EXPECT_EQ(u(c5.proc, "failed_allocs") - u(c2.proc, "failed_allocs"), 3 * per.failed);
  EXPECT_EQ(u(c5.proc, "in_use_blocks") - u(c2.proc, "in_use_blocks"), 3 * per.leaked_blocks);
  EXPECT_EQ(u(c5.proc, "in_use_bytes") - u(c2.proc, "in_use_bytes"), 3 * per.leaked_bytes);
  EXPECT_EQ(u(c5.proc, "mmap_bytes_direct") - u(c2.proc, "mmap_bytes_direct"), 3 * per.mmap_direct);
  // And the leaks so far: the prologue's round and 2 rounds' leak_here blocks.
  long leak_blocks = 0;
  for (const auto& l : c2.proc["leaks"])
    if (!l["stack"].empty() && l["stack"][0]["function"] == "leak_here") leak_blocks += l["blocks"].get<long>();
  EXPECT_EQ(leak_blocks, 3) << c2.rep.dump();
  // Without only the end record: every event, the live run's counts.
  Replayed ce = replay_bytes(tmp, data.substr(0, end_off));
  expect_stopped_at(ce, end_off, "cut before the end record", "truncated at offset");
  EXPECT_EQ(ce.summary, (*lp)["summary"]);

  // (a) Cut inside the header: nothing to report, exit 2, one line naming the offset.
  for (size_t cut : {size_t{0}, size_t{10}, size_t{40}, size_t{100}, recs.front().off - 1}) {
    Replayed h = replay_bytes(tmp, data.substr(0, cut));
    EXPECT_EQ(h.r.code, 2) << cut << ": " << h.r.err;
    EXPECT_EQ(count_of(h.r.err, "\n"), 1) << h.r.err;
    EXPECT_NE(h.r.err.find("truncated header at offset " + std::to_string(cut)), std::string::npos) << h.r.err;
    EXPECT_TRUE(h.r.out.empty()) << h.r.out;
  }

  // (a) Cut inside the record after round 2: in its header, in its payload,
  // one byte short. The error names that record's offset; the report is the
  // one of the 2 rounds, exactly.
  const RecAt* next = nullptr;
  for (const auto& r : recs)
    if (r.off == k2) next = &r;
  ASSERT_TRUE(next);
  ASSERT_EQ(next->type, 1u) << "an events-ring record follows malloc(33)";
  for (size_t cut : {k2 + 5, k2 + 12, k2 + 12 + next->len / 2, k2 + 12 + next->len - 1}) {
    Replayed m = replay_bytes(tmp, data.substr(0, cut));
    expect_stopped_at(m, k2, "cut at " + std::to_string(cut), "truncated record at offset");
    EXPECT_EQ(m.summary, c2.summary) << cut;
  }

  // (b) Damaged bytes in that record: its type, its length, its payload's kind.
  struct Damage {
    const char* what;
    std::function<void(std::string&)> apply;
    const char* says;
  };
  const size_t kind_at = k2 + 12 + offsetof(mt_hdr, kind);
  std::vector<Damage> damages = {
      {"type 0x5b", [&](std::string& d) { put32(d, k2, 0x5b); }, "corrupt record at offset"},
      {"type 0xffffffff", [&](std::string& d) { put32(d, k2, 0xffffffff); }, "corrupt record at offset"},
      {"event as a process record", [&](std::string& d) { put32(d, k2, 2); }, "corrupt record at offset"},
      {"event as a mappings record", [&](std::string& d) { put32(d, k2, 3); }, "not JSON"},
      {"length 0xffffffff", [&](std::string& d) { put32(d, k2 + 4, 0xffffffff); }, "past the end of the file"},
      {"length high byte", [&](std::string& d) { d[k2 + 7] ^= 0x40; }, "past the end of the file"},
      {"length + 1", [&](std::string& d) { put32(d, k2 + 4, next->len + 1); }, "checksum mismatch"},
      {"length - 8", [&](std::string& d) { put32(d, k2 + 4, next->len - 8); }, "checksum mismatch"},
      {"length 0", [&](std::string& d) { put32(d, k2 + 4, 0); }, "checksum mismatch"},
      {"payload kind", [&](std::string& d) { d[kind_at] ^= 0x11; }, "checksum mismatch"},
      {"payload kind, checksum fixed",
       [&](std::string& d) {
         put32(d, kind_at, 0x77);
         put32(d, k2 + 8, fnv1a(d.data() + k2 + 12, next->len));
       },
       "kind 119"},
  };
  if (next->len == sizeof(mt_event))  // a checksummed fork of the process into itself (the fuzzer's first find)
    damages.push_back({"fork into itself",
                       [&](std::string& d) {
                         mt_event e;
                         memcpy(&e, d.data() + k2 + 12, sizeof e);
                         e.h.kind = MT_EV_FORK;
                         e.addr = e.h.pid;
                         memcpy(&d[k2 + 12], &e, sizeof e);
                         put32(d, k2 + 8, fnv1a(d.data() + k2 + 12, next->len));
                       },
                       "fork record of pid"});
  for (const auto& dm : damages) {
    std::string bad = data;
    dm.apply(bad);
    Replayed x = replay_bytes(tmp, bad);
    expect_stopped_at(x, k2, dm.what, dm.says);
    EXPECT_EQ(x.summary, c2.summary) << dm.what;
  }

  // Bytes after the end record: the whole report, and an error naming where they start.
  Replayed t = replay_bytes(tmp, data + "trailing junk");
  expect_stopped_at(t, data.size(), "bytes after the end record", "after the end record");
  EXPECT_EQ(t.summary, (*lp)["summary"]);

  // Text report: the same error line, the report, where it stopped.
  std::ofstream(tmp, std::ios::binary | std::ios::trunc) << data.substr(0, k2 + 5);
  Result tx = run({"replay", tmp});
  unlink(tmp.c_str());
  EXPECT_EQ(tx.code, 1);
  EXPECT_EQ(count_of(tx.err, "\n"), 1) << tx.err;
  EXPECT_NE(tx.out.find("HEAP SUMMARY"), std::string::npos) << tx.out;
  EXPECT_NE(tx.out.find("(incomplete: stopped at offset " + std::to_string(k2) + ")"), std::string::npos) << tx.out;
}

// Issue 18: a stack record is its header and its nr frames (MT_STACK_BYTES),
// not MT_MAX_FRAMES slots; a record of any other length is refused. A
// recording of a build before that (64 frames, every stack record 552 bytes)
// still replays: this recording rewritten in that layout gives the same report.
TEST_F(Features, StackRecordsAreSizedByTheirFramesAndOld64FrameRecordingsReplay) {
  std::string rec = "/tmp/memtrace-test-" + std::to_string(getpid()) + "-frames.mtr";
  ToolRun live = run_tool({"--record", rec, "--", target("alloc_rounds"), "--rounds", "3"});
  ASSERT_EQ(live.code, 0) << live.err;
  const std::string data = slurp(rec);
  unlink(rec.c_str());
  uint32_t hl, sz[5];
  memcpy(&hl, data.data() + 12, 4);
  memcpy(sz, data.data() + 16, sizeof sz);
  EXPECT_EQ(sz[2], sizeof(mt_stack));
  EXPECT_EQ(sz[4], uint32_t(MT_MAX_FRAMES));

  const uint32_t kOldFrames = 64, kOldStack = MT_STACK_BYTES(kOldFrames);  // 552
  std::string old = data.substr(0, 16 + hl);
  put32(old, 16 + 8, kOldStack);
  put32(old, 16 + 16, kOldFrames);
  std::string longer = data;  // the first stack record 8 bytes longer than its frames
  size_t stacks = 0;
  for (const auto& r : records_of(data)) {
    std::string p = data.substr(r.off + 12, r.len);
    mt_hdr h{};
    if (p.size() >= sizeof h) memcpy(&h, p.data(), sizeof h);
    if (r.type == 1 && h.kind == MT_EV_STACK) {
      uint32_t nr;
      memcpy(&nr, p.data() + offsetof(mt_stack, nr), sizeof nr);
      EXPECT_EQ(r.len, MT_STACK_BYTES(nr)) << "a stack record of " << nr << " frames";
      ASSERT_LE(nr, kOldFrames) << "alloc_rounds' stacks are shallow";
      if (stacks++ == 0) {
        std::string q = p + std::string(8, '\0'), rh(12, '\0');
        put32(rh, 0, 1);
        put32(rh, 4, q.size());
        put32(rh, 8, fnv1a(q.data(), q.size()));
        longer = data.substr(0, r.off) + rh + q + data.substr(r.off + 12 + r.len);
      }
      p.resize(kOldStack, '\0');
    }
    std::string rh(12, '\0');
    put32(rh, 0, r.type);
    put32(rh, 4, p.size());
    put32(rh, 8, fnv1a(p.data(), p.size()));
    old += rh + p;
  }
  ASSERT_GT(stacks, 0u);
  std::string tmp = "/tmp/memtrace-test-" + std::to_string(getpid()) + "-frames-replay.mtr";
  Replayed now = replay_bytes(tmp, data);
  Replayed before = replay_bytes(tmp, old);
  ASSERT_EQ(now.r.code, 0) << now.r.err;
  ASSERT_EQ(before.r.code, 0) << before.r.err;
  ASSERT_TRUE(now.proc.is_object()) << now.r.out;
  EXPECT_EQ(now.proc, before.proc);
  EXPECT_FALSE(now.proc["leaks"].empty());
  EXPECT_EQ(now.rep["dropped"], before.rep["dropped"]);

  Replayed bad = replay_bytes(tmp, longer);
  EXPECT_EQ(bad.r.code, 1) << bad.r.err;
  EXPECT_NE(bad.r.err.find("stack record of"), std::string::npos) << bad.r.err;
}
