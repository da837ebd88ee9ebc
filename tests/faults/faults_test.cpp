// Page-fault tracing end to end (issue 6): the real tool traces fault_target,
// which prints the exact pages it touches; every assertion is exact.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cinttypes>
#include <set>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

struct Expect {
  uint64_t first = 0, end = 0, pages = 0, block = 0;
  uint64_t untouched = 0;
  std::string file;
  uint64_t file_addr = 0, file_len = 0;
};

Expect parse_expect(const std::string& out) {
  Expect x;
  if (auto at = out.find("buffer first="); at != std::string::npos)
    sscanf(out.c_str() + at, "buffer first=%" SCNx64 " end=%" SCNx64 " pages=%" SCNu64 " block=%" SCNx64, &x.first,
           &x.end, &x.pages, &x.block);
  if (auto at = out.find("untouched addr="); at != std::string::npos)
    sscanf(out.c_str() + at, "untouched addr=%" SCNx64, &x.untouched);
  if (auto at = out.find("file path="); at != std::string::npos) {
    char path[512] = {};
    sscanf(out.c_str() + at, "file path=%511s addr=%" SCNx64 " len=%" SCNu64, path, &x.file_addr, &x.file_len);
    x.file = path;
  }
  return x;
}

std::vector<json> json_lines(const std::string& s) {
  std::vector<json> v;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nl = s.find('\n', pos);
    std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    if (!line.empty() && line[0] == '{') {
      auto j = json::parse(line, nullptr, false);
      if (!j.is_discarded()) v.push_back(std::move(j));
    }
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  return v;
}

uint64_t addr_of(const json& j, const char* k) { return std::stoull(j[k].get<std::string>(), nullptr, 16); }

bool starts_with(const json& j, const std::string& prefix) {
  return j.is_string() && j.get<std::string>().rfind(prefix, 0) == 0;
}

const json* site_of(const json& list, const std::string& function) {
  for (const auto& s : list)
    if (!s["stack"].empty() && s["stack"][0]["function"] == function) return &s;
  return nullptr;
}

void expect_no_fault_losses(const json& rep) {
  ASSERT_TRUE(rep.contains("dropped")) << rep.dump();
  for (const char* k : {"ringbuf", "fault_ringbuf", "stack_ringbuf", "malformed", "stack_record_missing"})
    EXPECT_EQ(rep["dropped"][k].get<long>(), 0) << k << " in " << rep["dropped"].dump();
}

class Faults : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

}  // namespace

