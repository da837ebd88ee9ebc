// --inject's entry trampolines (issue 21, item 11): the relocation of the
// allocator's first instructions, calls that bypass the GOT, the entries put
// back at a clean end, in a fork's child and by the BPF path after a killed
// session. Split from inject_test.cpp (the same targets; helpers in
// inject_util.h).
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

// Issue 21, item 11: the entry trampolines' relocation (trampoline.h), on
// instructions as glibc 2.36's allocator starts: rip-relative operands and
// branches out of the prologue re-encoded for the stub, a stub that jumps
// back after them; a branch into the replaced bytes or a function that ends
// before them refused with the instruction named.
TEST(Inject, RelocatesPrologues) {
  const uint64_t fn = 0x7f0000098930, stub = 0x7f0000010000;
  auto i32 = [](const std::vector<uint8_t>& c, size_t at) {
    int32_t v;
    memcpy(&v, c.data() + at, 4);
    return int64_t{v};
  };
  // posix_memalign: cmpb $0x0, 0x140201(%rip); push %r12; ...
  std::vector<uint8_t> pm = {0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54, 0x49, 0x89, 0xd4, 0xc3};
  pm.resize(64, 0x90);
  auto r = inject::relocate_prologue(pm, 13, fn, stub, 5);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->len, 7u);
  ASSERT_EQ(r->code.size(), 7u + 5u);
  EXPECT_EQ(stub + 7 + i32(r->code, 2), fn + 7 + 0x140201);  // the same byte
  EXPECT_EQ(r->code[7], 0xe9);
  EXPECT_EQ(stub + 12 + i32(r->code, 8), fn + 7);  // back after it
  // free: test %rdi,%rdi; je +0xc8 (rel32): the je re-encoded.
  std::vector<uint8_t> fr = {0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55, 0xc3};
  fr.resize(256, 0x90);
  r = inject::relocate_prologue(fr, 256, fn, stub, 5);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->len, 9u);
  EXPECT_EQ(r->code[3], 0x0f);
  EXPECT_EQ(r->code[4], 0x84);
  EXPECT_EQ(stub + 9 + i32(r->code, 5), fn + 0xc8);
  // A short je out of the prologue is widened to rel32.
  std::vector<uint8_t> sj = {0x48, 0x85, 0xff, 0x74, 0x10, 0x55, 0xc3};
  sj.resize(64, 0x90);
  r = inject::relocate_prologue(sj, 64, fn, stub, 5);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->len, 5u);
  EXPECT_EQ(r->code.size(), 3u + 6u + 5u);
  EXPECT_EQ(stub + 9 + i32(r->code, 5), fn + 5 + 0x10);
  // A branch into the replaced bytes: from the prologue, from the body.
  std::vector<uint8_t> in = {0x48, 0x85, 0xff, 0x74, 0xfd, 0x55, 0xc3};  // je +2
  in.resize(64, 0x90);
  r = inject::relocate_prologue(in, 7, fn, stub, 5);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("inside them"), std::string::npos) << r.error().message;
  std::vector<uint8_t> loop = {0x41, 0x54, 0x55, 0x53, 0x48, 0x89, 0xfb, 0x90, 0xeb, 0xf8, 0xc3};  // jmp +2 at +8
  loop.resize(64, 0x90);
  r = inject::relocate_prologue(loop, 11, fn, stub, 5);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("branches into its first 7 bytes"), std::string::npos) << r.error().message;
  // Other code of the object branching in (incoming offsets).
  r = inject::relocate_prologue(pm, 13, fn, stub, 5, {3});
  ASSERT_FALSE(r);
  // Too short: a ret before 5 bytes.
  std::vector<uint8_t> tiny = {0x31, 0xc0, 0xc3};
  tiny.resize(64, 0xcc);
  r = inject::relocate_prologue(tiny, 3, fn, stub, 5);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("ret"), std::string::npos) << r.error().message;
}

