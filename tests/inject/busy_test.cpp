// The injector's deadlock-window check (issue 21, src/inject/busy_frames.h):
// a thread is refused as the dlopen's caller only when one of its LIVE
// frames (pc, return addresses found by a CFI unwind, the context a signal
// interrupted) lies in the loader or the allocator; stale return addresses
// in unused stack slots do not count. tests/inject/busy_target.c puts its
// threads where each test wants them and knows what must be counted after.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "heap/heap_model.h"
#include "inject/session.h"
#include "test_env.h"
#include "../loader/harness.h"

using namespace memtrace;
using namespace memtrace::testing;

namespace {

struct Expect {
  long allocs = -1, frees = -1, bytes = -1;
};

pid_t ready_pid(Child& c, std::string* acc) {
  if (!read_until(c.out, "ready ", acc) || !read_until(c.out, "\n", acc)) return -1;
  return static_cast<pid_t>(atoi(acc->c_str() + acc->find("ready ") + 6));
}

// Until pid's main thread waits in read(0, ...) (/proc/PID/syscall: "0 0x0 ..."),
// where each target waits for its line: past the allocation a first fgets
// makes, inside malloc_info for inmalloc/insignal.
bool wait_in_read(pid_t pid) {
  for (int i = 0; i < 5000; i++) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/syscall");
    std::string nr, fd;
    if (f >> nr >> fd && nr == "0" && fd == "0x0") return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void say(Child& c, const char* line = "go\n") { ASSERT_EQ(write(c.in, line, strlen(line)), ssize_t(strlen(line))); }

inject::SessionOptions options() {
  inject::SessionOptions o;
  o.agent = AGENT;
  o.ring_mb = 16;
  o.timeout_ms = 5000;
  return o;
}

// After "go": the session drained into a model until the target exits;
// its counts are the expect line's, exactly.
void expect_counts_exact(Child& c, inject::Session& s, std::string* out) {
  heap::HeapModel model;
  auto apply = [&](const void* d, size_t n) { model.apply(d, n); };
  int code = -1;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    s.drain(apply);
    int st = 0;
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (code < 0) kill(c.pid, SIGKILL);
  s.detach();
  s.drain(apply, SIZE_MAX, true);
  read_until(c.out, "expect", out, 2000);
  *out += read_all(c.out);
  ASSERT_EQ(code, 0) << *out;
  Expect e;
  auto at = out->find("expect ");
  ASSERT_NE(at, std::string::npos) << *out;
  sscanf(out->c_str() + at, "expect allocs=%ld frees=%ld bytes=%ld", &e.allocs, &e.frees, &e.bytes);
  ASSERT_EQ(model.processes().size(), 1u);
  const heap::Process& p = *model.processes().begin()->second;
  EXPECT_EQ(s.ring().hdr().drops, 0u);
  EXPECT_EQ(model.malformed_records(), 0u);
  EXPECT_EQ(static_cast<long>(p.s.allocs), e.allocs) << *out;
  EXPECT_EQ(static_cast<long>(p.s.frees), e.frees) << *out;
  EXPECT_EQ(static_cast<long>(p.s.bytes_allocated), e.bytes) << *out;
  EXPECT_EQ(p.s.in_use_blocks, 0u);
  EXPECT_EQ(p.s.unknown_frees, 0u);
}

// A target whose main thread is inside malloc_info (the main arena locked),
// directly (inmalloc) or under a signal handler (insignal): every attach
// is refused while it is there, naming the frame; once it has left, the
// next attach is injected at once and counts exactly.
void refused_while_inside(const char* mode, const std::string& found) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/busy_target", mode, "3000"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  ASSERT_TRUE(wait_in_read(pid)) << "not in malloc_info's write";
  for (int i = 0; i < 2; i++) {
    auto s = inject::Session::start(pid, options());
    ASSERT_FALSE(s) << "injected while inside malloc_info";
    const std::string& why = s.error().message;
    EXPECT_NE(why.find("inside the dynamic loader or the allocator"), std::string::npos) << why;
    EXPECT_NE(why.find(found), std::string::npos) << why;
    if (found.find("stack scanned") == std::string::npos) {
      EXPECT_EQ(why.find("stack scanned"), std::string::npos) << why;  // the unwind went all the way
    }
    EXPECT_NE(why.find("return address in libc.so.6+"), std::string::npos) << why;
    EXPECT_FALSE(inject::agent_mapped(pid)) << why;
  }
  say(c);  // out of malloc_info
  ASSERT_TRUE(read_until(c.out, "free ", &out)) << out;
  auto s = inject::Session::start(pid, options());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ((*s)->load_stats().caller, pid);
  EXPECT_EQ((*s)->load_stats().busy_retries, 0u);
  say(c);
  expect_counts_exact(c, **s, &out);
}

}  // namespace

