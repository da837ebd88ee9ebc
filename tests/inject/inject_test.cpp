// --inject (issue 21): the agent loaded into a running target by ptrace, its
// records read from the shared ring into the heap model, counts exact; the
// target outlives the tool (detach, SIGKILL). tests/inject/inject_target.c
// knows its own counts.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>

#include "heap/heap_model.h"
#include "inject/session.h"
#include "test_env.h"
#include "../loader/harness.h"
#include "inject_util.h"

using namespace memtrace;
using namespace memtrace::testing;
using json = nlohmann::json;

namespace {

struct Traced {
  int code = -1;
  std::string out;
  heap::HeapModel model;
  uint64_t drops = 0, records = 0;
  uint32_t stack_used = 0, slots = 0;
};

// The target injected in this process, drained into a model until it exits.
void trace_target(int rounds, int stack_mode, Traced& t) {
  Child c = spawn({std::string(TARGET_DIR) + "/inject_target", std::to_string(rounds)});
  close(c.in);
  pid_t pid = ready_pid(c, &t.out);
  ASSERT_EQ(pid, c.pid) << t.out;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.stack_mode = stack_mode;
  o.ring_mb = 16;
  auto s = inject::Session::start(pid, o);
  ASSERT_TRUE(s) << s.error().message;
  t.stack_used = (*s)->ring().hdr().stack_used;
  t.slots = (*s)->ring().hdr().slots_hooked;
  auto apply = [&](const void* d, size_t n) {
    t.model.apply(d, n);
    t.records++;
  };
  for (;;) {
    (*s)->drain(apply);
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      t.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  (*s)->detach();
  (*s)->drain(apply);
  t.drops = (*s)->ring().hdr().drops;
  read_until(c.out, "expect", &t.out, 2000);
  t.out += read_all(c.out);
}

void expect_exact(const Traced& t, pid_t) {
  Expect e = parse_expect(t.out);
  ASSERT_GT(e.allocs, 0) << t.out;
  ASSERT_EQ(t.model.processes().size(), 1u);
  const heap::Process& p = *t.model.processes().begin()->second;
  EXPECT_EQ(t.drops, 0u);
  EXPECT_EQ(t.model.malformed_records(), 0u);
  EXPECT_EQ(static_cast<long>(p.s.allocs), e.allocs);
  EXPECT_EQ(static_cast<long>(p.s.frees), e.frees);
  EXPECT_EQ(static_cast<long>(p.s.bytes_allocated), e.bytes);
  EXPECT_EQ(static_cast<long>(p.s.in_use_blocks), e.leaked_blocks);
  EXPECT_EQ(static_cast<long>(p.s.in_use_bytes), e.leaked_bytes);
  EXPECT_EQ(p.s.unknown_frees, 0u);
  EXPECT_EQ(p.s.failed_allocs, 0u);
}

}  // namespace

// libunwind's unw_backtrace (the default): exact counts, stacks through main.
TEST(Inject, RingCountsExactLibunwind) {
  MEMTRACE_REQUIRE_ROOT();
  Traced t;
  trace_target(2000, MT_INJ_STACK_LIBUNWIND, t);
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_EQ(t.stack_used, uint32_t{MT_INJ_STACK_LIBUNWIND});
  EXPECT_GT(t.slots, 0u);
  expect_exact(t, 0);
  // Every leaked block has a stack: leak_here < one_round < main < libc's start.
  const heap::Process& p = *t.model.processes().begin()->second;
  for (const auto& [addr, b] : p.live) {
    const heap::Stack* st = t.model.stack(b.stack_id);
    ASSERT_NE(st, nullptr);
    EXPECT_GE(st->ips.size(), 4u);
  }
  EXPECT_EQ(t.model.missing_stacks(), 0u);
}

// Frame pointers (the target is built with them): the same counts.
TEST(Inject, RingCountsExactFramePointers) {
  MEMTRACE_REQUIRE_ROOT();
  Traced t;
  trace_target(2000, MT_INJ_STACK_FP, t);
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_EQ(t.stack_used, uint32_t{MT_INJ_STACK_FP});
  expect_exact(t, 0);
  const heap::Process& p = *t.model.processes().begin()->second;
  for (const auto& [addr, b] : p.live) {
    const heap::Stack* st = t.model.stack(b.stack_id);
    ASSERT_NE(st, nullptr);
    EXPECT_GE(st->ips.size(), 3u);
  }
}

// The session ends first: the hooks call straight through, the target runs
// more rounds with its memory intact and exits 0.
TEST(Inject, TargetOutlivesDetach) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/inject_target", "500", "outlive"});
  close(c.in);
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_GT(pid, 0) << out;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  {
    auto s = inject::Session::start(pid, o);
    ASSERT_TRUE(s) << s.error().message;
    ASSERT_TRUE(read_until(c.out, "outliving", &out)) << out;
    (*s)->drain([](const void*, size_t) {});
  }  // detached and unmapped here
  ASSERT_TRUE(read_until(c.out, "done", &out, 20000)) << out;
  EXPECT_EQ(exit_within(pid, 10000), 0) << out;
}

