#include "heap/heap_model.h"

#include <algorithm>
#include <cmath>

#include "heap/analyses.h"
#include <cstring>

namespace memtrace::heap {


// The allocation stack's counters of block b of p.
static StackAllocs& stack_of(Process& p, const Block& b) {
  return b.stack ? *b.stack : p.stack_allocs[b.stack_id];
}

Process& HeapModel::process(pid_t pid) {
  if (last_ && last_->pid == pid) return *last_;
  auto& slot = procs_[pid];
  if (!slot) {
    slot = std::make_unique<Process>();
    slot->pid = pid;
  }
  last_ = slot.get();
  return *slot;
}

Process* HeapModel::find(pid_t pid) {
  auto it = procs_.find(pid);
  return it == procs_.end() ? nullptr : it->second.get();
}

const Process* HeapModel::find(pid_t pid) const {
  auto it = procs_.find(pid);
  return it == procs_.end() ? nullptr : it->second.get();
}

const Stack* HeapModel::stack(uint64_t id) const {
  for (const auto* m : {&stacks_, &sealed_, &graveyard_})
    if (auto it = m->find(id); it != m->end()) return &it->second;
  return nullptr;
}

void HeapModel::apply(const void* data, size_t len) {
  if (len < sizeof(mt_hdr)) {
    malformed_++;
    return;
  }
  mt_hdr h;
  memcpy(&h, data, sizeof(h));
  events_++;
  if (h.kind == MT_EV_STACK) {
    // Variable-size: the header and nr frames (MT_STACK_BYTES(nr)); a
    // recording of an older build may carry the whole fixed-size record.
    static_assert(offsetof(mt_stack, ips) == MT_STACK_HDR_BYTES);
    const auto* p = static_cast<const char*>(data);
    if (len < MT_STACK_HDR_BYTES) {
      malformed_++;
      return;
    }
    uint64_t id;
    uint32_t nr;
    memcpy(&id, p + offsetof(mt_stack, stack_id), sizeof id);
    memcpy(&nr, p + offsetof(mt_stack, nr), sizeof nr);
    if (nr > MT_MAX_FRAMES || len < MT_STACK_BYTES(size_t{nr})) {
      malformed_++;
      return;
    }
    if (stacks_.count(id)) return;
    Stack st;
    st.ips.resize(nr);
    if (nr) memcpy(st.ips.data(), p + MT_STACK_HDR_BYTES, size_t{nr} * sizeof(uint64_t));  // (no frames: data() may be null)
    st.truncated = h.flags & MT_F_STACK_TRUNCATED;
    stacks_.emplace(id, std::move(st));
    return;
  }
  if (len < sizeof(mt_event)) {
    malformed_++;
    return;
  }
  const auto& e = *static_cast<const mt_event*>(data);
  Process& p = process(e.h.pid);
  if (e.stack_id && !stacks_.count(e.stack_id)) {
    // Dropped by collect_stacks while this record was queued: back it comes.
    if (auto g = graveyard_.find(e.stack_id); g != graveyard_.end()) {
      stacks_.insert(std::move(*g));
      graveyard_.erase(g);
    } else {
      missing_stacks_++;
    }
  }
  analyses::on_record(p, e.h.ts);
  switch (e.h.kind) {
    case MT_EV_ALLOC:
      alloc(p, e);
      break;
    case MT_EV_FREE:
      free_block(p, e);
      break;
    case MT_EV_ALLOC_FAIL:
      p.s.failed_allocs++;
      if (MT_ROLE_IS_PY(e.role)) p.s.python.failed_allocs++;
      break;
    case MT_EV_REALLOC_FAIL: {
      // realloc(p, n) failed: p never died. Undo the free counted at entry.
      p.s.failed_allocs++;
      if (MT_ROLE_IS_PY(e.role)) p.s.python.failed_allocs++;
      auto it = p.realloc_parked.find(e.h.tid);
      if (it != p.realloc_parked.end() && it->second.addr == e.addr) {
        const Block& b = it->second.block;
        p.live.emplace(e.addr, b);
        if (faults_) index_add(p, e.addr, b.size);
        p.s.in_use_bytes += b.size;
        p.s.in_use_blocks += b.weight;
        p.s.frees -= b.weight;
        if (b.py) {
          p.s.python.in_use_bytes += b.size;
          p.s.python.in_use_blocks += b.weight;
          p.s.python.frees -= b.weight;
        }
        analyses::revived(p, stack_of(p, b), it->second, e.h.tid, it->second.prev_last);
        p.realloc_parked.erase(it);
      }
      break;
    }
    case MT_EV_MMAP:
      mmap(p, e);
      break;
    case MT_EV_MUNMAP:
      p.s.munmap_calls++;
      munmap(p, e.addr, e.size);
      break;
    case MT_EV_MREMAP: {
      p.s.mremap_calls++;
      Mapping m;
      auto it = p.maps.find(e.old_addr);
      if (it != p.maps.end()) m = it->second;
      else m.allocator = e.h.flags & MT_F_ALLOCATOR_INTERNAL;
      munmap(p, e.old_addr, e.old_size);
      if (e.size > e.old_size) {
        (m.allocator ? p.s.mmap_bytes_allocator : p.s.mmap_bytes_direct) += e.size - e.old_size;
      }
      m.len = e.size;
      (m.allocator ? p.s.mapped_now_allocator : p.s.mapped_now_direct) += e.size;
      p.maps[e.addr] = m;
      break;
    }
    case MT_EV_BRK:
      p.s.brk_calls++;
      if (!p.s.brk_start) p.s.brk_start = e.addr;
      if (faults_ && e.addr < p.s.brk_now) forget_pages(p, e.addr, p.s.brk_now - e.addr);
      p.s.brk_now = e.addr;
      break;
    case MT_EV_FAULT:
      fault(p, e);
      break;
    case MT_EV_EXEC:
      if (e.h.flags & MT_F_EXEC_UNTRACED) end_image(e.h.pid);
      else on_exec(e.h.pid, e.addr);  // addr: the exec's time, also in its lifecycle record
      break;
    case MT_EV_FORK:
      on_fork(e.h.pid, static_cast<pid_t>(e.addr));
      break;
    default:
      malformed_++;
      return;
  }
  // The exec and fork records are about other images: p may be one that ended.
  if (e.h.kind != MT_EV_EXEC && e.h.kind != MT_EV_FORK) analyses::sample(p, e.h.ts);
}

void HeapModel::alloc(Process& p, const mt_event& e) {
  if (e.old_addr) p.realloc_parked.erase(e.h.tid);  // realloc succeeded
  uint64_t size = e.size, weight = 1;
  if (sample_bytes_ && e.size) {
    // A sample of probability 1 - exp(-s/N): it stands for 1/that blocks
    // (the count rounded up with its fraction's probability, so unbiased).
    double w = -1.0 / std::expm1(-static_cast<double>(e.size) / static_cast<double>(sample_bytes_));
    weight_rng_ ^= weight_rng_ << 13;
    weight_rng_ ^= weight_rng_ >> 7;
    weight_rng_ ^= weight_rng_ << 17;
    double u = static_cast<double>(weight_rng_ >> 11) * (1.0 / 9007199254740992.0);
    weight = static_cast<uint64_t>(w) + (u < w - std::floor(w) ? 1 : 0);
    size = static_cast<uint64_t>(std::llround(static_cast<double>(e.size) * w));
  }
  p.s.allocs += weight;
  p.s.bytes_allocated += size;
  auto& sa = p.stack_allocs[e.stack_id];
  sa.allocs += weight;
  sa.bytes += size;
  const bool py = MT_ROLE_IS_PY(e.role);
  sa.python = py;
  Block b{size, e.stack_id, e.h.ts, false, py, &sa, weight};
  auto [it, inserted] = p.live.try_emplace(e.addr, b);
  if (!inserted) {
    // A block we believe is live was handed out again: its free was lost.
    p.s.in_use_bytes -= it->second.size;
    p.s.in_use_blocks -= it->second.weight;
    if (it->second.py) {
      p.s.python.in_use_bytes -= it->second.size;
      p.s.python.in_use_blocks -= it->second.weight;
    }
    analyses::died(p, stack_of(p, it->second), it->second, e.h.ts, false, /*known=*/false);
    it->second = b;
  }
  if (faults_) {
    index_add(p, e.addr, e.size);
    auto& site = p.alloc_sites[e.stack_id];
    site.bytes += e.size;
    site.blocks++;
  }
  p.s.in_use_bytes += size;
  p.s.in_use_blocks += weight;
  if (py) {
    DomainSummary& d = p.s.python;
    d.allocs += weight;
    d.bytes_allocated += size;
    d.in_use_bytes += size;
    d.in_use_blocks += weight;
    if (d.in_use_bytes > d.peak_in_use_bytes) d.peak_in_use_bytes = d.in_use_bytes;
  }
  analyses::born(p, sa, e.addr, b, e.h.tid);
  if (p.s.in_use_bytes > p.s.peak_in_use_bytes) analyses::new_peak(p, e.h.ts);
}

void HeapModel::free_block(Process& p, const mt_event& e) {
  uint64_t prev_last = 0;
  bool temporary = analyses::temporary_free(p, e.h.tid, e.addr, &prev_last);
  auto it = p.live.find(e.addr);
  if (it == p.live.end()) {
    p.s.unknown_frees++;
    if (MT_ROLE_IS_PY(e.role)) p.s.python.unknown_frees++;
    return;
  }
  p.s.frees += it->second.weight;
  p.s.in_use_bytes -= it->second.size;
  p.s.in_use_blocks -= it->second.weight;
  if (it->second.py) {  // the block's domain, whichever function freed it
    p.s.python.frees += it->second.weight;
    p.s.python.in_use_bytes -= it->second.size;
    p.s.python.in_use_blocks -= it->second.weight;
  }
  analyses::died(p, stack_of(p, it->second), it->second, e.h.ts, temporary);
  if (e.role == MT_ROLE_REALLOC || e.role == MT_ROLE_REALLOCARRAY || e.role == MT_ROLE_PY_REALLOC)
    p.realloc_parked[e.h.tid] = ParkedFree{e.addr, it->second, e.h.ts, temporary, prev_last};
  p.live.erase(it);
  if (faults_) index_del(p, e.addr);
}

void HeapModel::mmap(Process& p, const mt_event& e) {
  p.s.mmap_calls++;
  Mapping m;
  m.len = e.size;
  m.stack_id = e.stack_id;
  m.allocator = e.h.flags & MT_F_ALLOCATOR_INTERNAL;
  m.file = static_cast<int32_t>(e.aux) >= 0;
  m.prot = e.old_size >> 32;
  m.flags = static_cast<uint32_t>(e.old_size);
  // MAP_FIXED over existing mappings replaces them.
  munmap(p, e.addr, e.size);
  (m.allocator ? p.s.mmap_bytes_allocator : p.s.mmap_bytes_direct) += e.size;
  (m.allocator ? p.s.mapped_now_allocator : p.s.mapped_now_direct) += e.size;
  if (faults_ && !m.allocator && !m.file && m.stack_id) {
    auto& site = p.alloc_sites[m.stack_id];
    site.bytes += e.size;
    site.blocks++;
  }
  p.maps[e.addr] = std::move(m);
}

void HeapModel::munmap(Process& p, uint64_t addr, uint64_t len) {
  if (!len) return;
  if (faults_) forget_pages(p, addr, len);
  uint64_t end = addr + len;
  auto it = p.maps.upper_bound(addr);
  if (it != p.maps.begin()) --it;
  while (it != p.maps.end() && it->first < end) {
    uint64_t s = it->first, e = s + it->second.len;
    if (e <= addr) {
      ++it;
      continue;
    }
    Mapping m = it->second;
    it = p.maps.erase(it);
    uint64_t cut_lo = std::max(s, addr), cut_hi = std::min(e, end);
    (m.allocator ? p.s.mapped_now_allocator : p.s.mapped_now_direct) -= cut_hi - cut_lo;
    if (s < cut_lo) {
      Mapping left = m;
      left.len = cut_lo - s;
      p.maps[s] = left;
    }
    if (cut_hi < e) {
      Mapping right = m;
      right.len = e - cut_hi;
      it = p.maps.emplace(cut_hi, right).first;
      ++it;
    }
  }
}

bool active(const Process& p) {
  return p.s.allocs || p.s.frees || p.s.in_use_blocks || p.s.failed_allocs || p.s.mmap_calls ||
         p.s.unknown_frees || p.f.total;
}

// Did the image do anything itself (not only inherit its parent's blocks)?
// A fork's child that exec's at once (every shell command) is not an image
// of its own in the reports.
static bool own_activity(const Process& p) {
  return !p.prelude && (p.s.allocs || p.s.frees || p.s.failed_allocs || p.s.mmap_calls || p.s.unknown_frees || p.f.total);
}

Process& HeapModel::fresh(pid_t pid) {
  auto& slot = procs_[pid];
  if (slot && own_activity(*slot)) ended(std::move(slot));
  slot = std::make_unique<Process>();
  slot->pid = pid;
  last_ = slot.get();
  return *slot;
}

std::vector<const Process*> HeapModel::images() const {
  std::vector<const Process*> v;
  v.reserve(procs_.size() + ended_.size() + groups_.size());
  for (const auto& p : ended_) v.push_back(p.get());
  for (const auto& [comm, g] : groups_) v.push_back(g.get());
  for (const auto& [pid, p] : procs_) v.push_back(p.get());
  // ended_ is in the order images ended: by pid, then that order, then the current one.
  std::stable_sort(v.begin(), v.end(), [](const Process* a, const Process* b) { return a->pid < b->pid; });
  return v;
}

void HeapModel::on_fork(pid_t parent, pid_t child) {
  if (parent == child) return;  // not a fork (a corrupt record): would copy a process into itself
  if (Process* c = find(child); c && c->from_fork && c->ppid == parent && !c->exited) return;  // seen already
  Process* pp = find(parent);
  // A pid seen before belongs to a process that is gone (the pid was reused).
  Process& c = find(child) ? fresh(child) : process(child);
  c.ppid = parent;
  c.from_fork = true;
  if (!pp) return;
  c.comm = pp->comm;
  c.cgroup = pp->cgroup;
  c.live = pp->live;
  c.maps = pp->maps;
  if (faults_) c.live_index = pp->live_index;
  c.s.in_use_bytes = pp->s.in_use_bytes;
  c.s.in_use_blocks = pp->s.in_use_blocks;
  c.s.peak_in_use_bytes = pp->s.in_use_bytes;
  c.s.inherited_blocks = pp->s.in_use_blocks;
  c.s.python.in_use_bytes = c.s.python.peak_in_use_bytes = pp->s.python.in_use_bytes;
  c.s.python.in_use_blocks = pp->s.python.in_use_blocks;
  c.s.mapped_now_allocator = pp->s.mapped_now_allocator;
  c.s.mapped_now_direct = pp->s.mapped_now_direct;
  analyses::inherited(c, pp->last_ts);
}

void HeapModel::on_exit(pid_t pid, int code) {
  Process& p = process(pid);
  p.exited = true;
  if (!p.exit_code) p.exit_code = code;
}

void HeapModel::on_exec(pid_t pid, uint64_t ts) {
  Process* old = find(pid);
  if (old && ts && old->exec_ts == ts) return;  // this exec started the current image already
  pid_t ppid = old ? old->ppid : 0;
  uint32_t n = old ? old->exec_count + 1 : 1;
  uint32_t image = old && own_activity(*old) ? old->image + 1 : old ? old->image : 0;
  std::string comm = old ? old->comm : "";
  std::string cgroup = old ? old->cgroup : "";
  if (old) old->ended_by_exec = true;
  Process& p = fresh(pid);
  p.ppid = ppid;
  p.comm = comm;  // until the caller names the new image
  p.cgroup = std::move(cgroup);
  p.exec_ts = ts;
  p.exec_count = n;
  p.image = image;
}

void HeapModel::end_image(pid_t pid) {
  auto it = procs_.find(pid);
  if (it == procs_.end()) return;
  it->second->ended_by_exec = true;
  if (own_activity(*it->second)) ended(std::move(it->second));
  procs_.erase(it);
  last_ = nullptr;
}

void HeapModel::clear(pid_t pid) {
  Process& p = process(pid);
  p.live.clear();
  p.live_index.clear();
  p.realloc_parked.clear();
  p.f = FaultCounts{};
  p.fault_stacks.clear();
  p.fault_regions.clear();
  p.alloc_sites.clear();
  analyses::reset(p);
  Summary fresh;
  fresh.brk_start = p.s.brk_start;
  fresh.brk_now = p.s.brk_now;
  p.s = fresh;
}

// ---------------------------------------------------------------- page faults

const char* to_string(Hit h) {
  switch (h) {
    case Hit::Block: return "block";
    case Hit::Mmap: return "mmap";
    case Hit::AllocatorMap: return "allocator";
    case Hit::Heap: return "heap";
    case Hit::Stack: return "stack";
    case Hit::ThreadStack: return "thread_stack";
    case Hit::File: return "file";
    case Hit::Anon: return "anon";
    case Hit::Other: return "other";
    case Hit::Unmapped: return "unmapped";
  }
  return "?";
}

std::string region_label(const FaultHit& h) {
  switch (h.kind) {
    case Hit::Heap: return "[heap]";
    case Hit::Stack: return "[stack]";
    case Hit::ThreadStack: return "[thread stack]";
    case Hit::File: return h.path.empty() ? "file (path unknown)" : h.path;
    case Hit::AllocatorMap: return "[allocator mmap, outside live blocks]";
    case Hit::Mmap: return "[mmap]";
    case Hit::Anon: return h.path.empty() ? "[anon]" : "[anon " + h.path + "]";
    case Hit::Other: return h.path.empty() ? "[other]" : h.path;
    case Hit::Unmapped: return "[unmapped]";
    case Hit::Block: return "[block]";
  }
  return "?";
}

void HeapModel::enable_faults(RegionLookup lookup, FaultObserver observer) {
  faults_ = true;
  lookup_ = std::move(lookup);
  observer_ = std::move(observer);
  for (auto& [pid, p] : procs_)
    for (const auto& [a, b] : p->live) index_add(*p, a, b.size);
}

void HeapModel::index_add(Process& p, uint64_t addr, uint64_t size) { p.live_index[addr] = addr + size; }
void HeapModel::index_del(Process& p, uint64_t addr) { p.live_index.erase(addr); }

void HeapModel::forget_pages(Process& p, uint64_t addr, uint64_t len) {
  uint64_t lo = addr & ~4095ull, hi = (addr + len + 4095) & ~4095ull;
  p.touched.erase(p.touched.lower_bound(lo), p.touched.lower_bound(hi));
}

FaultHit HeapModel::attribute(Process& p, uint64_t addr, uint64_t ts) {
  FaultHit h;
  // 1. A live block (the allocation it belongs to).
  auto bi = p.live_index.upper_bound(addr);
  if (bi != p.live_index.begin()) {
    --bi;
    if (addr < bi->second) {
      auto lb = p.live.find(bi->first);
      if (lb != p.live.end()) {
        h.kind = Hit::Block;
        h.start = bi->first;
        h.end = bi->second;
        h.stack_id = lb->second.stack_id;
        return h;
      }
    }
  }
  // 2. A mapping seen while tracing.
  auto mi = p.maps.upper_bound(addr);
  if (mi != p.maps.begin()) {
    --mi;
    Mapping& m = mi->second;
    if (addr < mi->first + m.len) {
      h.start = mi->first;
      h.end = mi->first + m.len;
      h.stack_id = m.stack_id;
      if (m.file) {
        h.kind = Hit::File;
        if (m.path.empty() && lookup_)
          if (auto r = lookup_(p.pid, addr, ts); r && !r->path.empty()) m.path = r->path;
        h.path = m.path;
      } else if (m.allocator) {
        h.kind = Hit::AllocatorMap;
      } else if (m.flags & 0x20000 /* MAP_STACK */) {
        h.kind = Hit::ThreadStack;
      } else {
        h.kind = Hit::Mmap;
      }
      return h;
    }
  }
  // 3. The brk heap as far as we saw it grow.
  if (p.s.brk_start && addr >= p.s.brk_start && addr < p.s.brk_now) {
    h.kind = Hit::Heap;
    h.start = p.s.brk_start;
    h.end = p.s.brk_now;
    return h;
  }
  // 4. What /proc/PID/maps says (mappings from before tracing, the stack).
  if (lookup_)
    if (auto r = lookup_(p.pid, addr, ts)) return *r;
  return h;
}

void HeapModel::fault(Process& p, const mt_event& e) {
  if (!faults_) return;
  if (e.h.ts < p.exec_ts) {  // queued before the exec record was read: the old image's
    faults_before_exec_++;
    return;
  }
  FaultHit h = attribute(p, e.addr, e.h.ts);
  bool write = e.h.flags & MT_F_FAULT_WRITE;
  bool access_error = e.h.flags & MT_F_FAULT_ACCESS_ERR;
  p.f.total++;
  (write ? p.f.write : p.f.read)++;
  if (e.h.flags & MT_F_FAULT_INSTR) p.f.instr++;
  if (access_error) p.f.access_errors++;
  // A fault answered with SIGSEGV makes nothing resident: not a first touch.
  if (!access_error && h.kind != Hit::Unmapped) h.first_touch = p.touched.insert(e.addr & ~4095ull).second;
  if (h.first_touch) p.f.pages_first_touched++;
  SiteFaults* site;
  if (h.kind == Hit::Block || (h.kind == Hit::Mmap && h.stack_id)) {
    site = &p.fault_stacks[h.stack_id];
    site->kind = h.kind;
    auto lb = p.live.find(h.start);
    if (lb != p.live.end() && !lb->second.touched) {
      lb->second.touched = true;
      auto as = p.alloc_sites.find(h.stack_id);
      if (as != p.alloc_sites.end()) as->second.touched_blocks++;
    }
  } else {
    site = &p.fault_regions[region_label(h)];
  }
  site->faults++;
  if (h.first_touch) site->pages++;
  (write ? site->writes : site->reads)++;
  if (observer_) observer_(p, e, h);
}

}  // namespace memtrace::heap
