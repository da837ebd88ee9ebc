// The agent's CFI walk (issue 33, ring.h MT_INJ_STACK_CFI) gives libunwind's
// stacks: tests/inject/cfi_target.c (no frame pointers, known call
// chains, a thread, a chain deeper than a stack's 128 frames, addresses not
// randomized) traced once with libunwind and once with the rows, each leaked
// block's stack compared frame by frame; frame pointers lose the chains
// there. And on a real program: redis-server under redis-benchmark with
// every walk of the rows checked against libunwind's in the process
// (MT_INJ_CFI_VERIFY), none different.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "heap/heap_model.h"
#include "inject/session.h"
#include "test_env.h"
#include "../loader/harness.h"
#include "inject_util.h"

using namespace memtrace;
using namespace memtrace::testing;

namespace {

struct Stacks {
  int code = -1;
  std::string out;
  uint32_t stack_used = 0;
  uint64_t slow = 0, cut = 0, verified = 0, mismatch = 0;
  std::map<uint64_t, std::vector<uint64_t>> by_size;  // leaked block size -> its stack
  std::map<uint64_t, bool> truncated;
};

const uint64_t kSizes[] = {1001, 1002, 1003, 1004, 2001, 2002, 2003, 2004, 1005};

void trace(int stack_mode, bool verify, Stacks& t) {
  Child c = spawn({std::string(TARGET_DIR) + "/cfi_target", CFI_LIB});
  close(c.in);
  pid_t pid = ready_pid(c, &t.out);
  ASSERT_EQ(pid, c.pid) << t.out;
  inject::SessionOptions o;
  o.agent = AGENT;
  o.stack_mode = stack_mode;
  o.verify_stacks = verify;
  o.ring_mb = 16;
  auto s = inject::Session::start(pid, o);
  ASSERT_TRUE(s) << s.error().message;
  t.stack_used = (*s)->ring().hdr().stack_used;
  heap::HeapModel model;
  auto apply = [&](const void* d, size_t n) { model.apply(d, n); };
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
  const auto& h = (*s)->ring().hdr();
  t.slow = h.stack_slow;
  t.cut = h.stack_cut;
  t.verified = h.stack_verified;
  t.mismatch = h.stack_mismatch;
  EXPECT_EQ(h.drops, 0u);
  EXPECT_EQ(model.missing_stacks(), 0u);
  ASSERT_EQ(model.processes().size(), 1u);
  const heap::Process& p = *model.processes().begin()->second;
  for (const auto& [addr, b] : p.live)
    for (uint64_t want : kSizes)
      if (b.size == want) {
        const heap::Stack* st = model.stack(b.stack_id);
        ASSERT_NE(st, nullptr) << want;
        EXPECT_EQ(t.by_size.count(want), 0u) << "two blocks of " << want;
        t.by_size[want] = st->ips;
        t.truncated[want] = st->truncated;
      }
  t.out += read_all(c.out);
  // The library's frame as its offset from cfi_lib_alloc (mapped where the
  // run's later mmaps left room).
  auto at = t.out.find("lib 0x");
  ASSERT_NE(at, std::string::npos) << t.out;
  uint64_t lib = std::stoull(t.out.substr(at + 4), nullptr, 16);
  auto& s1005 = t.by_size[1005];
  ASSERT_FALSE(s1005.empty());
  EXPECT_LT(s1005[0] - lib, 4096u) << t.out;
  s1005[0] -= lib;
}

std::string hex(const std::vector<uint64_t>& ips) {
  std::string s;
  char b[24];
  for (uint64_t ip : ips) {
    snprintf(b, sizeof b, " %#lx", static_cast<unsigned long>(ip));
    s += b;
  }
  return s;
}

}  // namespace

// The rows' stacks are libunwind's, frame for frame, on every chain; the
// walk needed libunwind only for the library dlopen'd after the attach
// (no rows for it): counted, that stack libunwind's too.
TEST(InjectCfi, CfiStacksEqualLibunwind) {
  MEMTRACE_REQUIRE_ROOT();
  Stacks unw, cfi, fp;
  trace(MT_INJ_STACK_LIBUNWIND, false, unw);
  trace(MT_INJ_STACK_CFI, false, cfi);
  trace(MT_INJ_STACK_FP, false, fp);
  for (Stacks* t : {&unw, &cfi, &fp}) {
    ASSERT_EQ(t->code, 0) << t->out;
    ASSERT_EQ(t->by_size.size(), std::size(kSizes)) << t->out;
  }
  EXPECT_EQ(unw.stack_used, uint32_t{MT_INJ_STACK_LIBUNWIND});
  EXPECT_EQ(cfi.stack_used, uint32_t{MT_INJ_STACK_CFI});
  EXPECT_EQ(cfi.slow, 1u);  // cfi_lib_alloc's
  EXPECT_EQ(cfi.cut, 0u);
  int fp_differs = 0;
  for (uint64_t size : kSizes) {
    const auto& u = unw.by_size[size];
    EXPECT_EQ(hex(cfi.by_size[size]), hex(u)) << "block of " << size;
    EXPECT_EQ(cfi.truncated[size], unw.truncated[size]) << size;
    // leaf < chain < run < main (or thread_main) < libc's start: at least 5
    EXPECT_GE(u.size(), size == 1005 ? 4u : 5u) << size;
    fp_differs += fp.by_size[size] != u;
    printf("block of %lu: %zu frames (frame pointers: %zu):%s\n", static_cast<unsigned long>(size), u.size(),
           fp.by_size[size].size(), hex(std::vector<uint64_t>(u.begin(), u.begin() + std::min<size_t>(u.size(), 8))).c_str());
  }
  // The deep chains pass 128 frames: cut there by both, flagged.
  EXPECT_TRUE(cfi.truncated[1004]);
  EXPECT_EQ(cfi.by_size[1004].size(), size_t{MT_MAX_FRAMES});
  // Without frame pointers, their walk loses the chains (the target is what the test says).
  EXPECT_GT(fp_differs, 0);
}

// Every walk of the rows checked against libunwind's inside the target.
TEST(InjectCfi, CfiVerifiedInProcess) {
  MEMTRACE_REQUIRE_ROOT();
  Stacks t;
  trace(MT_INJ_STACK_CFI, true, t);
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_GT(t.verified, 8u);
  EXPECT_EQ(t.mismatch, 0u);
  printf("%lu walks compared with libunwind's, %lu differed\n", static_cast<unsigned long>(t.verified),
         static_cast<unsigned long>(t.mismatch));
}