// The loader dies without a word (SIGKILL): its heartbeat goes stale, the
// hooks call straight through, the target exits 0.
TEST(Inject, TargetOutlivesSigkilledLoader) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/inject_target", "500", "outlive"});
  close(c.in);
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_GT(pid, 0) << out;
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t loader = fork();
  if (loader == 0) {  // the loader: injects, drains, never detaches
    inject::SessionOptions o;
    o.agent = AGENT;
    o.ring_mb = 16;
    auto s = inject::Session::start(pid, o);
    if (!s) _exit(1);
    if (write(ready[1], "k", 1) != 1) _exit(1);
    for (;;) {
      (*s)->drain([](const void*, size_t) {});
      usleep(2000);
    }
  }
  close(ready[1]);
  char k = 0;
  ASSERT_EQ(read(ready[0], &k, 1), 1) << "the loader could not inject";
  close(ready[0]);
  ASSERT_TRUE(read_until(c.out, "outliving", &out)) << out;
  kill(loader, SIGKILL);
  waitpid(loader, nullptr, 0);
  ASSERT_TRUE(read_until(c.out, "done", &out, 30000)) << out;
  EXPECT_EQ(exit_within(pid, 10000), 0) << out;
}

// dlopen is found in a process's libc through src/elf and src/procfs.
TEST(Inject, FindsDlopenInLibc) {
  MEMTRACE_REQUIRE_ROOT();
  auto r = inject::libc_function(getpid(), "dlopen");
  // This test binary is dynamic: its own libc is found.
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NE(*r, 0u);
}

// memtrace-bpf --inject -p PID: the agent's records in the same heap model
// and report as the BPF path's (BPF keeps mmap/brk and the exit): counts
// exact, the leak named by its stack, nothing dropped; the process exits 0.
namespace {
// inject_target (argv) run to its end under `memtrace-bpf --inject -p`: the
// JSON report, the target's pid and what it says it did, the tool's stderr.
struct InjectedRun {
  json report;
  pid_t pid = 0;
  Expect expect;
  std::string err;
};
void run_injected(const std::vector<std::string>& argv, InjectedRun* out) {
  Child t = spawn(argv);
  close(t.in);
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  ASSERT_EQ(pid, t.pid) << tout;
  std::string rep = tmpfile("inject");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-p", std::to_string(pid)});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  ASSERT_TRUE(read_until(t.out, "expect", &tout)) << tout;
  ASSERT_TRUE(read_until(t.out, "\n", &tout)) << tout;
  EXPECT_EQ(exit_within(t.pid, 20000), 0) << tout;
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;  // the tool ends when its process does
  out->report = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  out->pid = pid;
  out->expect = parse_expect(tout);
  out->err = merr;
}
}  // namespace

TEST(Inject, CliReportExact) {
  MEMTRACE_REQUIRE_ROOT();
  InjectedRun run;
  ASSERT_NO_FATAL_FAILURE(run_injected({std::string(TARGET_DIR) + "/inject_target", "2000"}, &run));
  const json& j = run.report;
  const json* p = find_proc(j, run.pid);
  ASSERT_TRUE(p) << j.dump() << run.err;
  const Expect& e = run.expect;
  EXPECT_EQ(u(*p, "allocs"), e.allocs);
  EXPECT_EQ(u(*p, "frees"), e.frees);
  EXPECT_EQ(u(*p, "bytes_allocated"), e.bytes);
  EXPECT_EQ(u(*p, "in_use_blocks"), e.leaked_blocks);
  EXPECT_EQ(u(*p, "in_use_bytes"), e.leaked_bytes);
  EXPECT_EQ((*p)["exit_code"], 0);
  for (const char* k : {"inject_ring_full", "inject_malformed", "stack_record_missing", "malformed"})
    EXPECT_EQ(j["dropped"][k].get<long>(), 0) << k << " in " << j["dropped"].dump();
  // The leak, by its stack: leak_here < one_round < main.
  const json* leak = nullptr;
  for (const auto& l : (*p)["leaks"])
    if (l["bytes"] == e.leaked_bytes && l["blocks"] == e.leaked_blocks) leak = &l;
  ASSERT_TRUE(leak) << (*p)["leaks"].dump();
  ASSERT_GE((*leak)["stack"].size(), 3u) << leak->dump();
  EXPECT_EQ((*leak)["stack"][0]["function"], "leak_here") << leak->dump();
  EXPECT_EQ((*leak)["stack"][1]["function"], "one_round") << leak->dump();
  EXPECT_EQ((*leak)["stack"][2]["function"], "main") << leak->dump();
}

