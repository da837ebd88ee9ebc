#include "heap/analyses.h"

#include <algorithm>

namespace memtrace::heap::analyses {
namespace {

// The first timeline interval and span bucket (~1 µs); both double as the
// traced time grows, so a short program gets fine resolution and a long one
// bounded memory.
constexpr uint64_t kFirstStepNs = 1024;

unsigned log2_of(uint64_t pow2) { return static_cast<unsigned>(__builtin_ctzll(pow2)); }

bool started(const Process& p) { return p.timeline_step_ns != 0; }

// The span bucket of ts (a time at most last_ts: every record passed on_record).
uint16_t bucket(const Process& p, uint64_t ts) {
  if (!started(p) || ts <= p.span_t0) return 0;
  uint64_t b = (ts - p.span_t0) >> log2_of(p.span_bucket_ns);
  return static_cast<uint16_t>(std::min<uint64_t>(b, kSpanBuckets - 1));
}

std::vector<Span>& spans_of(Process& p, StackAllocs& sa, uint64_t stack_id) {
  if (!sa.spans) sa.spans = &p.spans[stack_id];
  return *sa.spans;
}

// The block thread tid allocated last, if no call of the thread came since (0: none).
uint64_t& last_alloc_of(Process& p, uint32_t tid) {
  if (tid != p.cur_tid) {  // another thread than the last call's: swap it in
    if (p.cur_tid) {
      if (p.cur_tid_last) p.last_alloc_by_tid[p.cur_tid] = p.cur_tid_last;
      else p.last_alloc_by_tid.erase(p.cur_tid);
    }
    auto it = p.last_alloc_by_tid.find(tid);
    p.cur_tid_last = it == p.last_alloc_by_tid.end() ? 0 : it->second;
    p.cur_tid = tid;
  }
  return p.cur_tid_last;
}

uint32_t key(uint16_t alloc_bucket, uint16_t free_bucket) { return uint32_t(alloc_bucket) << 16 | free_bucket; }
uint32_t key(const Span& s) { return key(s.alloc_bucket, s.free_bucket); }

// Add one block of bytes to the span (a, f) of v, or take it (add false); v
// is kept sorted by key, a span whose count reaches 0 is removed. Unsigned
// all through: a recording's sizes are any 64-bit value.
void span_add(std::vector<Span>& v, uint16_t a, uint16_t f, uint64_t bytes, bool add) {
  uint32_t k = key(a, f);
  // Most changes are to the newest buckets, at the end: look there first.
  auto it = v.end();
  for (int i = 0; i < 4 && it != v.begin() && key(*(it - 1)) >= k; i++) --it;
  if (it != v.begin() && key(*(it - 1)) >= k)
    it = std::lower_bound(v.begin(), it, k, [](const Span& s, uint32_t k) { return key(s) < k; });
  if (it == v.end() || key(*it) != k) {
    if (!add) return;  // nothing there to take (cannot happen: every block added its span)
    it = v.insert(it, Span{a, f, 0, 0});
  }
  if (add) {
    it->bytes += bytes;
    it->count++;
  } else if (it->count <= 1) {
    v.erase(it);
  } else {
    it->bytes -= bytes;
    it->count--;
  }
}

}  // namespace

// The first record of p (at or after its exec).
void start(Process& p, uint64_t ts) {
  if (ts < p.exec_ts) return;  // queued before the exec that started this image
  p.first_ts = p.last_ts = p.span_t0 = ts;
  p.span_bucket_ns = p.timeline_step_ns = kFirstStepNs;
}

// Time ran past kSpanBuckets buckets: double the width until last_ts fits,
// and merge the spans that now share their buckets.
void widen_spans(Process& p) {
  unsigned k = 0;
  while (((p.last_ts - p.span_t0) >> log2_of(p.span_bucket_ns)) >= kSpanBuckets) {
    p.span_bucket_ns <<= 1;
    k++;
  }
  for (auto& [id, v] : p.spans) {
    for (auto& s : v) {  // buckets are below 128: k past 7 leaves 0 (and a shift past 31 is undefined)
      s.alloc_bucket = k < 16 ? s.alloc_bucket >> k : 0;
      if (s.free_bucket != kSpanLive) s.free_bucket = k < 16 ? s.free_bucket >> k : 0;
    }
    std::sort(v.begin(), v.end(), [](const Span& a, const Span& b) { return key(a) < key(b); });
    size_t out = 0;
    for (size_t i = 0; i < v.size(); i++) {
      if (out && key(v[out - 1]) == key(v[i])) {
        v[out - 1].bytes += v[i].bytes;
        v[out - 1].count += v[i].count;
      } else {
        v[out++] = v[i];
      }
    }
    v.resize(out);
  }
}

namespace {

void merge_point(TimelinePoint& into, const TimelinePoint& pt) {
  into.in_use_bytes = std::max(into.in_use_bytes, pt.in_use_bytes);
  into.mapped_bytes = std::max(into.mapped_bytes, pt.mapped_bytes);
  into.touched_pages = std::max(into.touched_pages, pt.touched_pages);
}

uint64_t slot_of(const Process& p, uint64_t ts) {
  uint64_t t = ts > p.first_ts ? ts - p.first_ts : 0;
  return p.first_ts + (t & ~(p.timeline_step_ns - 1));
}

// More than kTimelinePoints points: double the interval, merge the pairs.
void widen_timeline(Process& p) {
  auto& tl = p.timeline;
  while (tl.size() > kTimelinePoints) {
    p.timeline_step_ns <<= 1;
    size_t out = 0;
    for (size_t i = 0; i < tl.size(); i++) {
      TimelinePoint pt = tl[i];
      pt.ts = slot_of(p, pt.ts);
      if (out && tl[out - 1].ts == pt.ts) merge_point(tl[out - 1], pt);
      else tl[out++] = pt;
    }
    tl.resize(out);
  }
}

void lifetime(Process& p, const Block& b, uint64_t ts, bool add) {
  uint64_t age = ts > b.ts ? ts - b.ts : 0;
  unsigned i = age < 2 ? 0 : 63 - static_cast<unsigned>(__builtin_clzll(age));
  if (add) {
    p.lifetimes.freed[i]++;
    p.lifetimes.freed_bytes[i] += b.size;
  } else {
    p.lifetimes.freed[i]--;
    p.lifetimes.freed_bytes[i] -= b.size;
  }
}

}  // namespace

void sample_slow(Process& p, uint64_t ts) {
  if (!started(p)) return;
  const Summary& s = p.s;
  TimelinePoint pt{slot_of(p, ts), s.in_use_bytes,
                   s.mapped_now_allocator + s.mapped_now_direct + (s.brk_now > s.brk_start ? s.brk_now - s.brk_start : 0),
                   p.touched.size()};
  auto& tl = p.timeline;
  if (!tl.empty() && tl.back().ts >= pt.ts) {  // same interval (or a record a little out of order)
    merge_point(tl.back(), pt);
    return;
  }
  tl.push_back(pt);
  if (tl.size() > kTimelinePoints) widen_timeline(p);
}

void stack_live(Process& p, StackAllocs& sa, uint64_t bytes, uint64_t blocks, bool add) {
  if (add) {
    sa.live_bytes += bytes;
    sa.live_blocks += blocks;
  } else {
    sa.live_bytes -= bytes;
    sa.live_blocks -= blocks;
  }
  if (!sa.peak_dirty) {
    sa.peak_dirty = true;
    p.peak_dirty.push_back(&sa);
  }
}

void born(Process& p, StackAllocs& sa, uint64_t addr, const Block& b, uint32_t tid) {
  last_alloc_of(p, tid) = addr;
  stack_live(p, sa, b.size, b.weight, true);
  span_add(spans_of(p, sa, b.stack_id), bucket(p, b.ts), kSpanLive, b.size, true);
}

void new_peak(Process& p, uint64_t ts) {
  p.s.peak_in_use_bytes = p.s.in_use_bytes;
  p.s.peak_ts = ts;
  // Amortized O(1): a stack enters the list once per change after a peak.
  for (StackAllocs* sa : p.peak_dirty) {
    sa->peak_bytes = sa->live_bytes;
    sa->peak_blocks = sa->live_blocks;
    sa->peak_dirty = false;
  }
  p.peak_dirty.clear();
}

bool temporary_free(Process& p, uint32_t tid, uint64_t addr, uint64_t* prev) {
  uint64_t& last = last_alloc_of(p, tid);
  bool temporary = last && last == addr;
  if (prev) *prev = last;
  last = 0;
  return temporary;
}

void died(Process& p, StackAllocs& sa, const Block& b, uint64_t ts, bool temporary, bool known) {
  stack_live(p, sa, b.size, b.weight, false);
  auto& v = spans_of(p, sa, b.stack_id);
  uint16_t a = bucket(p, b.ts);
  span_add(v, a, kSpanLive, b.size, false);
  span_add(v, a, bucket(p, ts), b.size, true);
  if (!known) return;
  lifetime(p, b, ts, true);
  if (temporary) {
    sa.temporary++;
    p.s.temporary_allocs++;
  }
}

void revived(Process& p, StackAllocs& sa, const ParkedFree& f, uint32_t tid, uint64_t prev_last) {
  const Block& b = f.block;
  stack_live(p, sa, b.size, b.weight, true);
  auto& v = spans_of(p, sa, b.stack_id);
  uint16_t a = bucket(p, b.ts);
  span_add(v, a, bucket(p, f.ts), b.size, false);
  span_add(v, a, kSpanLive, b.size, true);
  lifetime(p, b, f.ts, false);
  if (f.temporary) {
    sa.temporary--;
    p.s.temporary_allocs--;
  }
  if (prev_last) last_alloc_of(p, tid) = prev_last;
}

void inherited(Process& c, uint64_t ts) {
  if (ts) start(c, ts);
  c.s.peak_ts = ts;
  for (auto& [addr, b] : c.live) {
    auto& sa = c.stack_allocs[b.stack_id];
    b.stack = &sa;  // the parent's, copied
    sa.live_bytes += b.size;
    sa.live_blocks += b.weight;
    sa.peak_bytes = sa.live_bytes;
    sa.peak_blocks = sa.live_blocks;
    span_add(spans_of(c, sa, b.stack_id), bucket(c, b.ts), kSpanLive, b.size, true);
  }
  if (ts) sample(c, ts);
}

void reset(Process& p) {
  p.stack_allocs.clear();
  p.peak_dirty.clear();
  p.last_alloc_by_tid.clear();
  p.cur_tid = 0;
  p.cur_tid_last = 0;
  p.lifetimes = Lifetimes{};
  p.timeline.clear();
  p.spans.clear();
  p.first_ts = p.last_ts = p.span_t0 = 0;
  p.timeline_step_ns = p.span_bucket_ns = 0;
}

}  // namespace memtrace::heap::analyses
