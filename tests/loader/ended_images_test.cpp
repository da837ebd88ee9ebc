// Ended images (heap/ended.cpp): sealing keeps every figure and frame,
// images of one program share their sealed stacks, merging past the cap
// sums them, and raw stacks no live image needs are dropped, so that the
// model's size follows live blocks and call paths, not processes.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

#include "heap/heap_model.h"
#include "report/report.h"

using memtrace::heap::HeapModel;
using memtrace::heap::Loc;
using memtrace::heap::Process;
namespace report = memtrace::report;

namespace {

// A fake address space: module m is loaded at bias(pid, m) (a different
// place in every process, as ASLR does); code of module m is at offsets
// [0x1000, 0x100000).
uint64_t bias(pid_t pid, uint32_t module) { return (uint64_t{module} << 32) + (uint64_t(pid) << 20); }
uint64_t ip_of(pid_t pid, uint32_t module, uint64_t offset) { return bias(pid, module) + offset; }

Loc loc_of(const Process& p, uint64_t ip) {
  uint32_t module = static_cast<uint32_t>(ip >> 32);
  return Loc{module, ip - bias(p.pid, module)};
}

// The loader's view of such a process (HeapModel::set_locator): modules 1..8.
memtrace::heap::ImageMap locate(const Process& p) {
  memtrace::heap::ImageMap m;
  for (uint32_t module = 1; module <= 8; module++)
    m.ranges.push_back({bias(p.pid, module), bias(p.pid, module) + 0x100000, module, bias(p.pid, module)});
  m.unknown = 99;
  return m;
}

// A frame as text: "m<module>+<offset>", the same for raw and sealed stacks.
std::vector<report::FrameOut> resolve(const Process& p, uint64_t addr, const Loc* loc, bool) {
  report::FrameOut f;
  Loc l = loc ? *loc : loc_of(p, addr);
  f.function = "m" + std::to_string(l.module) + "+" + std::to_string(l.offset);
  f.address = addr;
  return {f};
}

struct Gen {
  HeapModel& m;
  uint64_t ts = 1000;
  uint64_t next_id = 1;

  void record(const void* r, size_t n) { m.apply(r, n); }
  // Stack id of a call path (module/offset pairs) in pid: BPF's ids differ per process.
  uint64_t stack(pid_t pid, const std::vector<std::pair<uint32_t, uint64_t>>& path) {
    mt_stack s{};
    s.h.kind = MT_EV_STACK;
    s.h.pid = pid;
    s.stack_id = (uint64_t(pid) << 32) + next_id++;
    s.nr = static_cast<uint32_t>(path.size());
    for (size_t i = 0; i < path.size(); i++) s.ips[i] = ip_of(pid, path[i].first, path[i].second);
    record(&s, sizeof s);
    return s.stack_id;
  }
  void ev(pid_t pid, uint32_t kind, uint64_t addr, uint64_t size, uint64_t stack_id, uint32_t role = MT_ROLE_MALLOC) {
    mt_event e{};
    e.h.kind = kind;
    e.h.pid = pid;
    e.h.tid = pid;
    e.h.ts = ts += 1000;
    e.addr = addr;
    e.size = size;
    e.stack_id = stack_id;
    e.role = role;
    e.aux = static_cast<uint32_t>(-1);
    record(&e, sizeof e);
  }
  // One run of a small "program" in pid: paths 0..n-1 allocate (i+1)*16
  // bytes each, k times; path i leaks its last block when i is odd.
  void run(pid_t pid, int n, int k) {
    for (int i = 0; i < n; i++) {
      uint64_t id = stack(pid, {{1, 0x1000u + 16u * i}, {1, 0x2000}, {2, 0x3000u + i % 3}});
      for (int j = 0; j < k; j++) {
        uint64_t a = (uint64_t(pid) << 24) + (uint64_t(i) << 12) + j * 64;
        ev(pid, MT_EV_ALLOC, a, (i + 1) * 16u, id);
        if (!(i % 2 == 1 && j == k - 1)) ev(pid, MT_EV_FREE, a, 0, 0, MT_ROLE_FREE);
      }
    }
    ev(pid, MT_EV_MMAP, uint64_t(pid) << 36, 8192, stack(pid, {{3, 0x10}}));
  }
};

// Leak groups of p as (frames text) -> (bytes, blocks).
std::map<std::string, std::pair<uint64_t, uint64_t>> leaks(const HeapModel& m, const Process& p) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> out;
  for (const auto& g : report::leak_groups(p)) {
    std::string key;
    for (const auto& f : report::frames_of(m, resolve, p, g.stack_id, nullptr)) key += f.function + ";";
    out[key] = {g.bytes, g.blocks};
  }
  return out;
}

}  // namespace