// --inject system-wide (no -p, -c or program): one line, exit 2.
TEST(Inject, CliRefusesSystemWide) {
  MEMTRACE_REQUIRE_ROOT();
  ToolRun r = run_argv({MEMTRACE_BIN, "--inject"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--inject needs -p PID, -c COMM, --cgroup PATH or a program to launch"), std::string::npos) << r.err;
}

namespace {

// memtrace-bpf --inject -p PID on target t, which waits for a line on stdin
// (tool_env: the tool's environment): one line on stderr names why the
// agent cannot go into it, the tool traces it with uprobes, and its report
// has exactly the counts of the target's next expect line.
// why empty: the agent goes into it (no such line), the counts its.
void expect_fallback_exact(Child& t, pid_t pid, const std::string& why, const std::vector<std::string>& tool_env = {}) {
  std::string rep = tmpfile("fallback");
  std::vector<std::string> argv;
  if (!tool_env.empty()) {
    argv.push_back("/usr/bin/env");
    argv.insert(argv.end(), tool_env.begin(), tool_env.end());
  }
  argv.insert(argv.end(), {MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-p", std::to_string(pid)});
  Child m = spawn(argv);
  close(m.in);
  std::string merr, tout;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  EXPECT_EQ(count_of(merr, "is traced with uprobes instead"), why.empty() ? 0u : 1u) << merr;
  EXPECT_NE(merr.find(why), std::string::npos) << merr;
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  close(t.in);
  ASSERT_TRUE(read_until(t.out, "expect", &tout)) << tout;
  ASSERT_TRUE(read_until(t.out, "\n", &tout)) << tout;
  EXPECT_EQ(exit_within(t.pid, 20000), 0) << tout;
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* p = find_proc(j, pid);
  ASSERT_TRUE(p) << j.dump() << merr;
  expect_report_exact(*p, parse_expect(tout));
  EXPECT_EQ((*p)["exit_code"], 0);
}

// The same on a target started here (traced_already: ptrace'd by this test
// first, so the tool's PTRACE_SEIZE is refused).
void cli_falls_back(const std::vector<std::string>& target, const std::string& why,
                    const std::vector<std::string>& tool_env = {}, bool traced_already = false) {
  Child t = spawn(target);
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  ASSERT_EQ(pid, t.pid) << tout;
  if (traced_already) {
    ASSERT_EQ(ptrace(PTRACE_SEIZE, pid, nullptr, nullptr), 0) << strerror(errno);
  }
  expect_fallback_exact(t, pid, why, tool_env);
}

}  // namespace

// A static program (no ld.so, no dlopen): the BPF path, exact.
TEST(Inject, CliFallsBackOnStaticProgram) {
  MEMTRACE_REQUIRE_ROOT();
  cli_falls_back({std::string(TARGET_DIR) + "/inject_target_static", "2000", "stdin"}, "maps no libc");
}

// A seccomp filter (one that allows everything): not injected, exact.
TEST(Inject, CliFallsBackUnderSeccomp) {
  MEMTRACE_REQUIRE_ROOT();
  cli_falls_back({std::string(TARGET_DIR) + "/inject_target", "2000", "seccomp"}, "runs under seccomp (mode 2)");
}

// A preloaded allocator (jemalloc, tcmalloc, mimalloc): injected since
// issue 33, allocators_test.cpp (InjectAllocators.Preloaded*Exact).

namespace {
// A chroot holding inject_target, its libraries and the agent's (and
// libunwind with its own, with_unwind), and an empty /dev/shm.
std::string make_chroot(bool with_unwind) {
  char tmpl[] = "/tmp/mtb-chroot-XXXXXX";
  if (!mkdtemp(tmpl)) return "";
  std::string d = tmpl, unw = with_unwind ? " /usr/lib/x86_64-linux-gnu/libunwind.so.8" : "";
  std::string cmd = "set -e; D=" + d + "; mkdir -p $D/dev/shm; cp " + std::string(TARGET_DIR) +
                    "/inject_target $D/; for l in" + unw + " $(ldd " + TARGET_DIR + "/inject_target " + AGENT + unw +
                    " | grep -o '/[^ :]*' | sort -u); do mkdir -p $D$(dirname $l); cp -L $l $D$l; done";
  return system(cmd.c_str()) == 0 ? d : "";
}
}  // namespace

// A chroot's process (same PID namespace): the ring and a copy of the agent
// go in its /dev/shm; exact counts, and the leak's stack, as outside.
TEST(Inject, CliInjectsIntoAChrootsProcess) {
  MEMTRACE_REQUIRE_ROOT();
  std::string root = make_chroot(true);
  ASSERT_FALSE(root.empty());
  InjectedRun run;
  ASSERT_NO_FATAL_FAILURE(run_injected({"/usr/sbin/chroot", root, "/inject_target", "2000"}, &run));
  EXPECT_EQ(run.err.find("uprobes instead"), std::string::npos) << run.err;
  const json& j = run.report;
  const json* p = find_proc(j, run.pid);
  ASSERT_TRUE(p) << j.dump() << run.err;
  const Expect& e = run.expect;
  EXPECT_EQ(u(*p, "allocs"), e.allocs);
  EXPECT_EQ(u(*p, "frees"), e.frees);
  EXPECT_EQ(u(*p, "bytes_allocated"), e.bytes);
  EXPECT_EQ(u(*p, "in_use_bytes"), e.leaked_bytes);
  for (const char* k : {"inject_ring_full", "inject_stack_cut", "stack_record_missing", "malformed"})
    EXPECT_EQ(j["dropped"][k].get<long>(), 0) << k << " in " << j["dropped"].dump();
  const json* leak = nullptr;
  for (const auto& l : (*p)["leaks"])
    if (l["bytes"] == e.leaked_bytes && l["blocks"] == e.leaked_blocks) leak = &l;
  ASSERT_TRUE(leak) << (*p)["leaks"].dump();
  ASSERT_GE((*leak)["stack"].size(), 3u) << leak->dump();
  EXPECT_EQ((*leak)["stack"][0]["function"], "leak_here") << leak->dump();
  EXPECT_EQ((*leak)["stack"][2]["function"], "main") << leak->dump();
  // Nothing of the session left in its root: the agent's copy and the
  // ring are unlinked once mapped.
  EXPECT_EQ(system(("test -z \"$(ls -A " + root + "/dev/shm)\"").c_str()), 0) << "left in " << root << "/dev/shm";
  system(("rm -rf " + root).c_str());
}

// A chroot without libunwind (which finishes the stacks the agent's rows do
// not): one line, the BPF path, exact.
TEST(Inject, CliFallsBackInAChrootWithoutLibunwind) {
  MEMTRACE_REQUIRE_ROOT();
  std::string root = make_chroot(false);
  ASSERT_FALSE(root.empty());
  cli_falls_back({"/usr/sbin/chroot", root, "/inject_target", "2000", "stdin"}, "without libunwind.so.8");
  system(("rm -rf " + root).c_str());
}

// ptrace refused (another tracer has the process; Yama's scope 3 refuses
// it the same way, and cannot be undone without a reboot to test here).
TEST(Inject, CliFallsBackWhenPtraceIsRefused) {
  MEMTRACE_REQUIRE_ROOT();
  cli_falls_back({std::string(TARGET_DIR) + "/inject_target", "2000", "stdin"}, "Operation not permitted", {}, true);
}

// No agent library where the tool looks for it: the BPF path, exact.
TEST(Inject, CliFallsBackWithoutTheAgent) {
  MEMTRACE_REQUIRE_ROOT();
  cli_falls_back({std::string(TARGET_DIR) + "/inject_target", "2000", "stdin"},
                 "agent library /nonexistent/libmemtrace_agent.so: No such file",
                 {"MEMTRACE_AGENT=/nonexistent/libmemtrace_agent.so"});
}

// The tool ends first (--duration, then SIGKILL): the target runs on, its
// hooks calling straight through, and exits 0.
void cli_outlive(bool sigkill) {
  Child t = spawn({std::string(TARGET_DIR) + "/inject_target", "500", "outlive"});
  close(t.in);
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  ASSERT_EQ(pid, t.pid) << tout;
  std::string rep = tmpfile("outlive");
  std::vector<std::string> argv = {MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-p", std::to_string(pid)};
  if (!sigkill) argv.insert(argv.end(), {"--duration", "1"});
  Child m = spawn(argv);
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  ASSERT_TRUE(read_until(t.out, "outliving", &tout)) << tout;
  if (sigkill) kill(m.pid, SIGKILL);
  int tool_code = exit_within(m.pid, 30000);
  EXPECT_EQ(tool_code, sigkill ? 128 + SIGKILL : 0) << merr;
  ASSERT_TRUE(read_until(t.out, "done", &tout, 30000)) << tout;
  EXPECT_EQ(exit_within(t.pid, 10000), 0) << tout;
  if (!sigkill) {  // what it saw is in its report: the first 500 rounds exactly
    json j = json::parse(slurp_file(rep), nullptr, false);
    const json* p = find_proc(j, pid);
    ASSERT_TRUE(p) << j.dump();
    Expect e = parse_expect(tout);
    EXPECT_EQ(u(*p, "allocs"), e.allocs);
    EXPECT_EQ(u(*p, "frees"), e.frees);
  }
  unlink(rep.c_str());
}

TEST(Inject, CliTargetOutlivesTheTool) {
  MEMTRACE_REQUIRE_ROOT();
  cli_outlive(false);
}

TEST(Inject, CliTargetOutlivesSigkilledTool) {
  MEMTRACE_REQUIRE_ROOT();
  cli_outlive(true);
}

// A process that has the agent already (an earlier --inject ended): its
// constructor does not run again, its memtrace_agent_attach maps the new
// ring (issue 21, item 4): no fallback line, the rounds run after exact.
TEST(Inject, CliSecondInjectReattaches) {
  MEMTRACE_REQUIRE_ROOT();
  Child t = spawn({std::string(TARGET_DIR) + "/inject_target", "500", "again"});
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  ASSERT_EQ(pid, t.pid) << tout;
  ToolRun first = run_argv({MEMTRACE_BIN, "--inject", "-p", std::to_string(pid), "--duration", "1"});
  EXPECT_EQ(first.code, 0) << first.err;
  EXPECT_EQ(count_of(first.err, "uprobes instead"), 0u) << first.err;
  ASSERT_TRUE(read_until(t.out, "outliving", &tout, 20000)) << tout;
  expect_fallback_exact(t, pid, "");
}

namespace {

// The leak group of inject_target's leak_here, by its stack through main.
void expect_leak_through_main(const json& p, const Expect& e) {
  const json* leak = nullptr;
  for (const auto& l : p["leaks"])
    if (l["bytes"] == e.leaked_bytes && l["blocks"] == e.leaked_blocks) leak = &l;
  ASSERT_TRUE(leak) << p["leaks"].dump();
  ASSERT_GE((*leak)["stack"].size(), 3u) << leak->dump();
  EXPECT_EQ((*leak)["stack"][0]["function"], "leak_here") << leak->dump();
  EXPECT_EQ((*leak)["stack"][1]["function"], "one_round") << leak->dump();
  EXPECT_EQ((*leak)["stack"][2]["function"], "main") << leak->dump();
}

// Counts of a run of R rounds minus a run of R0, against the target's lines.


}  // namespace

// memtrace-bpf --inject -- PROG: stopped by BPF at its exec, run to its
// entry point under ptrace, the agent loaded there (libc relocated, none of
// the program's code run): a run of 2000 rounds minus one of 10 is exactly
// the target's difference; the leak's stack goes through main.
TEST(Inject, CliLaunchExact) {
  MEMTRACE_REQUIRE_ROOT();
  auto run = [](int rounds) {
    return run_tool({"--inject", "--", std::string(TARGET_DIR) + "/inject_target", std::to_string(rounds)});
  };
  ToolRun r0 = run(10), r = run(2000);
  ASSERT_EQ(r0.code, 0) << r0.err << r0.out;
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_EQ(count_of(r.err + r0.err, "uprobes instead"), 0u) << r.err;
  const json* p0 = find_comm(r0.report, "inject_target");
  const json* p = find_comm(r.report, "inject_target");
  ASSERT_TRUE(p && p0) << r.report.dump();
  Expect e0 = parse_expect(r0.out), e = parse_expect(r.out);
  ASSERT_GT(e.allocs, 0) << r.out;
  expect_rounds_exact(*p, *p0, e, e0);
  expect_leak_through_main(*p, e);
  expect_nothing_dropped(r.report);
  EXPECT_EQ((*p)["exit_code"], 0);
}

// A static program launched with --inject: one line, uprobes from its
// exec, exit 0 (its counts: CliFallsBackOnStaticProgram).
TEST(Inject, CliLaunchStaticFallsBack) {
  MEMTRACE_REQUIRE_ROOT();
  ToolRun r = run_tool({"--inject", "--", std::string(TARGET_DIR) + "/inject_target_static", "100", "stdin"});
  // stdin is closed: the target ends at once (exit 3), the tool with it.
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(count_of(r.err, "is traced with uprobes instead"), 1u) << r.err;
  EXPECT_NE(r.err.find("static program"), std::string::npos) << r.err;
  EXPECT_TRUE(find_comm(r.report, "inject_target_s")) << r.report.dump();
}

// --inject -c COMM: a process of that name running when the tool starts
// (injected as with -p) and two started later (at their exec, as a
// launched one): counts exact.
TEST(Inject, CliCommExact) {
  MEMTRACE_REQUIRE_ROOT();
  Child early = spawn({std::string(TARGET_DIR) + "/inject_target", "300"});
  close(early.in);
  std::string eout;
  ASSERT_GT(ready_pid(early, &eout), 0) << eout;
  std::string rep = tmpfile("comm");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-c", "inject_target"});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  ASSERT_TRUE(read_until(early.out, "expect", &eout)) << eout;
  ASSERT_TRUE(read_until(early.out, "\n", &eout)) << eout;
  EXPECT_EQ(exit_within(early.pid, 20000), 0) << eout;
  auto later = [](int rounds, std::string* out) {
    Child c = spawn({std::string(TARGET_DIR) + "/inject_target", std::to_string(rounds)});
    close(c.in);
    *out = read_all(c.out);
    EXPECT_EQ(exit_within(c.pid, 20000), 0) << *out;
    return c.pid;
  };
  std::string o0, o1;
  pid_t l0 = later(10, &o0), l1 = later(2000, &o1);
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  EXPECT_EQ(count_of(merr, "uprobes instead"), 0u) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* pe = find_proc(j, early.pid);
  const json* p0 = find_proc(j, l0);
  const json* p1 = find_proc(j, l1);
  ASSERT_TRUE(pe && p0 && p1) << j.dump() << merr;
  expect_report_exact(*pe, parse_expect(eout));
  expect_rounds_exact(*p1, *p0, parse_expect(o1), parse_expect(o0));
  expect_leak_through_main(*p1, parse_expect(o1));
  expect_nothing_dropped(j);
}

// A daemon over many short processes (issue 34's soak): each injected
// process that ends takes its session along, its copier thread and its
// ring's mapping; its counts stay in the report. Before, every ended
// process left both in the tool (bench/soak: 300 threads and 21 GB of
// rings in 3.5 minutes at 10 processes a second).
TEST(Inject, EndedProcessesLeaveNoSessionBehind) {
  MEMTRACE_REQUIRE_ROOT();
  const int kProcs = 12;
  std::string rep = tmpfile("ended");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-c", "inject_target"});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  auto threads_and_rings = [&](int* threads, int* rings) {
    *threads = 0;
    *rings = 0;
    std::string st = slurp_file("/proc/" + std::to_string(m.pid) + "/status");
    if (auto at = st.find("Threads:"); at != std::string::npos) *threads = atoi(st.c_str() + at + 8);
    std::string maps = slurp_file("/proc/" + std::to_string(m.pid) + "/maps");
    for (size_t at = 0; (at = maps.find("memtrace-inject", at)) != std::string::npos; at++) ++*rings;
  };
  int t0, r0;
  threads_and_rings(&t0, &r0);
  std::vector<pid_t> pids;
  for (int i = 0; i < kProcs; i++) {
    Child c = spawn({std::string(TARGET_DIR) + "/inject_target", "5"});
    close(c.in);
    std::string out = read_all(c.out);
    EXPECT_EQ(exit_within(c.pid, 20000), 0) << out;
    pids.push_back(c.pid);
  }
  // Their exits drained (the loop retires a session at its process's exit).
  int t1 = 0, r1 = 0;
  for (int i = 0; i < 50; i++) {
    threads_and_rings(&t1, &r1);
    if (r1 == r0 && t1 <= t0) break;
    usleep(100 * 1000);
  }
  EXPECT_EQ(r1, r0) << "ring mappings left in the tool after " << kProcs << " injected processes ended";
  EXPECT_LE(t1, t0) << "threads: " << t0 << " before, " << t1 << " after";
  kill(m.pid, SIGINT);
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  EXPECT_EQ(count_of(merr, "uprobes instead"), 0u) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  for (pid_t p : pids) EXPECT_TRUE(find_proc(j, p)) << p;
  EXPECT_EQ(j["stats"].value("inject_sessions_ended", 0), kProcs) << j["stats"].dump();
  expect_nothing_dropped(j);
}

// Counts equal to valgrind's memcheck on a program not written here:
// sqlite3 on the fixed script of Tracing.AgreesWithValgrindOnSqlite (the
// BPF path's), launched under --inject.
TEST(Inject, CliAgreesWithValgrindOnSqlite) {
  MEMTRACE_REQUIRE_ROOT();
  std::string sql, missing;
  ValgrindCounts v = sqlite_valgrind_counts(&sql, &missing);
  if (!missing.empty()) MEMTRACE_SKIP_OR_FAIL(missing);
  ASSERT_GT(v.allocs, 1000);
  std::string rep = tmpfile("sq");
  std::string err = tmpfile("sqerr");
  std::string cmd = std::string(MEMTRACE_BIN) + " --format json -o " + rep + " --inject -- /usr/bin/sqlite3 :memory: < " +
                    sql + " > /dev/null 2> " + err;
  ASSERT_EQ(system(cmd.c_str()), 0) << slurp_file(err);
  std::string merr = slurp_file(err);
  unlink(err.c_str());
  EXPECT_EQ(count_of(merr, "uprobes instead"), 0u) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* p = find_comm(j, "sqlite3");
  ASSERT_TRUE(p) << j.dump();
  EXPECT_EQ(counts_of(*p).str(), v.str());
  expect_nothing_dropped(j);
}

namespace {

// tests/targets/lock_storm.c's markers.
constexpr uint64_t kMarkStart = 0x5eed01, kMarkEnd = 0x5eed02;

struct Span {
  uint64_t allocs = 0, frees = 0, bytes = 0, in_use_blocks = 0, in_use_bytes = 0;
  static Span of(const heap::Process& p) {
    return {p.s.allocs, p.s.frees, p.s.bytes_allocated, p.s.in_use_blocks, p.s.in_use_bytes};
  }
};

// One attach to a running lock_storm (its threads inside malloc/free and
// dlopen/dlclose): injected, with the counts from its MARK_START
// allocation to MARK_END's free exact, or refused with the reason; either
// within 3 s (never the call's 10 s timeout: no deadlock).
void storm_attach(int i, int* injected, int* refused) {
  Child c = spawn({STORM_TARGET, STORM_LIB, "3", "300"});
  close(c.in);
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  usleep(2000 + 1500 * (i % 8));  // the storm under way, a different moment each time
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.stack_mode = MT_INJ_STACK_FP;
  auto t0 = std::chrono::steady_clock::now();
  auto s = inject::Session::start(pid, o);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 3000) << "attach " << i;
  if (!s) {
    EXPECT_NE(s.error().message.find("inside the dynamic loader or the allocator"), std::string::npos)
        << "attach " << i << ": " << s.error().message;
    std::cerr << "attach " << i << ": " << s.error().message << "\n";
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ++*refused;
    return;
  }
  ++*injected;
  if ((*s)->load_stats().caller != pid) std::cerr << "attach " << i << ": called on thread " << (*s)->load_stats().caller << "\n";
  heap::HeapModel model;
  Span before, after;
  bool in = false, done = false;
  uint64_t end_addr = 0;
  auto apply = [&](const void* d, size_t n) {
    const auto* e = static_cast<const mt_event*>(d);
    bool ev = n >= sizeof(mt_event);
    auto proc = [&]() -> const heap::Process& { return *model.processes().begin()->second; };
    if (ev && !in && e->h.kind == MT_EV_ALLOC && e->size == kMarkStart) {
      if (!model.processes().empty()) before = Span::of(proc());
      in = true;
    }
    model.apply(d, n);
    if (ev && in && !done && e->h.kind == MT_EV_ALLOC && e->size == kMarkEnd) end_addr = e->addr;
    if (ev && end_addr && !done && e->h.kind == MT_EV_FREE && e->addr == end_addr) {
      after = Span::of(proc());
      done = true;
    }
  };
  int code = -1;
  for (auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);;) {
    (*s)->drain(apply);
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    if (std::chrono::steady_clock::now() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      break;
    }
    usleep(2000);
  }
  (*s)->detach();
  (*s)->drain(apply);
  read_until(c.out, "expect", &out, 2000);
  out += read_all(c.out);
  ASSERT_EQ(code, 0) << "attach " << i << ": " << out;
  ASSERT_TRUE(done) << "attach " << i << ": no MARK_END free";
  Expect e = parse_expect(out);
  ASSERT_GT(e.allocs, 0) << out;
  EXPECT_EQ((*s)->ring().hdr().drops, 0u);
  EXPECT_EQ(static_cast<long>(after.allocs - before.allocs), e.allocs) << "attach " << i;
  EXPECT_EQ(static_cast<long>(after.frees - before.frees), e.frees) << "attach " << i;
  EXPECT_EQ(static_cast<long>(after.bytes - before.bytes), e.bytes) << "attach " << i;
  EXPECT_EQ(static_cast<long>(after.in_use_blocks - before.in_use_blocks), e.leaked_blocks) << "attach " << i;
  EXPECT_EQ(static_cast<long>(after.in_use_bytes - before.in_use_bytes), e.leaked_bytes) << "attach " << i;
}

}  // namespace

// Issue 21, item 8: the remote dlopen never waits for a lock that a stopped
// thread holds. lock_storm's threads are inside malloc/free and
// dlopen/dlclose most of the time, its main thread (the one that makes the
// call) too; 16 attaches in a row, each injected with exact counts or
// refused with the reason, each within 3 s; nearly all injected.
TEST(Inject, NoDeadlockAttachingInsideLoaderAndAllocator) {
  MEMTRACE_REQUIRE_ROOT();
  int injected = 0, refused = 0;
  for (int i = 0; i < 16; i++) storm_attach(i, &injected, &refused);
  std::cerr << "lock_storm: " << injected << " injected, " << refused << " refused\n";
  // Another thread makes the call when the main one stays busy: 64 of 64
  // injected in 4 runs here (10-15 of 16 with the main thread alone).
  EXPECT_GE(injected, 12);
}

// Issue 21, item 7: a launched program's allocations before its entry point
// (a library's constructor, run by ld.so) are recorded by uprobes until the
// agent takes over at the entry; blocks allocated before and freed after
// match: the whole run's counts exact, the leak's stack in the constructor.
TEST(Inject, CliLaunchSeesAllocationsBeforeTheEntryPoint) {
  MEMTRACE_REQUIRE_ROOT();
  ToolRun r = run_tool({"--inject", "--", CTOR_ALLOC, "1000"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_EQ(count_of(r.err, "uprobes instead"), 0u) << r.err;
  const json* p = find_comm(r.report, "ctor_alloc");
  ASSERT_TRUE(p) << r.report.dump();
  Expect e = parse_expect(r.out);
  ASSERT_EQ(e.allocs, 1006) << r.out;
  expect_report_exact(*p, e);
  expect_nothing_dropped(r.report);
  EXPECT_EQ(r.report["stats"]["frees_of_unseen_blocks"].get<long>(), 0) << r.report["stats"].dump();
  const json* leak = nullptr;
  for (const auto& l : (*p)["leaks"])
    if (l["blocks"] == 3 && l["bytes"] == 1200) leak = &l;
  ASSERT_TRUE(leak) << (*p)["leaks"].dump();
  ASSERT_GE((*leak)["stack"].size(), 1u) << leak->dump();
  EXPECT_EQ((*leak)["stack"][0]["function"], "ctor_alloc_init") << leak->dump();
}

// Issue 21, item 6: C++ aligned operator new (new, new[], nothrow) as the
// BPF path reports it: the size the program asked for (libstdc++ rounds it
// up before aligned_alloc: 1468 bytes a round instead of 1309), one
// allocation each; R rounds minus none exact.
TEST(Inject, CliCxxAlignedNewExact) {
  MEMTRACE_REQUIRE_ROOT();
  const long R = 200;
  ToolRun r0 = run_tool({"--inject", "--", CXX_NEW, "--rounds", "0"});
  ToolRun rn = run_tool({"--inject", "--", CXX_NEW, "--rounds", std::to_string(R)});
  ASSERT_EQ(r0.code, 0) << r0.err;
  ASSERT_EQ(rn.code, 0) << rn.err;
  EXPECT_EQ(count_of(r0.err + rn.err, "uprobes instead"), 0u) << rn.err;
  PerRound per = parse_per_round(rn.out);
  ASSERT_EQ(per.bytes, 1309) << rn.out;
  const json* p0 = find_comm(r0.report, "cxx_new");
  const json* pn = find_comm(rn.report, "cxx_new");
  ASSERT_TRUE(p0 && pn) << rn.report.dump();
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*pn, "frees") - u(*p0, "frees"), R * per.frees);
  EXPECT_EQ(u(*pn, "bytes_allocated") - u(*p0, "bytes_allocated"), R * per.bytes);
  EXPECT_EQ(u(*pn, "in_use_blocks") - u(*p0, "in_use_blocks"), R * per.leaked_blocks);
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * per.leaked_bytes);
  expect_nothing_dropped(rn.report);
}

// Both together on the whole run: libstdc++'s constructor allocates its
// emergency exception pool before the entry point (uprobes), the rounds'
// aligned new after it (the agent): valgrind's counts exactly.
TEST(Inject, CliCxxNewAgreesWithValgrind) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/usr/bin/valgrind", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("valgrind missing (scripts/deps.txt)");
  const long R = 200;
  ToolRun rn = run_tool({"--inject", "--", CXX_NEW, "--rounds", std::to_string(R)});
  ASSERT_EQ(rn.code, 0) << rn.err;
  EXPECT_EQ(count_of(rn.err, "uprobes instead"), 0u) << rn.err;
  const json* pn = find_comm(rn.report, "cxx_new");
  ASSERT_TRUE(pn) << rn.report.dump();
  ValgrindCounts v = valgrind_counts(std::string("valgrind --run-libc-freeres=no --run-cxx-freeres=no ") + CXX_NEW +
                                     " --rounds " + std::to_string(R) + " 2>&1 >/dev/null");
  ASSERT_GT(v.allocs, R);
  EXPECT_EQ(counts_of(*pn).str(), v.str());
  expect_nothing_dropped(rn.report);
}