// One write fault per page of the buffer, charged to alloc_buffer's stack,
// with its ip in write_pages; no read fault on them (written first); the file
// mapping's faults charged to the file; the untouched block shown as such.
TEST_F(Faults, LaunchChargesEveryPageOnceToItsAllocation) {
  std::string file = "/tmp/memtrace-faults-" + std::to_string(getpid()) + ".dat";
  ToolRun r = run_tool({"--trace-faults", "--", target("fault_target"), "--file", file, "--linger-ms", "300"});
  unlink(file.c_str());
  ASSERT_EQ(r.code, 0) << r.err;
  Expect x = parse_expect(r.out);
  ASSERT_EQ(x.pages, 1024u) << r.out;
  ASSERT_FALSE(x.file.empty()) << r.out;

  // Trace lines: in the -o file before the report (JSON lines with --format
  // json), nothing on stderr (issue 17: they went to stderr).
  EXPECT_EQ(r.err.find("\"first_touch\""), std::string::npos) << r.err.substr(0, 2000);
  uint64_t buf_writes = 0, buf_reads = 0, file_faults = 0;
  std::set<uint64_t> pages;
  for (const auto& l : json_lines(r.lines)) {
    uint64_t a = addr_of(l, "address");
    if (a >= x.first && a < x.end) {
      if (l["access"] == "W") buf_writes++;
      else buf_reads++;
      pages.insert(a & ~4095ull);
      EXPECT_EQ(l["hit"]["kind"], "block") << l.dump();
      EXPECT_EQ(addr_of(l["hit"], "start"), x.block) << l.dump();
      EXPECT_TRUE(starts_with(l["function"], "write_pages")) << l.dump();
      EXPECT_TRUE(starts_with(l["hit"]["alloc_function"], "alloc_buffer")) << l.dump();
      EXPECT_EQ(l["first_touch"], true) << l.dump();
    }
    if (a >= x.file_addr && a < x.file_addr + x.file_len) {
      file_faults++;
      EXPECT_EQ(l["access"], "R") << l.dump();
      EXPECT_EQ(l["hit"]["kind"], "file") << l.dump();
      EXPECT_EQ(l["hit"]["path"], x.file) << l.dump();
      EXPECT_TRUE(starts_with(l["function"], "read_file")) << l.dump();
    }
  }
  EXPECT_EQ(buf_writes, x.pages);
  EXPECT_EQ(buf_reads, 0u);
  EXPECT_EQ(pages.size(), x.pages);
  // Read faults map the page cache with fault-around (up to 16 pages each).
  EXPECT_GE(file_faults, 1u);
  EXPECT_LE(file_faults, x.file_len / 4096);

  // The report.
  const json* p = find_comm(r.report, "fault_target");
  ASSERT_TRUE(p && p->contains("faults")) << r.report.dump();
  const json& f = (*p)["faults"];
  EXPECT_EQ(f["total"].get<uint64_t>(), f["read"].get<uint64_t>() + f["write"].get<uint64_t>());
  EXPECT_GE(f["write"].get<uint64_t>(), x.pages);
  const json* site = site_of(f["by_stack"], "alloc_buffer");
  ASSERT_TRUE(site) << f["by_stack"].dump();
  EXPECT_EQ((*site)["pages"], x.pages);
  EXPECT_EQ((*site)["faults"], x.pages);
  EXPECT_EQ((*site)["writes"], x.pages);
  EXPECT_EQ((*site)["reads"], 0);
  EXPECT_EQ((*site)["kind"], "block");
  EXPECT_EQ((*site)["stack"][1]["function"], "main");
  // RSS by allocation site: the buffer's stack is the biggest.
  EXPECT_EQ(f["by_stack"][0]["stack"][0]["function"], "alloc_buffer") << f["by_stack"].dump();
  // Allocated but never touched: visible next to bytes allocated.
  const json* un = site_of(f["by_bytes"], "alloc_untouched");
  ASSERT_TRUE(un) << f["by_bytes"].dump();
  EXPECT_EQ((*un)["bytes"], 1 << 20);
  EXPECT_EQ((*un)["blocks"], 1);
  EXPECT_EQ((*un)["touched_blocks"], 0);
  EXPECT_EQ((*un)["pages"], 0);
  const json* bb = site_of(f["by_bytes"], "alloc_buffer");
  ASSERT_TRUE(bb);
  EXPECT_EQ((*bb)["touched_blocks"], 1);
  bool file_region = false;
  for (const auto& m : f["by_mapping"])
    if (m["region"] == x.file) {
      file_region = true;
      EXPECT_EQ(m["faults"].get<uint64_t>(), file_faults);
      EXPECT_EQ(m["writes"], 0);
    }
  EXPECT_TRUE(file_region) << f["by_mapping"].dump();
  // The leak groups say which blocks were never touched.
  for (const auto& l : (*p)["leaks"])
    if (!l["stack"].empty() && l["stack"][0]["function"] == "alloc_untouched") {
      EXPECT_EQ(l["untouched_blocks"], 1);
    }
  expect_no_fault_losses(r.report);
}

// -c: only the named program's faults; a copy under another name is not traced.
TEST_F(Faults, CommFilterTracesOnlyTheNamedProgram) {
  std::string rep = tmpfile("c");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--faults", "-c", "fault_target"});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  std::string outs[2];
  for (int i = 0; i < 2; i++) {
    Child t = spawn({target(i ? "fault_target" : "fault_other")});
    close(t.in);
    outs[i] = read_all(t.out);
    close(t.out);
    close(t.err);
    EXPECT_EQ(wait_exit(t.pid), 0);
  }
  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;
  std::ifstream f(rep);
  json j = json::parse(f, nullptr, false);
  unlink(rep.c_str());
  EXPECT_EQ(find_comm(j, "fault_other"), nullptr) << j.dump();
  const json* p = find_comm(j, "fault_target");
  ASSERT_TRUE(p && p->contains("faults")) << j.dump();
  Expect x = parse_expect(outs[1]);
  const json* site = site_of((*p)["faults"]["by_stack"], "alloc_buffer");
  ASSERT_TRUE(site) << (*p)["faults"].dump();
  EXPECT_EQ((*site)["pages"], x.pages);
  EXPECT_EQ((*site)["writes"], x.pages);
  expect_no_fault_losses(j);
}