TEST(EndedImages, SealedImageKeepsItsFiguresLeaksAndFrames) {
  HeapModel raw, sealed;
  sealed.set_locator(locate);
  Gen a{raw}, b{sealed};
  a.run(42, 20, 5);
  b.run(42, 20, 5);
  auto before = leaks(raw, *raw.find(42));
  sealed.on_exit(42, 0);
  sealed.retire(42, false);
  ASSERT_EQ(sealed.find(42), nullptr);  // no longer current
  auto images = sealed.images();
  ASSERT_EQ(images.size(), 1u);
  const Process& p = *images[0];
  EXPECT_TRUE(p.sealed);
  EXPECT_TRUE(p.live.empty());
  EXPECT_TRUE(p.maps.empty());
  const Process& r = *raw.find(42);
  EXPECT_EQ(p.s.allocs, r.s.allocs);
  EXPECT_EQ(p.s.in_use_bytes, r.s.in_use_bytes);
  EXPECT_EQ(p.s.mmap_bytes_direct, r.s.mmap_bytes_direct);
  EXPECT_EQ(p.s.peak_in_use_bytes, r.s.peak_in_use_bytes);
  EXPECT_EQ(p.s.temporary_allocs, r.s.temporary_allocs);
  EXPECT_EQ(p.stack_allocs.size(), r.stack_allocs.size());
  EXPECT_EQ(leaks(sealed, p), before);
  EXPECT_EQ(before.size(), 10u);  // the odd paths
  // Frames keep their addresses in the process (for the reports).
  for (const auto& g : report::leak_groups(p))
    for (const auto& f : report::frames_of(sealed, resolve, p, g.stack_id, nullptr))
      EXPECT_EQ(f.address >> 20 & 0xfff, 42u) << f.function;
}

TEST(EndedImages, ImagesOfOneProgramShareSealedStacks) {
  HeapModel m;
  m.set_locator(locate);
  Gen g{m};
  for (pid_t pid = 100; pid < 110; pid++) {
    g.run(pid, 30, 2);
    m.on_exit(pid, 0);
    m.retire(pid, false);
  }
  EXPECT_EQ(m.images().size(), 10u);
  EXPECT_EQ(m.sealed_stack_count(), 30u);  // not 10 x 30 (the mmap's stack is not kept: mappings end with the image)
  // Every raw stack was of an ended image: all dropped.
  auto dropped = m.collect_stacks();
  EXPECT_EQ(dropped.size(), 310u);
  EXPECT_EQ(m.stack_count(), 0u);
  for (const Process* p : m.images()) EXPECT_EQ(leaks(m, *p).size(), 15u);
}

