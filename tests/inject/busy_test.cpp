// The injector's deadlock-window check (issue 21, src/inject/busy_frames.h):
// a thread is refused as the dlopen's caller only when one of its LIVE
// frames (pc, return addresses found by a CFI unwind, the context a signal
// interrupted) lies in the loader or the allocator; stale return addresses
// in unused stack slots do not count. tests/inject/busy_target.c puts its
// threads where each test wants them and knows what must be counted after.
#include <dirent.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "heap/heap_model.h"
#include "inject/injector.h"
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

// Stopping every thread of a process (inject::with_threads_stopped, the
// patch and the BPF path's restore of a killed session's entries).

namespace {

// A child of this test whose main thread waits in vfork until its vfork
// child ends, ms later: state D, which no PTRACE_INTERRUPT stops.
pid_t fork_in_vfork(int ms) {
  pid_t pid = fork();
  if (pid == 0) {
    pid_t v = vfork();
    if (v == 0) {
      usleep(static_cast<useconds_t>(ms) * 1000);
      _exit(0);
    }
    waitpid(v, nullptr, 0);
    for (;;) pause();
  }
  return pid;
}

// The threads of pid.
std::vector<pid_t> tasks_of(pid_t pid) {
  std::vector<pid_t> out;
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  if (DIR* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d))
      if (e->d_name[0] >= '0' && e->d_name[0] <= '9') out.push_back(atoi(e->d_name));
    closedir(d);
  }
  return out;
}

// A child with n threads besides its main one, all in pause(); its pid once
// all n + 1 run (-1 if they did not within 5 s).
pid_t fork_with_threads(int n) {
  pid_t pid = fork();
  if (pid == 0) {
    for (int i = 0; i < n; i++) {
      pthread_t t;
      pthread_create(&t, nullptr, [](void*) -> void* {
        for (;;) pause();
      }, nullptr);
    }
    for (;;) pause();
  }
  for (int i = 0; i < 5000 && tasks_of(pid).size() < static_cast<size_t>(n + 1); i++)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return tasks_of(pid).size() == static_cast<size_t>(n + 1) ? pid : -1;
}

char state_of(pid_t pid, pid_t tid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(f, line);
  auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() ? line[close + 2] : '?';
}

bool wait_state(pid_t pid, char want, int ms = 5000) {
  for (int i = 0; i < ms; i++) {
    if (state_of(pid, pid) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// How many of pid's threads a tracer holds (/proc/PID/task/TID/status).
int traced_threads(pid_t pid) {
  int n = 0;
  for (pid_t tid : tasks_of(pid)) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("TracerPid:", 0) == 0) n += atoi(line.c_str() + 10) != 0;
  }
  return n;
}

void end_child(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace

// A thread that does not stop (state D: waiting in vfork) fails the stop
// after the limit, naming it, with nothing run and every other thread let
// go: the waitpid with no limit kept them stopped and the tool's event
// loop blocked for as long as it stayed there. It is let go once its stop
// has come (inject::release_late_threads, or the next stop); the next stop
// succeeds.
TEST(InjectBusy, AThreadThatDoesNotStopFailsTheStopInTime) {
  MEMTRACE_REQUIRE_ROOT();
  pid_t pid = fork_in_vfork(1500);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_state(pid, 'D')) << state_of(pid, pid);
  int ran = 0;
  size_t seen = 0;
  auto fn = [&](const std::vector<pid_t>& tids) -> Result<void> {
    ran++;
    seen = tids.size();
    return {};
  };
  auto t0 = std::chrono::steady_clock::now();
  auto r = inject::with_threads_stopped(pid, nullptr, fn, {300, 100});
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r);
  EXPECT_EQ(ran, 0);
  EXPECT_NE(r.error().message.find("thread " + std::to_string(pid) + " did not stop within 300 ms (state D)"),
            std::string::npos)
      << r.error().message;
  EXPECT_LT(ms, 1000);
  // Its interrupt stop once the vfork child has ended: let go then.
  ASSERT_TRUE(wait_state(pid, 't')) << state_of(pid, pid);
  EXPECT_EQ(traced_threads(pid), 1);
  inject::release_late_threads();
  EXPECT_EQ(traced_threads(pid), 0);
  EXPECT_TRUE(wait_state(pid, 'S')) << state_of(pid, pid);
  r = inject::with_threads_stopped(pid, nullptr, fn);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(seen, 1u);
  EXPECT_EQ(traced_threads(pid), 0);
  EXPECT_TRUE(wait_state(pid, 'S')) << state_of(pid, pid);  // runs on (in pause)
  end_child(pid);
}

// The last listing of the threads must find none new (a thread started
// after it would run while the entries are written): with one listing
// allowed, a process with threads fails, every thread let go; with two it
// succeeds. Before, the 100th listing's new threads were ignored.
TEST(InjectBusy, StopFailsWhenTheLastListingStillFindsNewThreads) {
  MEMTRACE_REQUIRE_ROOT();
  pid_t pid = fork_with_threads(2);
  ASSERT_GT(pid, 0);
  int ran = 0;
  size_t seen = 0;
  auto fn = [&](const std::vector<pid_t>& tids) -> Result<void> {
    ran++;
    seen = tids.size();
    return {};
  };
  auto r = inject::with_threads_stopped(pid, nullptr, fn, {2000, 1});
  ASSERT_FALSE(r);
  EXPECT_EQ(ran, 0);
  EXPECT_NE(r.error().message.find("new threads still started after 1 listings"), std::string::npos)
      << r.error().message;
  EXPECT_EQ(traced_threads(pid), 0);
  r = inject::with_threads_stopped(pid, nullptr, fn, {2000, 2});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(seen, 3u);
  EXPECT_EQ(traced_threads(pid), 0);
  end_child(pid);
}

// A signal handler without SA_RESTART (the loader's SIGINT and SIGCHLD)
// firing all through the stops: every stop succeeds, every thread is let
// go. Before, a waitpid interrupted (EINTR) left its thread seized and
// stopped until the tool exited.
TEST(InjectBusy, SignalsDuringTheStopLeaveNoThreadStopped) {
  MEMTRACE_REQUIRE_ROOT();
  pid_t pid = fork_with_threads(8);
  ASSERT_GT(pid, 0);
  struct sigaction sa {}, old {};
  sa.sa_handler = [](int) {};
  sa.sa_flags = 0;  // no SA_RESTART
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGALRM, &sa, &old), 0);
  itimerval every{{0, 100}, {0, 100}}, off{};
  ASSERT_EQ(setitimer(ITIMER_REAL, &every, nullptr), 0);
  int ok = 0;
  for (int i = 0; i < 50; i++) {
    size_t seen = 0;
    auto r = inject::with_threads_stopped(pid, nullptr, [&](const std::vector<pid_t>& tids) -> Result<void> {
      seen = tids.size();
      return {};
    });
    EXPECT_TRUE(r) << r.error().message;
    ok += r && seen == 9;
  }
  setitimer(ITIMER_REAL, &off, nullptr);
  sigaction(SIGALRM, &old, nullptr);
  EXPECT_EQ(ok, 50);
  EXPECT_EQ(traced_threads(pid), 0);
  end_child(pid);
}