#if defined(__x86_64__)
namespace {

// dlsym_target's blocks (333 and 444 bytes) as a session with and without
// the entry trampolines sees them.
struct DlsymSeen {
  long m333 = 0, c444 = 0, freed444 = 0;
  uint32_t patched = 0;
  std::vector<std::string> refused;
};

DlsymSeen dlsym_run(bool entries, int n) {
  DlsymSeen seen;
  Child c = spawn({std::string(TARGET_DIR) + "/dlsym_target", std::to_string(n)});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  EXPECT_EQ(pid, c.pid) << out;
  if (pid != c.pid) return seen;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.stack_mode = MT_INJ_STACK_FP;
  o.entries = entries;
  auto s = inject::Session::start(pid, o);
  EXPECT_TRUE(s) << s.error().message;
  if (!s) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return seen;
  }
  seen.patched = (*s)->patch_report().patched;
  seen.refused = (*s)->patch_report().refused;
  std::set<uint64_t> c444;
  auto apply = [&](const void* d, size_t len) {
    if (len < sizeof(mt_event)) return;
    const auto* e = static_cast<const mt_event*>(d);
    if (e->h.kind == MT_EV_ALLOC && e->size == 333 && e->role == MT_ROLE_MALLOC) seen.m333++;
    if (e->h.kind == MT_EV_ALLOC && e->size == 444 && e->role == MT_ROLE_CALLOC) {
      seen.c444++;
      c444.insert(e->addr);
    }
    if (e->h.kind == MT_EV_FREE && c444.erase(e->addr)) seen.freed444++;
  };
  EXPECT_EQ(write(c.in, "\n", 1), 1);
  EXPECT_TRUE(read_until(c.out, "done", &out)) << out;
  close(c.in);
  EXPECT_EQ(exit_within(pid, 10000), 0);
  (*s)->detach();
  (*s)->drain(apply, SIZE_MAX, true);
  EXPECT_EQ((*s)->ring().hdr().drops, 0u);
  return seen;
}

}  // namespace

// Issue 21, item 11: calls through a pointer dlsym returned (libc's malloc,
// calloc and free themselves, no GOT slot) reach the hooks through the
// patched entries, each once; without the trampolines none is seen.
TEST(Inject, DlsymPointerCallsAreSeen) {
  MEMTRACE_REQUIRE_ROOT();
  const int N = 500;
  DlsymSeen with = dlsym_run(true, N);
  EXPECT_TRUE(with.refused.empty()) << with.refused.front();
  EXPECT_GE(with.patched, 9u);
  EXPECT_EQ(with.m333, N);
  EXPECT_EQ(with.c444, N);
  EXPECT_EQ(with.freed444, N);
  DlsymSeen without = dlsym_run(false, N);
  EXPECT_EQ(without.patched, 0u);
  EXPECT_EQ(without.m333, 0);
  EXPECT_EQ(without.c444, 0);
}

// Issue 21, item 11: the entries a session patched are as they were once
// it ends cleanly (a later uprobe finds libc's own bytes), and a second
// session patches them again; while a session records, they differ.
TEST(Inject, CleanEndPutsEntriesBackAndReattachPatchesAgain) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/dlsym_target", "10"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  int mem = open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(mem, 0);
  auto entry_bytes = [&](uint64_t fn) {
    std::string b(16, '\0');
    EXPECT_EQ(pread(mem, b.data(), b.size(), static_cast<off_t>(fn)), 16);
    return b;
  };
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.stack_mode = MT_INJ_STACK_FP;
  std::string patched0, after0;
  for (int round = 0; round < 2; round++) {
    auto s = inject::Session::start(pid, o);
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_GE((*s)->patch_report().patched, 9u) << "round " << round;
    EXPECT_EQ((*s)->patch_report().already, 0u) << "round " << round;
    const auto& e0 = const_cast<const mt_inj_hdr&>((*s)->ring().hdr()).entries[0];
    ASSERT_EQ(std::string(e0.name), "malloc");
    uint64_t fn = e0.fn;
    std::string patched = entry_bytes(fn);
    (*s)->detach();
    std::string after = entry_bytes(fn);
    EXPECT_NE(patched, after) << "round " << round;
    if (round == 0) {
      patched0 = patched;
      after0 = after;
      // libc's own bytes: this process's malloc, the same file.
      void* mine = dlsym(RTLD_DEFAULT, "malloc");
      ASSERT_TRUE(mine);
      EXPECT_EQ(after, std::string(static_cast<const char*>(mine), 16));
    } else {
      EXPECT_EQ(patched, patched0);  // the same stubs and islands again
      EXPECT_EQ(after, after0);
    }
  }
  close(mem);
  EXPECT_EQ(write(c.in, "\n", 1), 1);
  close(c.in);
  EXPECT_EQ(exit_within(pid, 10000), 0);
}