TEST(EndedImages, PastTheCapTheMostFrequentProgramIsMergedAndSumsStayExact) {
  HeapModel m;
  m.set_locator(locate);
  m.set_image_cap(3);
  Gen g{m};
  uint64_t allocs = 0, in_use = 0, peak = 0;
  pid_t pid = 200;
  auto end = [&](pid_t p, const char* comm) {
    m.process(p).comm = comm;
    m.on_exit(p, 0);
    m.retire(p, false);
  };
  g.run(pid, 4, 3);
  end(pid++, "rare");
  for (int i = 0; i < 8; i++, pid++) {
    g.run(pid, 5 + i, 2);  // different sizes: different peaks
    const Process& p = *m.find(pid);
    allocs += p.s.allocs;
    in_use += p.s.in_use_bytes;
    peak = std::max(peak, p.s.peak_in_use_bytes);
    end(pid, "cc1");
  }
  // 3 kept one by one ("rare" and the two newest cc1), one merged cc1 entry.
  auto images = m.images();
  ASSERT_EQ(images.size(), 4u);
  const Process* merged = nullptr;
  uint64_t kept_allocs = 0, kept_in_use = 0;
  int rare = 0;
  for (const Process* p : images) {
    if (p->merged) merged = p;
    else if (p->comm == "rare") rare++;
    else kept_allocs += p->s.allocs, kept_in_use += p->s.in_use_bytes;
  }
  EXPECT_EQ(rare, 1);
  ASSERT_NE(merged, nullptr);
  EXPECT_EQ(merged->merged, 6u);
  EXPECT_EQ(merged->comm, "cc1");
  EXPECT_EQ(merged->merged_pids.front(), 201);
  EXPECT_EQ(merged->s.allocs + kept_allocs, allocs);
  EXPECT_EQ(merged->s.in_use_bytes + kept_in_use, in_use);
  EXPECT_LE(merged->s.peak_in_use_bytes, peak);
  // Its leak groups sum to its in-use bytes, and so do its stacks' peaks to its peak.
  uint64_t leaked = 0, at_peak = 0;
  for (const auto& lg : report::leak_groups(*merged)) leaked += lg.bytes;
  for (const auto& [id, sa] : merged->stack_allocs) at_peak += sa.peak_bytes;
  EXPECT_EQ(leaked, merged->s.in_use_bytes);
  EXPECT_EQ(at_peak, merged->s.peak_in_use_bytes);
  EXPECT_EQ(m.merged_images(), 6u);
}

TEST(EndedImages, CollectKeepsWhatLiveProcessesNeedAndRevivesLateRecords) {
  HeapModel m;
  m.set_locator(locate);
  Gen g{m};
  g.run(300, 3, 1);  // lives on
  uint64_t live_stack = g.stack(300, {{5, 0x50}});
  g.ev(300, MT_EV_ALLOC, 0x77000, 10, live_stack);
  m.on_fork(300, 301);  // the child inherits 300's blocks and their stacks
  g.run(302, 3, 1);
  uint64_t gone_stack = g.stack(302, {{6, 0x60}});
  m.on_exit(302, 0);
  m.retire(302, false);
  auto dropped = m.collect_stacks();
  EXPECT_EQ(dropped.size(), 5u);  // 302's 3 paths + its mmap's + gone_stack
  EXPECT_NE(m.stack(live_stack), nullptr);
  EXPECT_EQ(m.missing_stacks(), 0u);
  // A record queued before BPF forgot the stack names it: it comes back.
  g.ev(300, MT_EV_ALLOC, 0x78000, 10, gone_stack);
  EXPECT_EQ(m.missing_stacks(), 0u);
  EXPECT_NE(m.stack(gone_stack), nullptr);
  // After the next round the others are gone for good: counted, not silent.
  uint64_t other = dropped[0] == gone_stack ? dropped[1] : dropped[0];
  m.collect_stacks();
  g.ev(300, MT_EV_ALLOC, 0x79000, 10, other);
  EXPECT_EQ(m.missing_stacks(), 1u);
}

TEST(EndedImages, ManyShortProcessesKeepTheModelBounded) {
  HeapModel m;
  m.set_locator(locate);
  m.set_image_cap(16);
  Gen g{m};
  size_t most_raw = 0;
  for (pid_t pid = 1000; pid < 3000; pid++) {
    g.run(pid, 25, 2);
    m.process(pid).comm = pid % 2 ? "cc1" : "as";
    m.on_exit(pid, 0);
    m.retire(pid, false);
    if (m.stack_count() > 5000) m.collect_stacks();
    most_raw = std::max(most_raw, m.stack_count());
  }
  EXPECT_LE(most_raw, 5026u);
  EXPECT_EQ(m.sealed_stack_count(), 25u);
  auto images = m.images();
  EXPECT_EQ(images.size(), 18u);  // 16 one by one + one merged entry per name
  uint64_t allocs = 0, processes = 0;
  for (const Process* p : images) {
    allocs += p->s.allocs;
    processes += p->merged ? p->merged : 1;
    EXPECT_LE(p->stack_allocs.size(), 25u);
  }
  EXPECT_EQ(processes, 2000u);
  EXPECT_EQ(allocs, 2000u * 50);
}
