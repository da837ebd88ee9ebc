// Ended images: sealed when they end, merged by command name past a cap,
// and the raw stacks no live image needs any more dropped. What keeps the
// model's memory to live blocks and distinct call paths on a host where
// thousands of processes come and go (issue 17's soak: 23,000 compiler
// processes kept 17.9 M ASLR-distinct stacks and 23 M leaked blocks).
#include <algorithm>
#include <memory>
#include <thread>
#include <chrono>

#include "heap/heap_model.h"

namespace memtrace::heap {
namespace {

// Ended images merge by command name within one cgroup (a container's
// processes never fold into another's of the same name).
std::string group_key(const Process& p) { return p.cgroup.empty() ? p.comm : p.comm + '\0' + p.cgroup; }

constexpr uint64_t kSealedBit = 1ull << 63;
constexpr size_t kMergedPidsShown = 16;

uint64_t hash_locs(const std::vector<Loc>& locs, bool truncated) {
  uint64_t h = 0xcbf29ce484222325ull ^ truncated;
  for (const Loc& l : locs) {
    h = (h ^ l.module) * 0x100000001b3ull;
    h = (h ^ l.offset) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  return h | kSealedBit;
}

// The same map under the new ids; its nodes move over (no allocation per
// entry: a compiler's image has 200,000). Two ids that became one are summed.
template <class Map, class Add>
void rekey(Map& m, const std::unordered_map<uint64_t, uint64_t>& remap, Add add) {
  Map out;
  out.reserve(m.size());
  while (!m.empty()) {
    auto node = m.extract(m.begin());
    auto it = remap.find(node.key());
    if (it != remap.end()) node.key() = it->second;
    auto r = out.insert(std::move(node));
    if (!r.inserted) add(r.position->second, r.node.mapped());
  }
  m.swap(out);
}

void add_stack_allocs(StackAllocs& a, const StackAllocs& b) {
  a.allocs += b.allocs;
  a.bytes += b.bytes;
  a.temporary += b.temporary;
  a.live_bytes += b.live_bytes;
  a.live_blocks += b.live_blocks;
  a.peak_bytes += b.peak_bytes;
  a.peak_blocks += b.peak_blocks;
  a.untouched_blocks += b.untouched_blocks;
  a.python = a.python || b.python;
}

void add_site_faults(SiteFaults& a, const SiteFaults& b) {
  a.faults += b.faults;
  a.pages += b.pages;
  a.reads += b.reads;
  a.writes += b.writes;
}

void add_site_allocs(SiteAllocs& a, const SiteAllocs& b) {
  a.bytes += b.bytes;
  a.blocks += b.blocks;
  a.touched_blocks += b.touched_blocks;
}

// Two span lists of one stack that became one: concatenated, sorted by
// (alloc, free) bucket, equal buckets summed.
void add_spans(std::vector<Span>& a, const std::vector<Span>& b) {
  a.insert(a.end(), b.begin(), b.end());
  auto key = [](const Span& s) { return uint32_t(s.alloc_bucket) << 16 | s.free_bucket; };
  std::sort(a.begin(), a.end(), [&](const Span& x, const Span& y) { return key(x) < key(y); });
  size_t out = 0;
  for (size_t i = 0; i < a.size(); i++) {
    if (out && key(a[out - 1]) == key(a[i])) {
      a[out - 1].bytes += a[i].bytes;
      a[out - 1].count += a[i].count;
    } else {
      a[out++] = a[i];
    }
  }
  a.resize(out);
}

// c's memory is given back on another thread: freeing the blocks of a
// big image (a million nodes) took ~0.3 s of the drain thread's time.
template <class T>
void release(T& c) {
  if (c.size() < 4096) {
    T().swap(c);
    return;
  }
  auto gone = std::make_shared<T>();
  gone->swap(c);
  std::thread([gone]() mutable { gone.reset(); }).detach();
}

}  // namespace

uint64_t address_of(const Process& p, const Loc& l) {
  if (l.module == kPyModule) return kPyFrameTag | l.offset;
  auto it = std::lower_bound(p.bias.begin(), p.bias.end(), l.module,
                             [](const std::pair<uint32_t, uint64_t>& b, uint32_t m) { return b.first < m; });
  return it != p.bias.end() && it->first == l.module ? it->second + l.offset : l.offset;
}

size_t trusted_frames(size_t n, const std::function<FrameTrust(size_t)>& trust) {
  for (size_t i = 1; i < n; i++) {
    FrameTrust t = trust(i);
    if (t == FrameTrust::Good) continue;
    if (t == FrameTrust::Unmapped) {
      size_t j = i + 1;
      while (j < n && trust(j) == FrameTrust::Unmapped) j++;
      if (j < n && trust(j) == FrameTrust::Good) {
        i = j;
        continue;
      }
    }
    return i;
  }
  return n;
}

void HeapModel::set_locator(Locator l, bool keep_blocks) {
  locator_ = std::move(l);
  keep_blocks_ = keep_blocks;
}

// The sealed id of these frames; a copy is made only for frames not seen
// before (most stacks of a program's second run are its first run's).
uint64_t HeapModel::intern(const std::vector<Loc>& locs, bool truncated) {
  uint64_t id = hash_locs(locs, truncated);
  for (;;) {
    auto it = sealed_.find(id);
    if (it == sealed_.end()) {
      Stack& s = sealed_[id];
      s.sealed = true;
      s.truncated = truncated;
      s.locs = locs;
      return id;
    }
    if (it->second.locs == locs && it->second.truncated == truncated) return id;
    id = (id + 1) | kSealedBit;  // another stack with this hash: the next free id
  }
}

// Sealing one image, in steps: a compiler's image (200,000 stacks) takes
// ~1 s in all, which the drain must not wait for at once. Between steps the
// image is in ended_, not sealed yet; nothing reads its stacks until it is
// (finish_seals before a report), and nothing else changes it.
struct HeapModel::SealJob {
  Process* p = nullptr;
  int stage = 0;
  ImageMap map;
  std::vector<uint64_t> bias;  // per range: its bias, once a frame used it
  std::unordered_map<uint64_t, uint64_t> remap;  // raw id -> sealed id
  std::vector<uint64_t> ids;   // raw ids to seal
  size_t next = 0;
  std::unordered_map<uint64_t, StackAllocs> stack_allocs;  // rekeyed so far
  std::unordered_map<uint64_t, std::vector<Span>> spans;
  AddrMap<Block>::iterator live_at;
  std::vector<Loc> locs;  // one stack's, reused
  uint64_t ns = 0;
};

// One step of j until the deadline (checked every few hundred items):
// true once j's image is sealed.
bool HeapModel::seal_step(SealJob& j, std::chrono::steady_clock::time_point deadline) {
  Process& p = *j.p;
  constexpr size_t kChunk = 256;
  auto late = [&] { return std::chrono::steady_clock::now() >= deadline; };
  switch (j.stage) {
    case 0:  // what to seal (j.map: taken when the image ended, while the loader knew its mappings)
      j.bias.assign(j.map.ranges.size(), ~uint64_t{0});
      j.ids.reserve(p.stack_allocs.size() + p.fault_stacks.size() + p.alloc_sites.size());
      for (const auto& [id, sa] : p.stack_allocs) j.ids.push_back(id);  // every live block's stack too
      for (const auto& [id, sf] : p.fault_stacks) j.ids.push_back(id);
      for (const auto& [id, sa] : p.alloc_sites) j.ids.push_back(id);
      j.remap.reserve(j.ids.size());
      j.stage = 1;
      [[fallthrough]];
    case 1: {  // each raw stack as locations, interned
      // Every frame is a return address: the mapping is the call's (ip - 1).
      auto locate = [&](uint64_t ip) {
        if (ip & kPyFrameTag) return Loc{kPyModule, ip & ~kPyFrameTag};
        uint64_t pc = ip ? ip - 1 : 0;
        auto r = std::upper_bound(j.map.ranges.begin(), j.map.ranges.end(), pc,
                                  [](uint64_t a, const ImageRange& x) { return a < x.start; });
        if (r == j.map.ranges.begin() || pc >= (--r)->end)
          return j.map.jit_module ? Loc{j.map.jit_module, ip} : Loc{j.map.unknown, 0};
        j.bias[r - j.map.ranges.begin()] = r->bias;
        return Loc{r->module, ip - r->bias};
      };
      while (j.next < j.ids.size()) {
        for (size_t end = std::min(j.ids.size(), j.next + kChunk); j.next < end; j.next++) {
          uint64_t raw = j.ids[j.next];
          if (!raw) continue;
          auto [it, fresh] = j.remap.try_emplace(raw, raw);
          if (!fresh) continue;
          const Stack* st = stack(raw);
          if (!st || st->sealed) continue;  // never received (counted as missing): stays as it was
          j.locs.clear();
          for (uint64_t ip : st->ips) j.locs.push_back(locate(ip));
          bool truncated = st->truncated;
          // The first frame is the probe's own (its return address read at
          // the entry, or the ip); a later one that is no return address
          // ends what can be trusted.
          if (!j.map.ranges.empty()) {
            size_t keep = trusted_frames(j.locs.size(), [&](size_t i) {
              const Loc& l = j.locs[i];
              if (l.module == kPyModule) return FrameTrust::Good;
              if (l.module == j.map.unknown || (j.map.jit_module && l.module == j.map.jit_module))
                return j.map.jit ? FrameTrust::Good : FrameTrust::Unmapped;
              return j.map.follows_call && !j.map.follows_call(l) ? FrameTrust::Bad : FrameTrust::Good;
            });
            if (keep < j.locs.size()) {
              j.locs.resize(keep);
              truncated = true;
            }
          }
          it->second = intern(j.locs, truncated);
        }
        if (late()) return false;
      }
      release(j.ids);
      // Per-block state first (its StackAllocs pointers die with the rekey).
      for (auto& sa : p.peak_dirty) sa->peak_dirty = false;
      release(p.peak_dirty);
      j.live_at = p.live.begin();
      j.stage = 2;
      [[fallthrough]];
    }
    case 2:  // blocks no fault touched, by stack (--faults)
      while (faults_ && j.live_at != p.live.end()) {
        for (size_t n = 0; n < kChunk && j.live_at != p.live.end(); n++, ++j.live_at)
          if (!j.live_at->second.touched)
            if (auto it = p.stack_allocs.find(j.live_at->second.stack_id); it != p.stack_allocs.end())
              it->second.untouched_blocks++;
        if (late()) return false;
      }
      j.stack_allocs.reserve(p.stack_allocs.size());
      j.stage = 3;
      [[fallthrough]];
    case 3:  // stacks under their sealed ids (nodes move over: no allocation each)
      while (!p.stack_allocs.empty()) {
        for (size_t n = 0; n < kChunk && !p.stack_allocs.empty(); n++) {
          auto node = p.stack_allocs.extract(p.stack_allocs.begin());
          node.mapped().spans = nullptr;
          if (auto it = j.remap.find(node.key()); it != j.remap.end()) node.key() = it->second;
          auto r = j.stack_allocs.insert(std::move(node));
          if (!r.inserted) add_stack_allocs(r.position->second, r.node.mapped());
        }
        if (late()) return false;
      }
      j.spans.reserve(p.spans.size());
      j.stage = 4;
      [[fallthrough]];
    case 4:
      while (!p.spans.empty()) {
        for (size_t n = 0; n < kChunk && !p.spans.empty(); n++) {
          auto node = p.spans.extract(p.spans.begin());
          if (auto it = j.remap.find(node.key()); it != j.remap.end()) node.key() = it->second;
          auto r = j.spans.insert(std::move(node));
          if (!r.inserted) add_spans(r.position->second, r.node.mapped());
        }
        if (late()) return false;
      }
      break;
  }
  // The rest is small (or given back on another thread).
  p.stack_allocs.swap(j.stack_allocs);
  p.spans.swap(j.spans);
  rekey(p.fault_stacks, j.remap, add_site_faults);
  rekey(p.alloc_sites, j.remap, add_site_allocs);
  if (keep_blocks_) {
    for (auto& [addr, b] : p.live) {
      if (auto it = j.remap.find(b.stack_id); it != j.remap.end()) b.stack_id = it->second;
      b.stack = nullptr;
    }
  } else {
    release(p.live);
  }
  release(p.live_index);
  release(p.touched);
  release(p.maps);
  release(p.last_alloc_by_tid);
  release(p.realloc_parked);
  release(j.remap);
  p.cur_tid = 0;
  p.cur_tid_last = 0;
  p.bias.clear();
  for (size_t i = 0; i < j.bias.size(); i++)
    if (j.bias[i] != ~uint64_t{0}) p.bias.emplace_back(j.map.ranges[i].module, j.bias[i]);
  std::sort(p.bias.begin(), p.bias.end());
  p.bias.erase(std::unique(p.bias.begin(), p.bias.end(),
                           [](const auto& a, const auto& b) { return a.first == b.first; }),
               p.bias.end());
  p.sealed = true;
  return true;
}

// Here, where SealJob is complete.
HeapModel::HeapModel() { stacks_.reserve(1 << 14); }
HeapModel::~HeapModel() = default;

void HeapModel::seal_some(std::chrono::steady_clock::duration budget) {
  auto start = std::chrono::steady_clock::now(), deadline = start + budget;
  while (!sealing_.empty()) {
    SealJob& j = *sealing_.front();
    auto t0 = std::chrono::steady_clock::now();
    bool done = seal_step(j, deadline);
    uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    j.ns += ns;
    seal_stats_.total_ns += ns;
    seal_stats_.max_step_ns = std::max(seal_stats_.max_step_ns, ns);
    if (!done) break;
    seal_stats_.images++;
    seal_stats_.max_ns = std::max(seal_stats_.max_ns, j.ns);
    Process& p = *j.p;
    sealing_.pop_front();
    individual_ended_++;
    individual_entries_ += p.stack_allocs.size();
    Kept& k = kept_[group_key(p)];
    k.images.push_back(&p);
    k.entries += p.stack_allocs.size();
    while ((image_cap_ && individual_ended_ > image_cap_) || (entry_cap_ && individual_entries_ > entry_cap_))
      if (!merge_one(individual_entries_ > entry_cap_ && entry_cap_)) break;
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
}

void HeapModel::finish_seals() {
  while (!sealing_.empty()) seal_some(std::chrono::hours(1));
}

void HeapModel::ended(std::unique_ptr<Process> p) {
  if (!locator_) {
    ended_.push_back(std::move(p));
    return;
  }
  auto j = std::make_unique<SealJob>();
  j->p = p.get();
  j->map = locator_(*p);  // now: the loader forgets a gone process's mappings
  ended_.push_back(std::move(p));
  sealing_.push_back(std::move(j));
  // Small images at once (the most of them: a shell, a compiler driver);
  // big ones in steps between drains (seal_some).
  if (sealing_.size() == 1 && ended_.back()->stack_allocs.size() < 2048) seal_some(std::chrono::hours(1));
}

// The command name with the most images kept one by one (by_entries: the
// most per-stack entries in them) gives its oldest to its merged entry.
bool HeapModel::merge_one(bool by_entries) {
  auto most = kept_.end();
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    size_t n = by_entries ? it->second.entries : it->second.images.size();
    if (n && (most == kept_.end() || n > (by_entries ? most->second.entries : most->second.images.size()))) most = it;
  }
  if (most == kept_.end()) return false;
  Process* img = most->second.images.front();
  most->second.images.pop_front();
  most->second.entries -= img->stack_allocs.size();
  auto& group = groups_[group_key(*img)];
  if (!group) {
    group = std::make_unique<Process>();
    group->comm = img->comm;
    group->cgroup = img->cgroup;
    group->sealed = true;
    group->exited = true;
    group->pid = img->pid;
  }
  merge_into(*group, *img);
  individual_entries_ -= img->stack_allocs.size();
  individual_ended_--;
  merged_total_++;
  if (most->second.images.empty()) kept_.erase(most);
  ended_.erase(std::find_if(ended_.begin(), ended_.end(), [&](const auto& e) { return e.get() == img; }));
  return true;
}

void HeapModel::merge_into(Process& g, Process& img) {
  Summary& a = g.s;
  const Summary& b = img.s;
  if (b.peak_in_use_bytes > a.peak_in_use_bytes || !g.merged) {  // the largest member's peak
    for (auto& [id, sa] : g.stack_allocs) sa.peak_bytes = sa.peak_blocks = 0;
    for (const auto& [id, sa] : img.stack_allocs) {
      auto& ga = g.stack_allocs[id];
      ga.peak_bytes = sa.peak_bytes;
      ga.peak_blocks = sa.peak_blocks;
    }
    a.peak_in_use_bytes = b.peak_in_use_bytes;
    a.peak_ts = b.peak_ts;
  }
  for (const auto& [id, sa] : img.stack_allocs) {
    StackAllocs add = sa;
    add.peak_bytes = add.peak_blocks = 0;
    add_stack_allocs(g.stack_allocs[id], add);
  }
  a.allocs += b.allocs;
  a.frees += b.frees;
  a.bytes_allocated += b.bytes_allocated;
  a.in_use_bytes += b.in_use_bytes;
  a.in_use_blocks += b.in_use_blocks;
  a.failed_allocs += b.failed_allocs;
  a.mmap_bytes_allocator += b.mmap_bytes_allocator;
  a.mmap_bytes_direct += b.mmap_bytes_direct;
  a.mapped_now_allocator += b.mapped_now_allocator;
  a.mapped_now_direct += b.mapped_now_direct;
  a.mmap_calls += b.mmap_calls;
  a.munmap_calls += b.munmap_calls;
  a.mremap_calls += b.mremap_calls;
  a.brk_calls += b.brk_calls;
  // The reports show brk_now - brk_start: the sum of the members' brk heaps.
  a.brk_start = 0;
  a.brk_now += b.brk_now > b.brk_start ? b.brk_now - b.brk_start : 0;
  a.unknown_frees += b.unknown_frees;
  a.inherited_blocks += b.inherited_blocks;
  a.temporary_allocs += b.temporary_allocs;
  a.python.allocs += b.python.allocs;
  a.python.frees += b.python.frees;
  a.python.bytes_allocated += b.python.bytes_allocated;
  a.python.in_use_bytes += b.python.in_use_bytes;
  a.python.in_use_blocks += b.python.in_use_blocks;
  a.python.peak_in_use_bytes = std::max(a.python.peak_in_use_bytes, b.python.peak_in_use_bytes);
  a.python.failed_allocs += b.python.failed_allocs;
  a.python.unknown_frees += b.python.unknown_frees;
  for (size_t i = 0; i < g.lifetimes.freed.size(); i++) {
    g.lifetimes.freed[i] += img.lifetimes.freed[i];
    g.lifetimes.freed_bytes[i] += img.lifetimes.freed_bytes[i];
  }
  g.lifetimes.live_at_end += img.lifetimes.live_at_end;
  // Time: the span from the first member's start to the last one's end
  // (rates per second over it); no timeline or spans (each member has its own clock).
  if (img.first_ts && (!g.first_ts || img.first_ts < g.first_ts)) g.first_ts = img.first_ts;
  g.last_ts = std::max(g.last_ts, img.last_ts);
  g.f.total += img.f.total;
  g.f.read += img.f.read;
  g.f.write += img.f.write;
  g.f.instr += img.f.instr;
  g.f.pages_first_touched += img.f.pages_first_touched;
  g.f.access_errors += img.f.access_errors;
  for (const auto& [id, sf] : img.fault_stacks) {
    auto [it, fresh] = g.fault_stacks.try_emplace(id, sf);
    if (!fresh) add_site_faults(it->second, sf);
  }
  for (const auto& [label, sf] : img.fault_regions) {
    auto [it, fresh] = g.fault_regions.try_emplace(label, sf);
    if (!fresh) add_site_faults(it->second, sf);
  }
  for (const auto& [id, sa] : img.alloc_sites) {
    auto [it, fresh] = g.alloc_sites.try_emplace(id, sa);
    if (!fresh) add_site_allocs(it->second, sa);
  }
  for (const auto& b : img.bias) {  // modules the earlier members did not map
    auto it = std::lower_bound(g.bias.begin(), g.bias.end(), b);
    if (it == g.bias.end() || it->first != b.first) g.bias.insert(it, b);
  }
  if (g.merged_pids.size() < kMergedPidsShown) g.merged_pids.push_back(img.pid);
  g.merged++;
}

bool HeapModel::retire(pid_t pid, bool keep_idle) {
  auto it = procs_.find(pid);
  if (it == procs_.end() || !it->second->exited) return false;
  std::unique_ptr<Process> p = std::move(it->second);
  procs_.erase(it);
  last_ = nullptr;
  if (!p->prelude && (active(*p) || keep_idle)) ended(std::move(p));
  return true;
}

std::vector<uint64_t> HeapModel::collect_stacks() {
  graveyard_.clear();  // the last round's: records that could still name them are long applied
  std::vector<uint64_t> used;  // sorted below: no allocation per id
  auto mark = [&](const Process& p) {
    if (p.sealed) return;
    for (const auto& [id, sa] : p.stack_allocs) used.push_back(id);
    for (const auto& [id, sf] : p.fault_stacks) used.push_back(id);
    for (const auto& [id, sa] : p.alloc_sites) used.push_back(id);
    for (const auto& [addr, b] : p.live) used.push_back(b.stack_id);
    for (const auto& [addr, m] : p.maps) used.push_back(m.stack_id);
    for (const auto& [tid, pf] : p.realloc_parked) used.push_back(pf.block.stack_id);
  };
  for (const auto& [pid, p] : procs_) mark(*p);
  for (const auto& p : ended_) mark(*p);
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  std::vector<uint64_t> dropped;
  for (auto it = stacks_.begin(); it != stacks_.end();) {
    if (std::binary_search(used.begin(), used.end(), it->first)) {
      ++it;
      continue;
    }
    dropped.push_back(it->first);
    graveyard_.insert(stacks_.extract(it++));
  }
  return dropped;
}

}  // namespace memtrace::heap
