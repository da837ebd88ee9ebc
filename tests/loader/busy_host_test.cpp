// System-wide tracing on a busy host (issue 17): background load, a known
// program started in the middle, its counts exact, no ring drop, its
// mappings captured although it lives only a few hundred ms.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

class BusyHost : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// alloc_rounds --rounds R, its pid and stdout.
std::pair<pid_t, std::string> run_known(long rounds) {
  Child t = spawn({target("alloc_rounds"), "--rounds", std::to_string(rounds)});
  close(t.in);
  std::string out = read_all(t.out);
  close(t.out);
  close(t.err);
  EXPECT_EQ(wait_exit(t.pid), 0);
  return {t.pid, out};
}

// SIGINT to the tool, its stderr appended to err, its JSON report at rep
// (null if it did not exit 0 or wrote none).
json stop_tool(Child& m, const std::string& rep, std::string& err) {
  kill(m.pid, SIGINT);
  std::thread drain([&] { err += read_all(m.err); });
  int code = wait_exit(m.pid);
  drain.join();
  EXPECT_EQ(code, 0) << err;
  std::ifstream f(rep);
  json j = json::parse(f, nullptr, false);
  unlink(rep.c_str());
  return code == 0 ? j : json();
}

bool stack_has(const json& p, long block_bytes, const std::string& function) {
  for (const auto& l : p["leaks"]) {
    if (l["blocks"].get<long>() == 0 || l["bytes"].get<long>() % block_bytes) continue;
    for (const auto& f : l["stack"])
      if (f.value("function", "") == function) return true;
  }
  return false;
}

}  // namespace

// Two processes allocating as fast as they can (each ~10^5-10^6 events/s
// traced on a 2-vCPU VM) and a shell starting short processes in a loop,
// for ~12 s; alloc_rounds --rounds 0 and --rounds R in the middle: the
// difference of their reports is exactly R x the program's per-round counts,
// nothing was dropped from the rings, and its leak's stack is symbolized
// (its mappings were read while it lived).
TEST_F(BusyHost, KnownProgramExactUnderLoadSystemWide) {
  std::string rep = tmpfile("busy");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5"});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;

  const int kStormSeconds = 10;
  std::vector<Child> load;
  for (int i = 0; i < 2; i++)
    load.push_back(spawn({target("alloc_storm"), "--seconds", std::to_string(kStormSeconds)}));
  load.push_back(spawn({"/bin/sh", "-c", "while :; do ls / >/dev/null; /bin/true; done"}));
  for (auto& c : load) close(c.in);
  sleep(3);

  const long R = 300;
  auto [pid0, out0] = run_known(0);
  auto [pidn, outn] = run_known(R);
  sleep(2);

  kill(load[2].pid, SIGKILL);
  std::string storm_out;
  for (auto& c : load) {
    std::string o = read_all(c.out);
    if (c.pid != load[2].pid) storm_out += o;
    wait_exit(c.pid);
    close(c.out);
    close(c.err);
  }
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;

  // The load was real: events counted, pairs made.
  long events = j["stats"]["events"].get<long>();
  std::cerr << "events " << events << ", storms: " << storm_out << "dropped " << j["dropped"].dump()
            << "\nmappings_not_captured " << j["stats"]["mappings_not_captured"] << "\n";
  EXPECT_GT(events, 500000);

  PerRound per = parse_per_round(outn);
  ASSERT_GT(per.allocs, 0) << outn;
  const json* p0 = find_proc(j, pid0);
  const json* pn = find_proc(j, pidn);
  ASSERT_TRUE(p0 && pn) << "known program not in the report (" << j["processes"].size() << " processes)";
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*pn, "frees") - u(*p0, "frees"), R * per.frees);
  EXPECT_EQ(u(*pn, "bytes_allocated") - u(*p0, "bytes_allocated"), R * per.bytes);
  EXPECT_EQ(u(*pn, "failed_allocs") - u(*p0, "failed_allocs"), R * per.failed);
  EXPECT_EQ(u(*pn, "in_use_blocks") - u(*p0, "in_use_blocks"), R * per.leaked_blocks);
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * per.leaked_bytes);
  // Its leak's frames name the function: mappings read while it lived.
  EXPECT_TRUE(stack_has(*pn, 33, "leak_here")) << (*pn)["leaks"].dump();

  for (const char* k : {"ringbuf", "stack_ringbuf"})
    EXPECT_EQ(j["dropped"][k].get<long>(), 0) << k << " in " << j["dropped"].dump();
}

// System-wide, a short process often exits before the loader has read its
// /proc/PID/maps (it is never stopped). Its address space is then rebuilt
// from the kernel's records of what it mapped (MT_EV_MAPFILE: the program
// at exec, each library mmap'd with PROT_EXEC): its leak's stack is
// symbolized through the program and libc. MEMTRACE_TEST_UNREADABLE_COMM
// makes the loader take every process of that name for gone before it
// reads it (no maps, no unwind tables: the rows come through its VMAs).
TEST_F(BusyHost, ProcessGoneBeforeItsMapsAreReadIsSymbolized) {
  std::string rep = tmpfile("gone"), rec = tmpfile("gone-rec");
  setenv("MEMTRACE_TEST_UNREADABLE_COMM", "alloc_rounds", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5", "--record", rec});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  const long R = 100;
  auto [pid0, out0] = run_known(0);
  auto [pidn, outn] = run_known(R);
  sleep(1);
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;
  const json& st = j["stats"];
  std::cerr << "mappings_not_captured " << st["mappings_not_captured"] << ", from_kernel "
            << st["mappings_from_kernel"] << ", unresolved " << st["mappings_from_kernel_unresolved"] << "\n";
  // Both runs unread; each: the program (its code segment), ld.so, libc.
  EXPECT_GE(st["mappings_not_captured"].get<long>(), 2);
  EXPECT_GE(st["mappings_from_kernel"].get<long>(), 6);

  PerRound per = parse_per_round(outn);
  const json* p0 = find_proc(j, pid0);
  const json* pn = find_proc(j, pidn);
  ASSERT_TRUE(p0 && pn) << j["processes"].size() << " processes";
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * per.leaked_bytes);
  // Named through the program's own file and through libc's.
  EXPECT_TRUE(stack_has(*pn, 33, "leak_here")) << (*pn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*pn, 33, "main")) << (*pn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*pn, 33, "__libc_start_call_main")) << (*pn)["leaks"].dump();

  // The recording has the rebuilt mappings: replay names the same frames.
  ToolRun rp = run_argv({tool(), "replay", rec, "--format", "json", "--top", "5"});
  unlink(rec.c_str());
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rj = json::parse(rp.out, nullptr, false);
  const json* rn = find_proc(rj, pidn);
  ASSERT_TRUE(rn) << rp.err;
  EXPECT_TRUE(stack_has(*rn, 33, "leak_here")) << (*rn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*rn, 33, "__libc_start_call_main")) << (*rn)["leaks"].dump();
}