// An entry found as the file has it already (a restore that ended between
// two entries, or another tool's) counts as put back: the agent's pointer
// to it is reset and it is listed as not patched; a second end finds
// nothing to do. Before, it stayed listed: "N of them still patched" and
// an inject_leftovers_unrestored at every later BPF attach.
TEST(Inject, EndCountsAnEntryPutBackAlready) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/dlsym_target", "10"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.stack_mode = MT_INJ_STACK_FP;
  auto s = inject::Session::start(pid, o);
  ASSERT_TRUE(s) << s.error().message;
  uint32_t patched = (*s)->patch_report().patched;
  ASSERT_GE(patched, 9u);
  mt_inj_hdr* h = (*s)->ring().mutable_hdr();
  const auto& e0 = h->entries[0];
  ASSERT_EQ(std::string(e0.name), "malloc");
  int mem = open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(mem, 0);
  uint8_t orig[65] = {0};  // the file's bytes (32), their count, the patched bytes (ring.h orig_slot)
  ASSERT_EQ(pread(mem, orig, sizeof orig, static_cast<off_t>(e0.orig_slot)), 65);
  size_t n = orig[32];
  ASSERT_GE(n, 5u);
  ASSERT_EQ(pwrite(mem, orig, n, static_cast<off_t>(e0.fn)), static_cast<ssize_t>(n));  // put back by someone else
  auto r = inject::end_in_target(pid, h);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(*r, patched);
  for (uint32_t i = 0; i < h->entry_count && i < MT_INJ_ENTRY_MAX; i++) EXPECT_EQ(h->entries[i].stub, 0u) << h->entries[i].name;
  uint64_t real = 0;
  ASSERT_EQ(pread(mem, &real, 8, static_cast<off_t>(e0.real_slot)), 8);
  EXPECT_EQ(real, e0.fn);
  std::string now(16, '\0');
  ASSERT_EQ(pread(mem, now.data(), now.size(), static_cast<off_t>(e0.fn)), 16);
  void* mine = dlsym(RTLD_DEFAULT, "malloc");  // libc's own bytes: this process's malloc, the same file
  ASSERT_TRUE(mine);
  EXPECT_EQ(now, std::string(static_cast<const char*>(mine), 16));
  auto again = inject::end_in_target(pid, h);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(*again, 0u);
  close(mem);
  (*s)->detach();
  EXPECT_EQ(write(c.in, "\n", 1), 1);
  close(c.in);
  EXPECT_EQ(exit_within(pid, 10000), 0);
}

