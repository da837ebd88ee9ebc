// What the heap model derives from each record beside its counters (issue
// 19): temporary allocations, block lifetimes, the peak by stack, memory over
// time and the spans of the temporal flame graph. The fields and their
// meaning are in heap_model.h (StackAllocs, Summary, Process); HeapModel
// calls these at the points of its data flow. Every call is O(1) amortized:
// the timeline and spans halve their resolution instead of growing.
#pragma once
#include <cstdint>

#include "heap/heap_model.h"

static_assert(memtrace::heap::kSpanBuckets == 128, "on_record divides by 128 with a shift");

namespace memtrace::heap::analyses {

void start(Process& p, uint64_t ts);
void widen_spans(Process& p);
void sample_slow(Process& p, uint64_t ts);

// Any record of p at ts: starts p's clocks on its first record, moves last_ts.
inline void on_record(Process& p, uint64_t ts) {
  if (!p.timeline_step_ns) return start(p, ts);
  if (ts <= p.last_ts) return;  // a record a little out of order
  p.last_ts = ts;
  if (((ts - p.span_t0) >> 7) >= p.span_bucket_ns) widen_spans(p);  // past kSpanBuckets (128) buckets
}

// After p's record at ts was applied: memory over time, live_at_end.
inline void sample(Process& p, uint64_t ts) {
  p.lifetimes.live_at_end = p.s.in_use_blocks;
  if (!p.timeline.empty() && ts < p.timeline.back().ts + p.timeline_step_ns) {  // the last point's interval
    TimelinePoint& pt = p.timeline.back();
    const Summary& s = p.s;
    uint64_t mapped = s.mapped_now_allocator + s.mapped_now_direct + (s.brk_now > s.brk_start ? s.brk_now - s.brk_start : 0);
    if (s.in_use_bytes > pt.in_use_bytes) pt.in_use_bytes = s.in_use_bytes;
    if (mapped > pt.mapped_bytes) pt.mapped_bytes = mapped;
    if (p.touched.size() > pt.touched_pages) pt.touched_pages = p.touched.size();
    return;
  }
  sample_slow(p, ts);
}

// Block b (at addr, from stack sa) came to life on thread tid.
void born(Process& p, StackAllocs& sa, uint64_t addr, const Block& b, uint32_t tid);
// In-use bytes rose past the peak at ts: the live bytes of every stack now are the peak's.
void new_peak(Process& p, uint64_t ts);

// A free of addr on thread tid (known block or not): was it that thread's
// last allocation, with no call of the thread since? Forgets the thread's
// last allocation either way. *prev: what it was (to undo a failed realloc).
bool temporary_free(Process& p, uint32_t tid, uint64_t addr, uint64_t* prev = nullptr);
// Block b (from stack sa) died at ts: counted in lifetimes and spans (known:
// false for a block whose free was lost, seen when its address came back:
// only its span moves, to ts), and as temporary when temporary.
void died(Process& p, StackAllocs& sa, const Block& b, uint64_t ts, bool temporary, bool known = true);
// Undo died() and temporary_free() for a realloc that failed: the block lives.
void revived(Process& p, StackAllocs& sa, const ParkedFree& f, uint32_t tid, uint64_t prev_last);

// A block of bytes joins sa's live blocks (add) or leaves them.
void stack_live(Process& p, StackAllocs& sa, uint64_t bytes, uint64_t blocks, bool add);

// A fork's child c with the live blocks it inherited (c.live) at ts (its
// parent's last record): its clocks, stacks and spans start there.
void inherited(Process& c, uint64_t ts);
// Forget everything (console 'clear').
void reset(Process& p);

}  // namespace memtrace::heap::analyses