TEST_F(Faults, BadRangeIsOneClearErrorAndNonZeroExit) {
  Child t = spawn({target("fault_target"), "--wait"});
  std::string tout;
  ASSERT_TRUE(read_until(t.out, "ready", &tout));
  ToolRun r = run_tool({"-p", std::to_string(t.pid), "--rearm", "10", "--range", "0x1000-0x3000"});
  EXPECT_NE(r.code, 0);
  // (Before 5.17 --rearm itself is refused first: no bpf_find_vma.)
  std::string want = kernel_ok("page faults") ? "--range 0x1000-0x3000 is not mapped in process " + std::to_string(t.pid)
                                              : "--rearm needs bpf_find_vma";
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  ToolRun r2 = run_tool({"-p", std::to_string(t.pid), "--rearm", "10"});
  EXPECT_EQ(r2.code, 2);
  EXPECT_NE(r2.err.find("--rearm needs --range"), std::string::npos) << r2.err;
  ToolRun r3 = run_tool({"--rearm", "10", "--range", "0x1000-0x2000", "--", target("fault_target")});
  EXPECT_EQ(r3.code, 2);
  EXPECT_NE(r3.err.find("exactly one -p PID"), std::string::npos) << r3.err;
  // The target was never touched: it runs to the end.
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  EXPECT_TRUE(read_until(t.out, "done", &tout)) << tout;
  EXPECT_EQ(wait_exit(t.pid), 0);
}

// --rearm: sweeps slower than the interval fault once per page per sweep,
// each seen by BPF as an access error (the helper restores the page).
TEST_F(Faults, RearmFaultsOncePerPagePerSweep) {
  const int kSweeps = 5, kPages = 64;
  Child t = spawn({target("fault_target"), "--wait", "--sweeps", std::to_string(kSweeps), "--gap-ms", "100",
                   "--sweep-pages", std::to_string(kPages)});
  std::string tout;
  ASSERT_TRUE(read_until(t.out, "ready", &tout));
  Expect x = parse_expect(tout);
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  ASSERT_TRUE(read_until(t.out, "written", &tout));
  char range[64];
  snprintf(range, sizeof range, "0x%" PRIx64 "-0x%" PRIx64, x.first, x.first + kPages * 4096);
  std::string rep = tmpfile("rearm");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--trace-faults", "-p", std::to_string(t.pid), "--rearm",
                   "20", "--range", range});
  std::string merr;
  if (!kernel_ok("page faults")) {
    // Before 5.17 (no bpf_find_vma) --rearm is switched off with one line.
    close(m.in);
    merr = read_all(m.err);
    EXPECT_EQ(wait_exit(m.pid), 2);
    EXPECT_NE(merr.find("--rearm needs bpf_find_vma (kernel 5.17)"), std::string::npos) << merr;
    EXPECT_EQ(std::count(merr.begin(), merr.end(), '\n'), 1) << merr;
    kill(t.pid, SIGKILL);
    wait_exit(t.pid);
    return;
  }
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  std::string mout;
  std::thread reader([&] { mout = read_all(m.out); });
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  EXPECT_TRUE(read_until(t.out, "done", &tout)) << tout;
  EXPECT_EQ(wait_exit(t.pid), 0);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;
  reader.join();
  std::ifstream f(rep);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string file = ss.str();
  size_t at = report_offset(file);
  json j = json::parse(file.substr(at), nullptr, false);
  mout = file.substr(0, at);  // the trace lines go where the report goes (-o FILE)
  unlink(rep.c_str());

  std::map<uint64_t, int> per_page;
  uint64_t in_range = 0;
  for (const auto& l : json_lines(mout)) {
    uint64_t a = addr_of(l, "address");
    if (a < x.first || a >= x.first + kPages * 4096) continue;
    in_range++;
    per_page[a & ~4095ull]++;
    EXPECT_EQ(l["access"], "R") << l.dump();
    EXPECT_EQ(l["access_error"], true) << l.dump();
    EXPECT_TRUE(starts_with(l["function"], "sweep_pages")) << l.dump();
  }
  EXPECT_EQ(in_range, static_cast<uint64_t>(kSweeps * kPages)) << mout.substr(0, 2000);
  EXPECT_EQ(per_page.size(), static_cast<size_t>(kPages));
  for (const auto& [pg, n] : per_page) EXPECT_EQ(n, kSweeps) << std::hex << pg;
  // The helper restored exactly those (none twice, none missed).
  ASSERT_TRUE(j.contains("rearm") && j["rearm"].contains("rearm")) << j.dump();
  EXPECT_EQ(j["rearm"]["rearm"]["first_accesses"], kSweeps * kPages) << j["rearm"]["rearm"].dump();
  const json* p = find_proc(j, t.pid);
  ASSERT_TRUE(p) << j.dump();
  EXPECT_EQ((*p)["faults"]["access_errors"], kSweeps * kPages);
  expect_no_fault_losses(j);
}