// Issue 21, item 11: tests/targets/dlopen_alloc dlopen's a library whose
// constructor allocates (inside dlopen, before any GOT of it is hooked),
// ld.so allocates its link map through its own pointer to malloc, and the
// program then allocates through the pointer dlsym returned: under
// --inject the whole run's counts are memcheck's (were 0 of its 11 with
// the GOT slots alone). Frame-pointer stacks: with libunwind the agent's
// own dlopen of libunwind.so.8 makes ld.so grow its _dl_find_object table
// (malloc(2304)) at the attach, which the program's dlopen then does not
// (15 allocations where memcheck sees 16).
TEST(Inject, CliDlopenAllocAgreesWithValgrind) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/usr/bin/valgrind", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("valgrind missing (scripts/deps.txt)");
  ToolRun r = run_tool({"--inject", "--unwind", "fp", "--", DLOPEN_ALLOC, CTOR_ALLOC_LIB, "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "uprobes instead"), 0u) << r.err;
  EXPECT_EQ(count_of(r.err, "not patched"), 0u) << r.err;
  const json* p = find_comm(r.report, "dlopen_alloc");
  ASSERT_TRUE(p) << r.report.dump();
  ValgrindCounts v = valgrind_counts(std::string("valgrind --run-libc-freeres=no ") + DLOPEN_ALLOC + " " +
                                     CTOR_ALLOC_LIB + " 3 2>&1 >/dev/null");
  ASSERT_GE(v.allocs, 9);
  EXPECT_EQ(counts_of(*p).str(), v.str());
  expect_nothing_dropped(r.report);
}

// A fork's child of a process whose entries are patched: the agent's
// atfork handler puts them back in the child (keeping the int3 of the
// uprobes the tool put there while the child was stopped at its fork), so
// the BPF path traces the child: every child runs, allocates and frees,
// and is counted.
TEST(Inject, CliForkedChildrenOfAPatchedProcess) {
  MEMTRACE_REQUIRE_ROOT();
  const int N = 30;
  ToolRun r = run_tool({"--inject", "--", FORK_STORM, std::to_string(N)});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("forks " + std::to_string(N)), std::string::npos) << r.out;
  EXPECT_EQ(count_of(r.err, "not patched"), 0u) << r.err;
  int children = 0;
  for (const auto& p : r.report["processes"])
    if (p["comm"] == "fork_storm" && p["summary"]["allocs"].get<long>() >= 1 && p["summary"]["frees"].get<long>() >= 1)
      children++;
  EXPECT_GE(children, N) << r.report.dump();
  expect_nothing_dropped(r.report);
}

