// The heap model on synthetic records: realloc semantics, failures, mmap
// accounting with partial unmaps, fork inheritance.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>

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

// Stack records are variable-size: the header and nr frames. The model takes
// one whose length covers its frames (exactly, or the whole fixed-size record
// an older build wrote), and counts any other as malformed.
TEST(HeapModel, StackRecordsAreSizedByTheirFrames) {
  HeapModel m;
  mt_stack s{};
  s.h.kind = MT_EV_STACK;
  s.h.pid = 10;
  auto stack = [&](uint64_t id, uint32_t nr, size_t len) {
    s.stack_id = id;
    s.nr = nr;
    for (uint32_t i = 0; i < nr && i < MT_MAX_FRAMES; i++) s.ips[i] = 0x400000 + id * 0x1000 + i;
    m.apply(&s, len);
  };
  stack(1, 3, MT_STACK_BYTES(3));                          // exact
  stack(2, MT_MAX_FRAMES, MT_STACK_BYTES(MT_MAX_FRAMES));  // the deepest
  stack(3, 5, sizeof s);                                   // the whole record
  stack(4, 5, MT_STACK_BYTES(4));                          // one frame short
  stack(5, MT_MAX_FRAMES + 1, sizeof s);                   // more frames than any record holds
  stack(6, 0, MT_STACK_HDR_BYTES - 8);                     // not even the header
  EXPECT_EQ(m.malformed_records(), 3u);
  ASSERT_TRUE(m.stack(1) && m.stack(2) && m.stack(3));
  EXPECT_FALSE(m.stack(4) || m.stack(5) || m.stack(6));
  EXPECT_EQ(m.stack(1)->ips, (std::vector<uint64_t>{0x401000, 0x401001, 0x401002}));
  ASSERT_EQ(m.stack(2)->ips.size(), size_t(MT_MAX_FRAMES));
  EXPECT_EQ(m.stack(2)->ips.back(), 0x402000u + MT_MAX_FRAMES - 1);
  EXPECT_EQ(m.stack(3)->ips.size(), 5u);
}

// ---------------------------------------------------------------- analyses (issue 19)

namespace {
using memtrace::heap::Process;
using memtrace::heap::Span;

// An event of pid 10 at ts on thread tid from stack.
mt_event at(uint32_t kind, uint64_t ts, uint64_t addr, uint64_t size = 0, uint64_t stack = 1, uint32_t tid = 10,
            uint32_t role = MT_ROLE_MALLOC, uint64_t old = 0) {
  mt_event e = ev(kind, addr, size, role, old, 0, tid);
  e.h.ts = ts;
  e.stack_id = stack;
  return e;
}
const uint64_t T0 = 1'000'000'000;  // a ktime: 1 s after boot
}  // namespace

TEST(Analyses, TemporaryIsHeaptracksFreedBeforeTheThreadsNextCall) {
  HeapModel m;
  // a = malloc; free(a): temporary.
  apply(m, at(MT_EV_ALLOC, T0, 0x1000, 8, 1));
  apply(m, at(MT_EV_FREE, T0 + 1, 0x1000));
  // a = malloc; b = malloc; free(b): temporary; free(a): not (b came between).
  apply(m, at(MT_EV_ALLOC, T0 + 2, 0x1000, 8, 2));
  apply(m, at(MT_EV_ALLOC, T0 + 3, 0x2000, 8, 3));
  apply(m, at(MT_EV_FREE, T0 + 4, 0x2000));
  apply(m, at(MT_EV_FREE, T0 + 5, 0x1000));
  // a = malloc; free(unknown); free(a): not temporary (heaptrack: any free resets).
  apply(m, at(MT_EV_ALLOC, T0 + 6, 0x1000, 8, 2));
  apply(m, at(MT_EV_FREE, T0 + 7, 0x9999));
  apply(m, at(MT_EV_FREE, T0 + 8, 0x1000));
  // Per thread: 11 allocates, 12 allocates, 11 frees its own (temporary), 12 too.
  apply(m, at(MT_EV_ALLOC, T0 + 9, 0x3000, 8, 4, 11));
  apply(m, at(MT_EV_ALLOC, T0 + 10, 0x4000, 8, 4, 12));
  apply(m, at(MT_EV_FREE, T0 + 11, 0x3000, 0, 0, 11));
  apply(m, at(MT_EV_FREE, T0 + 12, 0x4000, 0, 0, 12));
  // A block freed by another thread than the one that allocated it: not temporary.
  apply(m, at(MT_EV_ALLOC, T0 + 13, 0x5000, 8, 5, 11));
  apply(m, at(MT_EV_FREE, T0 + 14, 0x5000, 0, 0, 12));
  const Process& p = m.process(10);
  EXPECT_EQ(p.s.temporary_allocs, 4u);
  EXPECT_EQ(p.stack_allocs.at(1).temporary, 1u);
  EXPECT_EQ(p.stack_allocs.at(2).temporary, 0u);
  EXPECT_EQ(p.stack_allocs.at(3).temporary, 1u);
  EXPECT_EQ(p.stack_allocs.at(4).temporary, 2u);
  EXPECT_EQ(p.stack_allocs.at(5).temporary, 0u);
}