// Issue 21, item 4, in this process: while one session records, a second
// is refused by the agent (another loader's ring stays its own); once the
// first has detached, a third re-attaches the agent and counts the rounds
// run after exactly.
TEST(Inject, ReattachRefusedWhileAnotherSessionRecords) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/inject_target", "300", "again"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.stack_mode = MT_INJ_STACK_FP;
  auto first = inject::Session::start(pid, o);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_FALSE((*first)->load_stats().reattached);
  ASSERT_TRUE(read_until(c.out, "outliving", &out)) << out;
  auto second = inject::Session::start(pid, o);
  ASSERT_FALSE(second);
  EXPECT_NE(second.error().message.find("another memtrace-bpf (pid " + std::to_string(getpid()) + ") records this process"),
            std::string::npos)
      << second.error().message;
  (*first)->detach();
  first->reset();
  Traced t;
  auto third = inject::Session::start(pid, o);
  ASSERT_TRUE(third) << third.error().message;
  EXPECT_TRUE((*third)->load_stats().reattached);
  EXPECT_EQ((*third)->ring().hdr().stack_used, uint32_t{MT_INJ_STACK_FP});
  ASSERT_EQ(write(c.in, "\n", 1), 1);
  close(c.in);
  for (auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);;) {
    (*third)->drain([&](const void* d, size_t n) { t.model.apply(d, n); });
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      t.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    ASSERT_LT(std::chrono::steady_clock::now(), end);
    usleep(2000);
  }
  (*third)->detach();
  (*third)->drain([&](const void* d, size_t n) { t.model.apply(d, n); });
  t.drops = (*third)->ring().hdr().drops;
  t.out = out + read_all(c.out);
  ASSERT_EQ(t.code, 0) << t.out;
  // The second expect line (the rounds after the re-attach) is the first's.
  expect_exact(t, pid);
}