// Stale return addresses into ld.so (its relocation's call of an IFUNC
// resolver) and into dl_iterate_phdr (its call of the callback), kept in an
// unused slot of main's live frame: the main thread is the caller on the
// first stop, no scan needed. The raw scan of the stack words before this
// check refused it at every stop (40 of the main thread's, then it had no
// other thread: "return address in ld-linux-x86-64.so.2+0x...").
TEST(InjectBusy, StaleReturnAddressesInALiveFrameAreNotFrames) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/busy_target", "stale", "3000"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  ASSERT_NE(out.find("stale 2"), std::string::npos) << out;
  ASSERT_TRUE(wait_in_read(pid));
  auto s = inject::Session::start(pid, options());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ((*s)->load_stats().caller, pid);
  EXPECT_EQ((*s)->load_stats().busy_retries, 0u);
  EXPECT_EQ((*s)->load_stats().stack_scans, 0u);
  say(c);
  expect_counts_exact(c, **s, &out);
}

TEST(InjectBusy, ThreadInsideMallocIsRefused) {
  refused_while_inside("inmalloc", "return address in libc.so.6+");
}

// The handler's frames, then the signal frame's saved context: the
// interrupted code's callers up to malloc_info.
TEST(InjectBusy, ThreadInsideMallocUnderASignalHandlerIsRefused) {
  refused_while_inside("insignal", "past a signal frame");
}

// The thread waits in code without CFI (an anonymous executable page):
// the unwind stops at its first frame, the rest of the stack is scanned as
// before, and the scan finds malloc_info's return address: still refused,
// the reason saying how it was found.
TEST(InjectBusy, ThreadInsideMallocBelowCodeWithoutCfiIsRefusedByTheScan) {
  refused_while_inside("injit", "stack scanned from frame 0: no CFI for pc in an anonymous mapping");
}

// mt_stress's shape (bench/inject/mt_stress.c: before this check it was
// never injected): 4 threads that have used malloc wait, the main thread
// in fgets is the caller on its first stop; 4 x 20000 rounds exact.
TEST(InjectBusy, MultiThreadedStressInjectedAtOnce) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/busy_target", "mt", "4", "20000"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  ASSERT_TRUE(wait_in_read(pid));
  auto s = inject::Session::start(pid, options());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ((*s)->load_stats().caller, pid);
  EXPECT_EQ((*s)->load_stats().busy_retries, 0u);
  say(c);
  expect_counts_exact(c, **s, &out);
}

// bench/inject/mt_stress.c itself: its main thread waits in fgets before
// any thread starts, main's frame holds 2 KiB of thread ids never written
// (what ld.so's start-up left there: "return address in
// ld-linux-x86-64.so.2+0x8cf4" to the raw scan, which refused it at every
// attach). Injected on its main thread at the first stop; the workers'
// 4 x 20000 mallocs and frees exact (each thread's one allocation of
// glibc's own, its TLS vector, stays in use: counted apart).
TEST(InjectBusy, MtStressInjectedOnItsMainThread) {
  MEMTRACE_REQUIRE_ROOT();
  Child c = spawn({std::string(TARGET_DIR) + "/mt_stress", "--wait", "4", "20000"});
  std::string out;
  pid_t pid = ready_pid(c, &out);
  ASSERT_EQ(pid, c.pid) << out;
  ASSERT_TRUE(wait_in_read(pid));
  auto s = inject::Session::start(pid, options());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ((*s)->load_stats().caller, pid);
  EXPECT_EQ((*s)->load_stats().busy_retries, 0u);
  EXPECT_EQ((*s)->load_stats().stack_scans, 0u);
  say(c);
  heap::HeapModel model;
  auto apply = [&](const void* d, size_t n) { model.apply(d, n); };
  int code = -1;
  for (int i = 0; i < 30000 && code < 0; i++) {
    (*s)->drain(apply);
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    else std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (code < 0) kill(pid, SIGKILL);
  (*s)->detach();
  (*s)->drain(apply, SIZE_MAX, true);
  ASSERT_EQ(code, 0);
  ASSERT_EQ(model.processes().size(), 1u);
  const heap::Process& p = *model.processes().begin()->second;
  EXPECT_EQ((*s)->ring().hdr().drops, 0u);
  EXPECT_EQ(p.s.frees, 80000u);
  EXPECT_EQ(p.s.allocs - p.s.in_use_blocks, 80000u);
  EXPECT_LE(p.s.in_use_blocks, 4u);
}