TEST(Analyses, ReallocFreesTheOldBlockAndAFailedReallocUndoesIt) {
  HeapModel m;
  // p = malloc(10); p = realloc(p, 20): the old block was the last one: temporary (as heaptrack counts it).
  apply(m, at(MT_EV_ALLOC, T0, 0x1000, 10, 1));
  apply(m, at(MT_EV_FREE, T0 + 1000, 0x1000, 0, 0, 10, MT_ROLE_REALLOC));
  apply(m, at(MT_EV_ALLOC, T0 + 1000, 0x2000, 20, 2, 10, MT_ROLE_REALLOC, 0x1000));
  const Process& p = m.process(10);
  EXPECT_EQ(p.s.temporary_allocs, 1u);
  EXPECT_EQ(p.lifetimes.freed[9], 1u);  // 1000 ns: [512, 1024)
  // realloc(p, huge) fails: nothing happened to p, and free(p) right after is temporary.
  apply(m, at(MT_EV_FREE, T0 + 5000, 0x2000, 0, 0, 10, MT_ROLE_REALLOC));
  EXPECT_EQ(p.s.temporary_allocs, 2u);
  apply(m, at(MT_EV_REALLOC_FAIL, T0 + 5001, 0x2000, 1ull << 60, 2, 10, MT_ROLE_REALLOC));
  EXPECT_EQ(p.s.temporary_allocs, 1u);
  EXPECT_EQ(p.stack_allocs.at(2).temporary, 0u);
  EXPECT_EQ(p.stack_allocs.at(2).live_bytes, 20u);
  uint64_t freed = 0;
  for (uint64_t n : p.lifetimes.freed) freed += n;
  EXPECT_EQ(freed, 1u);
  EXPECT_EQ(p.lifetimes.live_at_end, 1u);
  ASSERT_EQ(p.spans.at(2).size(), 1u);
  EXPECT_EQ(p.spans.at(2)[0].free_bucket, memtrace::heap::kSpanLive);
  apply(m, at(MT_EV_FREE, T0 + 6000, 0x2000));
  EXPECT_EQ(p.s.temporary_allocs, 2u);
  EXPECT_EQ(p.stack_allocs.at(2).temporary, 1u);
  EXPECT_EQ(p.lifetimes.live_at_end, 0u);
}