// A tool killed while its entries were patched leaves them (the hooks call
// the originals through the stubs, whose copies of the probed instructions
// a uprobe never sees: the BPF path counted 0 of the 2131 allocations here).
// The BPF path attached after it puts them back first, as a clean detach
// would (inject::restore_left_patched), and says so; the hooks call the
// originals themselves from then on: its counts of the second rounds are
// exact, and the target exits 0.
// by_comm: the BPF path finds it with -c (a copy of the target under a name
// of its own: other tests' inject_target processes are not taken).
// zombie_tool: the killed tool not reaped until the BPF path has attached
// (its pid still answers kill(pid, 0), its heartbeat is fresh): dead all
// the same, its entries are put back.
static void bpf_path_after_killed_inject(bool traced_already, bool by_comm = false, bool zombie_tool = false) {
  std::string target = std::string(TARGET_DIR) + "/inject_target", comm;
  if (by_comm) {
    comm = "ij_left_" + std::to_string(getpid());
    std::string copy = "/tmp/" + comm;
    ASSERT_EQ(system(("cp " + target + " " + copy).c_str()), 0);
    target = copy;
  }
  Child t = spawn({target, "300", "again"});
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  if (by_comm) unlink(target.c_str());
  ASSERT_EQ(pid, t.pid) << tout;
  Child first = spawn({MEMTRACE_BIN, "--inject", "-p", std::to_string(pid), "-o", "/dev/null"});
  close(first.in);
  std::string ferr;
  ASSERT_TRUE(read_until(first.err, "tracing", &ferr)) << ferr;
  EXPECT_EQ(count_of(ferr, "not patched"), 0u) << ferr;
  ASSERT_TRUE(read_until(t.out, "expect", &tout, 20000)) << tout;
  kill(first.pid, SIGKILL);
  if (zombie_tool) {
    siginfo_t si{};
    ASSERT_EQ(waitid(P_PID, first.pid, &si, WEXITED | WNOWAIT), 0) << strerror(errno);  // a zombie now
  } else {
    waitpid(first.pid, nullptr, 0);
  }
  ASSERT_TRUE(read_until(t.out, "outliving", &tout, 20000)) << tout;
  if (traced_already) {
    ASSERT_EQ(ptrace(PTRACE_SEIZE, pid, nullptr, nullptr), 0) << strerror(errno);
  }
  std::string rep = tmpfile("bpfafter");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, by_comm ? "-c" : "-p", by_comm ? comm : std::to_string(pid)});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  if (zombie_tool) waitpid(first.pid, nullptr, 0);
  if (traced_already) {  // let go (interrupted first: a running tracee cannot be detached)
    EXPECT_EQ(ptrace(PTRACE_INTERRUPT, pid, nullptr, nullptr), 0) << strerror(errno);
    int st = 0;
    EXPECT_EQ(waitpid(pid, &st, __WALL), pid) << strerror(errno);
    EXPECT_EQ(ptrace(PTRACE_DETACH, pid, nullptr, nullptr), 0) << strerror(errno);
  }
  std::string restored = "pid " + std::to_string(pid) + ": restored ";
  std::string incomplete = "its counts will be incomplete";
  if (!traced_already) {
    EXPECT_EQ(count_of(merr, restored), 1u) << merr;
    EXPECT_NE(merr.find(" allocator entries left patched by an earlier --inject session"), std::string::npos) << merr;
    EXPECT_EQ(count_of(merr, incomplete), 0u) << merr;
  } else {
    EXPECT_EQ(count_of(merr, restored), 0u) << merr;
    EXPECT_EQ(count_of(merr, incomplete), 1u) << merr;
    EXPECT_NE(merr.find("Operation not permitted"), std::string::npos) << merr;
  }
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  close(t.in);
  std::string second;
  ASSERT_TRUE(read_until(t.out, "expect", &second)) << second;
  ASSERT_TRUE(read_until(t.out, "\n", &second)) << second;
  EXPECT_EQ(exit_within(t.pid, 20000), 0) << tout << second;
  if (by_comm) {  // -c waits for more processes of that name
    usleep(300 * 1000);
    kill(m.pid, SIGINT);
  }
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* p = find_proc(j, pid);
  ASSERT_TRUE(p) << j.dump() << merr;
  EXPECT_EQ((*p)["exit_code"], 0);
  EXPECT_EQ(j["stats"]["inject_leftovers_restored"], traced_already ? 0 : 1) << j["stats"].dump();
  EXPECT_EQ(j["dropped"]["inject_leftovers_unrestored"], traced_already ? 1 : 0) << j["dropped"].dump();
  Expect e = parse_expect(second);
  if (!traced_already) {
    expect_report_exact(*p, e);
  } else {
    EXPECT_LT(u(*p, "allocs"), e.allocs) << second;  // said: the calls through the hooks pass the uprobes
  }
}

TEST(Inject, BpfPathAfterAKilledInjectSession) {
  MEMTRACE_REQUIRE_ROOT();
  bpf_path_after_killed_inject(false);
}

// The same, the process found by -c at the start.
TEST(Inject, BpfPathByCommAfterAKilledInjectSession) {
  MEMTRACE_REQUIRE_ROOT();
  bpf_path_after_killed_inject(false, true);
}

// The same, the killed tool a zombie still (not reaped by its parent):
// before, its pid answering kill(pid, 0) made it a live session's, its
// entries left patched ("records this process") and the counts incomplete.
TEST(Inject, BpfPathRestoresAfterAZombieInjectTool) {
  MEMTRACE_REQUIRE_ROOT();
  bpf_path_after_killed_inject(false, false, true);
}

// The same, the entries cannot be put back (ptrace refused: this test
// traces the process): one line says so and that the counts will be
// incomplete, DROPPED's inject_leftovers_unrestored counts the process,
// and the process runs on (its hooks call through the stubs).
TEST(Inject, BpfPathSaysWhenItCannotRestore) {
  MEMTRACE_REQUIRE_ROOT();
  bpf_path_after_killed_inject(true);
}
#endif
