// The heap model on synthetic records: realloc semantics, failures, mmap
// accounting with partial unmaps, fork inheritance.
#include <gtest/gtest.h>

#include "heap/heap_model.h"
#include "report/report.h"

using memtrace::heap::HeapModel;

namespace {
mt_event ev(uint32_t kind, uint64_t addr, uint64_t size, uint32_t role = MT_ROLE_MALLOC,
            uint64_t old = 0, uint32_t flags = 0, uint32_t tid = 10) {
  mt_event e{};
  e.h.kind = kind;
  e.h.pid = 10;
  e.h.tid = tid;
  e.h.flags = flags;
  e.addr = addr;
  e.size = size;
  e.role = role;
  e.old_addr = old;
  return e;
}
void apply(HeapModel& m, const mt_event& e) { m.apply(&e, sizeof e); }
}  // namespace

TEST(HeapModel, ReallocIsFreePlusAllocAndFailureRestoresTheBlock) {
  HeapModel m;
  apply(m, ev(MT_EV_ALLOC, 0x1000, 10));
  // realloc(0x1000, 20) -> 0x2000: free at entry, alloc at return.
  apply(m, ev(MT_EV_FREE, 0x1000, 0, MT_ROLE_REALLOC));
  apply(m, ev(MT_EV_ALLOC, 0x2000, 20, MT_ROLE_REALLOC, 0x1000));
  auto& s = m.process(10).s;
  EXPECT_EQ(s.allocs, 2u);
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.in_use_bytes, 20u);
  // realloc(0x2000, huge) fails: the block lives on, one failure.
  apply(m, ev(MT_EV_FREE, 0x2000, 0, MT_ROLE_REALLOC));
  apply(m, ev(MT_EV_REALLOC_FAIL, 0x2000, 1ull << 60, MT_ROLE_REALLOC));
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.failed_allocs, 1u);
  EXPECT_EQ(s.in_use_blocks, 1u);
  EXPECT_EQ(s.in_use_bytes, 20u);
  EXPECT_EQ(s.peak_in_use_bytes, 20u);
  // Unknown free is counted, not applied.
  apply(m, ev(MT_EV_FREE, 0x9999, 0, MT_ROLE_FREE));
  EXPECT_EQ(s.unknown_frees, 1u);
  EXPECT_EQ(s.frees, 1u);
}

TEST(HeapModel, PartialMunmapSplitsMappings) {
  HeapModel m;
  apply(m, ev(MT_EV_MMAP, 0x10000, 0x4000, 0, 0, MT_F_ALLOCATOR_INTERNAL));
  apply(m, ev(MT_EV_MMAP, 0x20000, 0x3000, 0, 0, 0));
  apply(m, ev(MT_EV_MUNMAP, 0x11000, 0x1000));
  auto& p = m.process(10);
  EXPECT_EQ(p.s.mmap_bytes_allocator, 0x4000u);
  EXPECT_EQ(p.s.mmap_bytes_direct, 0x3000u);
  EXPECT_EQ(p.s.mapped_now_allocator, 0x3000u);
  EXPECT_EQ(p.maps.size(), 3u);  // [0x10000,+0x1000) [0x12000,+0x2000) [0x20000,+0x3000)
  apply(m, ev(MT_EV_MUNMAP, 0x0, 0x100000));
  EXPECT_EQ(p.s.mapped_now_allocator, 0u);
  EXPECT_EQ(p.s.mapped_now_direct, 0u);
  EXPECT_TRUE(p.maps.empty());
}

TEST(HeapModel, ForkChildInheritsLiveBlocksButNotCounts) {
  HeapModel m;
  apply(m, ev(MT_EV_ALLOC, 0x1000, 10));
  apply(m, ev(MT_EV_ALLOC, 0x2000, 30));
  m.on_fork(10, 11);
  auto& c = m.process(11).s;
  EXPECT_EQ(c.allocs, 0u);
  EXPECT_EQ(c.in_use_blocks, 2u);
  EXPECT_EQ(c.in_use_bytes, 40u);
  EXPECT_EQ(c.inherited_blocks, 2u);
}

TEST(Report, LeaksGroupByStackLargestFirst) {
  HeapModel m;
  mt_event a = ev(MT_EV_ALLOC, 0x1000, 10);
  a.stack_id = 1;
  apply(m, a);
  a.addr = 0x2000;
  apply(m, a);
  mt_event b = ev(MT_EV_ALLOC, 0x3000, 100);
  b.stack_id = 2;
  apply(m, b);
  auto g = memtrace::report::leak_groups(m.process(10));
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].bytes, 100u);
  EXPECT_EQ(g[1].bytes, 20u);
  EXPECT_EQ(g[1].blocks, 2u);
}