TEST(Analyses, LifetimesInLog2Buckets) {
  HeapModel m;
  uint64_t ages[] = {0, 1, 2, 3, 1000, 1024, 1'000'000'000};
  uint64_t a = 0x1000;
  for (uint64_t age : ages) {
    apply(m, at(MT_EV_ALLOC, T0 + 10, a, 7));
    apply(m, at(MT_EV_FREE, T0 + 10 + age, a));
    a += 0x100;
  }
  apply(m, at(MT_EV_ALLOC, T0 + 10, a, 7));  // lives on
  const auto& l = m.process(10).lifetimes;
  EXPECT_EQ(l.freed[0], 2u);   // 0 and 1 ns
  EXPECT_EQ(l.freed[1], 2u);   // 2, 3
  EXPECT_EQ(l.freed[9], 1u);   // 1000
  EXPECT_EQ(l.freed[10], 1u);  // 1024
  EXPECT_EQ(l.freed[29], 1u);  // 1 s: [2^29, 2^30) ns
  EXPECT_EQ(l.freed_bytes[1], 14u);
  EXPECT_EQ(l.live_at_end, 1u);
}

TEST(Analyses, PeakIsWhenInUseFirstReachedItsMaximumWithTheStacksLiveThen) {
  HeapModel m;
  apply(m, at(MT_EV_ALLOC, T0 + 1, 0x1000, 100, 1));
  apply(m, at(MT_EV_ALLOC, T0 + 2, 0x2000, 50, 2));  // 150: the peak
  apply(m, at(MT_EV_FREE, T0 + 3, 0x1000));
  apply(m, at(MT_EV_ALLOC, T0 + 4, 0x3000, 100, 3));  // 150 again: not a new peak
  apply(m, at(MT_EV_FREE, T0 + 5, 0x3000));
  const Process& p = m.process(10);
  EXPECT_EQ(p.s.peak_in_use_bytes, 150u);
  EXPECT_EQ(p.s.peak_ts, T0 + 2);
  EXPECT_EQ(p.stack_allocs.at(1).peak_bytes, 100u);
  EXPECT_EQ(p.stack_allocs.at(2).peak_bytes, 50u);
  EXPECT_EQ(p.stack_allocs.at(3).peak_bytes, 0u);
  EXPECT_EQ(p.stack_allocs.at(1).live_bytes, 0u);
  apply(m, at(MT_EV_ALLOC, T0 + 6, 0x4000, 200, 3));  // 250
  EXPECT_EQ(p.s.peak_ts, T0 + 6);
  EXPECT_EQ(p.stack_allocs.at(1).peak_bytes, 0u);
  EXPECT_EQ(p.stack_allocs.at(2).peak_bytes, 50u);
  EXPECT_EQ(p.stack_allocs.at(3).peak_bytes, 200u);
  EXPECT_EQ(p.stack_allocs.at(3).peak_blocks, 1u);
}

// A random run against a direct computation: the peak's stacks, the spans by
// (alloc bucket, free bucket) at the final bucket width, the timeline's bound
// and maximum, temporary counts.
TEST(Analyses, RandomRunAgreesWithADirectComputation) {
  HeapModel m;
  std::mt19937_64 rng(19);
  struct B {
    uint64_t addr, size, stack, ts, free_ts;
    bool live;
  };
  std::vector<B> all;
  std::vector<size_t> live;
  uint64_t ts = T0, in_use = 0, peak = 0, peak_ts = 0, last_alloc = 0, temporary = 0;
  std::map<uint64_t, uint64_t> stack_live, peak_by_stack;
  for (int i = 0; i < 200000; i++) {
    // Time in bursts: mostly ns apart, sometimes ms, a few times seconds.
    uint64_t r = rng() % 1000;
    ts += r < 990 ? rng() % 200 : r < 999 ? rng() % 5'000'000 : rng() % 3'000'000'000ull;
    bool do_alloc = live.empty() || rng() % 100 < (i < 100000 ? 55 : 45);
    if (do_alloc) {
      B b{0x10000 + all.size() * 16, 1 + rng() % 500, 1 + rng() % 40, ts, 0, true};
      apply(m, at(MT_EV_ALLOC, ts, b.addr, b.size, b.stack));
      live.push_back(all.size());
      all.push_back(b);
      in_use += b.size;
      stack_live[b.stack] += b.size;
      last_alloc = b.addr;
      if (in_use > peak) {
        peak = in_use;
        peak_ts = ts;
        peak_by_stack = stack_live;
      }
    } else {
      size_t k = rng() % 4 == 0 ? live.size() - 1 : rng() % live.size();  // often the newest
      B& b = all[live[k]];
      live.erase(live.begin() + k);
      apply(m, at(MT_EV_FREE, ts, b.addr));
      b.live = false;
      b.free_ts = ts;
      in_use -= b.size;
      stack_live[b.stack] -= b.size;
      if (last_alloc == b.addr) temporary++;
      last_alloc = 0;
    }
  }
  const Process& p = m.process(10);
  EXPECT_EQ(p.s.in_use_bytes, in_use);
  EXPECT_EQ(p.s.peak_in_use_bytes, peak);
  EXPECT_EQ(p.s.peak_ts, peak_ts);
  EXPECT_EQ(p.s.temporary_allocs, temporary);
  uint64_t peak_sum = 0;
  for (const auto& [id, sa] : p.stack_allocs) {
    EXPECT_EQ(sa.peak_bytes, peak_by_stack[id]) << "stack " << id;
    EXPECT_EQ(sa.live_bytes, stack_live[id]) << "stack " << id;
    peak_sum += sa.peak_bytes;
  }
  EXPECT_EQ(peak_sum, peak);
  // Spans at the final width.
  ASSERT_GT(p.span_bucket_ns, 0u);
  EXPECT_EQ(p.span_bucket_ns & (p.span_bucket_ns - 1), 0u);
  EXPECT_LT((p.last_ts - p.span_t0) / p.span_bucket_ns, memtrace::heap::kSpanBuckets);
  EXPECT_EQ(p.span_t0, all[0].ts);
  std::map<std::tuple<uint64_t, uint16_t, uint16_t>, std::pair<uint64_t, uint64_t>> want;
  for (const B& b : all) {
    uint16_t a = (b.ts - p.span_t0) / p.span_bucket_ns;
    uint16_t f = b.live ? memtrace::heap::kSpanLive : (b.free_ts - p.span_t0) / p.span_bucket_ns;
    auto& w = want[{b.stack, a, f}];
    w.first += b.size;
    w.second++;
  }
  std::map<std::tuple<uint64_t, uint16_t, uint16_t>, std::pair<uint64_t, uint64_t>> got;
  for (const auto& [id, v] : p.spans) {
    for (size_t i = 0; i < v.size(); i++) {
      if (i) {
        EXPECT_LT(uint32_t(v[i - 1].alloc_bucket) << 16 | v[i - 1].free_bucket,
                  uint32_t(v[i].alloc_bucket) << 16 | v[i].free_bucket);
      }
      EXPECT_GT(v[i].count, 0u);
      got[{id, v[i].alloc_bucket, v[i].free_bucket}] = {v[i].bytes, v[i].count};
    }
  }
  EXPECT_EQ(got, want);
  // The timeline: bounded, in order, its maximum is the peak, its last point the end.
  ASSERT_FALSE(p.timeline.empty());
  EXPECT_LE(p.timeline.size(), memtrace::heap::kTimelinePoints);
  EXPECT_GT(p.timeline.size(), memtrace::heap::kTimelinePoints / 4);
  uint64_t tl_max = 0;
  for (size_t i = 0; i < p.timeline.size(); i++) {
    if (i) {
      EXPECT_LT(p.timeline[i - 1].ts, p.timeline[i].ts);
    }
    EXPECT_EQ((p.timeline[i].ts - p.first_ts) % p.timeline_step_ns, 0u);
    tl_max = std::max(tl_max, p.timeline[i].in_use_bytes);
  }
  EXPECT_EQ(tl_max, peak);
  EXPECT_LE(p.timeline.back().ts, p.last_ts);
  EXPECT_GT(p.timeline.back().ts + p.timeline_step_ns, p.last_ts);
  EXPECT_EQ(p.first_ts, all[0].ts);
  EXPECT_EQ(p.last_ts, ts);
}

TEST(Analyses, TimelineKeepsMappedBytesAndTheMaximumOfEachInterval) {
  HeapModel m;
  apply(m, at(MT_EV_MMAP, T0, 0x100000, 8192));
  apply(m, at(MT_EV_ALLOC, T0 + 1, 0x1000, 1000));
  apply(m, at(MT_EV_FREE, T0 + 2, 0x1000));  // same interval: the point keeps 1000
  apply(m, at(MT_EV_MUNMAP, T0 + 5000, 0x100000, 8192));
  const Process& p = m.process(10);
  ASSERT_EQ(p.timeline.size(), 2u);
  EXPECT_EQ(p.timeline[0].ts, T0);
  EXPECT_EQ(p.timeline[0].in_use_bytes, 1000u);
  EXPECT_EQ(p.timeline[0].mapped_bytes, 8192u);
  EXPECT_EQ(p.timeline[1].in_use_bytes, 0u);
  EXPECT_EQ(p.timeline[1].mapped_bytes, 0u);
  EXPECT_EQ(p.timeline[1].ts, T0 + 4096);  // 1024-ns intervals from the first record
}

TEST(Analyses, ForkChildStartsWithItsParentsBlocksAtThePeak) {
  HeapModel m;
  apply(m, at(MT_EV_ALLOC, T0, 0x1000, 10, 1));
  apply(m, at(MT_EV_ALLOC, T0 + 100, 0x2000, 30, 2));
  m.on_fork(10, 11);
  Process& c = m.process(11);
  EXPECT_EQ(c.first_ts, T0 + 100);
  EXPECT_EQ(c.s.peak_ts, T0 + 100);
  EXPECT_EQ(c.stack_allocs.at(2).peak_bytes, 30u);
  EXPECT_EQ(c.stack_allocs.at(2).allocs, 0u);
  mt_event f = at(MT_EV_FREE, T0 + 200, 0x2000);
  f.h.pid = 11;
  apply(m, f);
  EXPECT_EQ(c.stack_allocs.at(2).live_bytes, 0u);
  EXPECT_EQ(c.stack_allocs.at(2).peak_bytes, 30u);
  EXPECT_EQ(c.lifetimes.freed[6], 1u);  // 100 ns: [64, 128)
  EXPECT_EQ(m.process(10).stack_allocs.at(2).live_bytes, 30u);  // the parent's is its own
  ASSERT_EQ(c.spans.at(2).size(), 1u);
  EXPECT_EQ(c.spans.at(2)[0].free_bucket, 0u);
}

TEST(Analyses, ClearForgetsEverything) {
  HeapModel m;
  apply(m, at(MT_EV_ALLOC, T0, 0x1000, 10, 1));
  apply(m, at(MT_EV_FREE, T0 + 1, 0x1000));
  m.clear(10);
  const Process& p = m.process(10);
  EXPECT_EQ(p.s.temporary_allocs, 0u);
  EXPECT_TRUE(p.spans.empty());
  EXPECT_TRUE(p.timeline.empty());
  EXPECT_TRUE(p.stack_allocs.empty());
  apply(m, at(MT_EV_ALLOC, T0 + 50, 0x1000, 10, 1));
  EXPECT_EQ(p.first_ts, T0 + 50);
  EXPECT_EQ(p.s.peak_ts, T0 + 50);
}

// Records as a corrupt or hostile recording may hold them (any time, any
// size, frees of unknown blocks, realloc failures, forks, clears): the
// analyses stay consistent with the model's own counters and bounded.
TEST(Analyses, AnyRecordsKeepThemConsistentAndBounded) {
  HeapModel m;
  std::mt19937_64 rng(7);
  uint64_t addrs[64];
  for (auto& a : addrs) a = 0x1000 + (rng() % 4096) * 16;
  uint64_t ts = 0;
  for (int i = 0; i < 100000; i++) {
    uint64_t r = rng();
    ts = r % 50 == 0 ? rng() : r % 50 == 1 ? ts - rng() % 1000 : ts + rng() % 100000;  // jumps and steps back
    uint64_t size = rng() % 8 == 0 ? rng() : rng() % 4096;
    uint32_t tid = 10 + rng() % 3;
    uint64_t addr = addrs[rng() % 64];
    switch (rng() % 10) {
      case 0: case 1: case 2:
        apply(m, at(MT_EV_ALLOC, ts, addr, size, rng() % 5, tid));
        break;
      case 3: case 4: case 5:
        apply(m, at(MT_EV_FREE, ts, addr, 0, 0, tid));
        break;
      case 6:
        apply(m, at(MT_EV_FREE, ts, addr, 0, 0, tid, MT_ROLE_REALLOC));
        if (rng() % 2) apply(m, at(MT_EV_ALLOC, ts, addrs[rng() % 64], size, rng() % 5, tid, MT_ROLE_REALLOC, addr));
        else apply(m, at(MT_EV_REALLOC_FAIL, ts, addr, size, 1, tid, MT_ROLE_REALLOC));
        break;
      case 7:
        apply(m, at(MT_EV_MMAP, ts, addr << 12, size & ~4095ull));
        break;
      case 8:
        if (rng() % 100 == 0) m.clear(10);
        break;
      case 9:
        if (rng() % 1000 == 0) m.on_fork(10, 11 + rng() % 3);
        break;
    }
  }
  for (const auto* pp : m.images()) {
    const Process& p = *pp;
    SCOPED_TRACE("pid " + std::to_string(p.pid));
    uint64_t live_bytes = 0, live_blocks = 0, span_live = 0, peak = 0;
    for (const auto& [id, sa] : p.stack_allocs) {
      live_bytes += sa.live_bytes;
      live_blocks += sa.live_blocks;
      peak += sa.peak_bytes;
    }
    EXPECT_EQ(live_bytes, p.s.in_use_bytes);  // modulo 2^64, as the model adds sizes
    EXPECT_EQ(live_blocks, p.s.in_use_blocks);
    EXPECT_EQ(peak, p.s.peak_in_use_bytes);
    EXPECT_EQ(p.lifetimes.live_at_end, p.s.in_use_blocks);
    for (const auto& [id, v] : p.spans)
      for (size_t i = 0; i < v.size(); i++) {
        EXPECT_GT(v[i].count, 0u);
        EXPECT_TRUE(v[i].free_bucket == memtrace::heap::kSpanLive || v[i].free_bucket < memtrace::heap::kSpanBuckets);
        EXPECT_LT(v[i].alloc_bucket, memtrace::heap::kSpanBuckets);
        if (v[i].free_bucket == memtrace::heap::kSpanLive) span_live += v[i].count;
      }
    EXPECT_EQ(span_live, p.s.in_use_blocks);
    EXPECT_LE(p.timeline.size(), memtrace::heap::kTimelinePoints);
  }
}

// Where a stack that went wrong is cut (heap::trusted_frames): G a return
// address, B no return address, U in no known mapping. The first frame is
// the probe's own; a run of U that a G follows is a JIT's code (kept).
TEST(TrustedFrames, CutAtTheFirstFrameNoCallPrecedesButKeepJitCodeWithCallersAfterIt) {
  using memtrace::heap::FrameTrust;
  auto keep = [](const std::string& s) {
    return memtrace::heap::trusted_frames(s.size(), [&](size_t i) {
      return s[i] == 'G' ? FrameTrust::Good : s[i] == 'B' ? FrameTrust::Bad : FrameTrust::Unmapped;
    });
  };
  EXPECT_EQ(keep(""), 0u);
  EXPECT_EQ(keep("GGGG"), 4u);
  EXPECT_EQ(keep("BGGG"), 4u);   // the first frame is never doubted
  EXPECT_EQ(keep("GBU"), 1u);    // stripped_nofp: leaf, &leaf, 0x3aef74d0
  EXPECT_EQ(keep("GGU"), 2u);    // an unmapped last frame
  EXPECT_EQ(keep("GUUG"), 4u);   // JIT frames, then their callers (node)
  EXPECT_EQ(keep("GUUB"), 1u);   // unmapped words, then no return address
  EXPECT_EQ(keep("GUGB"), 3u);
}
