#include "heap/heap_model.h"

#include <cstring>

namespace memtrace::heap {

HeapModel::HeapModel() { stacks_.reserve(1 << 14); }

Process& HeapModel::process(pid_t pid) {
  if (last_ && last_->pid == pid) return *last_;
  auto& slot = procs_[pid];
  if (!slot) {
    slot = std::make_unique<Process>();
    slot->pid = pid;
    slot->live.reserve(1024);
  }
  last_ = slot.get();
  return *slot;
}

Process* HeapModel::find(pid_t pid) {
  auto it = procs_.find(pid);
  return it == procs_.end() ? nullptr : it->second.get();
}

const Stack* HeapModel::stack(uint64_t id) const {
  auto it = stacks_.find(id);
  return it == stacks_.end() ? nullptr : &it->second;
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
    if (len < offsetof(mt_stack, ips)) {
      malformed_++;
      return;
    }
    const auto* s = static_cast<const mt_stack*>(data);
    uint32_t nr = s->nr > MT_MAX_FRAMES ? MT_MAX_FRAMES : s->nr;
    if (stacks_.count(s->stack_id)) return;
    Stack st;
    st.ips.assign(s->ips, s->ips + nr);
    st.truncated = s->h.flags & MT_F_STACK_TRUNCATED;
    stacks_.emplace(s->stack_id, std::move(st));
    return;
  }
  if (len < sizeof(mt_event)) {
    malformed_++;
    return;
  }
  const auto& e = *static_cast<const mt_event*>(data);
  Process& p = process(e.h.pid);
  if (e.stack_id && !stacks_.count(e.stack_id)) missing_stacks_++;
  switch (e.h.kind) {
    case MT_EV_ALLOC:
      alloc(p, e);
      break;
    case MT_EV_FREE:
      free_block(p, e);
      break;
    case MT_EV_ALLOC_FAIL:
      p.s.failed_allocs++;
      break;
    case MT_EV_REALLOC_FAIL: {
      // realloc(p, n) failed: p never died. Undo the free counted at entry.
      p.s.failed_allocs++;
      auto it = p.realloc_parked.find(e.h.tid);
      if (it != p.realloc_parked.end() && it->second.first == e.addr) {
        const Block& b = it->second.second;
        p.live.emplace(e.addr, b);
        p.s.in_use_bytes += b.size;
        p.s.in_use_blocks++;
        p.s.frees--;
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
      p.s.brk_now = e.addr;
      break;
    default:
      malformed_++;
  }
}

void HeapModel::alloc(Process& p, const mt_event& e) {
  if (e.old_addr) p.realloc_parked.erase(e.h.tid);  // realloc succeeded
  p.s.allocs++;
  p.s.bytes_allocated += e.size;
  auto [it, inserted] = p.live.try_emplace(e.addr, Block{e.size, e.stack_id, e.h.ts});
  if (!inserted) {
    // A block we believe is live was handed out again: its free was lost.
    p.s.in_use_bytes -= it->second.size;
    p.s.in_use_blocks--;
    it->second = Block{e.size, e.stack_id, e.h.ts};
  }
  p.s.in_use_bytes += e.size;
  p.s.in_use_blocks++;
  if (p.s.in_use_bytes > p.s.peak_in_use_bytes) p.s.peak_in_use_bytes = p.s.in_use_bytes;
}

void HeapModel::free_block(Process& p, const mt_event& e) {
  auto it = p.live.find(e.addr);
  if (it == p.live.end()) {
    p.s.unknown_frees++;
    return;
  }
  p.s.frees++;
  p.s.in_use_bytes -= it->second.size;
  p.s.in_use_blocks--;
  if (e.role == MT_ROLE_REALLOC || e.role == MT_ROLE_REALLOCARRAY)
    p.realloc_parked[e.h.tid] = {e.addr, it->second};
  p.live.erase(it);
}

void HeapModel::mmap(Process& p, const mt_event& e) {
  p.s.mmap_calls++;
  Mapping m;
  m.len = e.size;
  m.stack_id = e.stack_id;
  m.allocator = e.h.flags & MT_F_ALLOCATOR_INTERNAL;
  m.file = static_cast<int32_t>(e.aux) >= 0;
  m.prot = e.old_size >> 32;
  // MAP_FIXED over existing mappings replaces them.
  munmap(p, e.addr, e.size);
  (m.allocator ? p.s.mmap_bytes_allocator : p.s.mmap_bytes_direct) += e.size;
  (m.allocator ? p.s.mapped_now_allocator : p.s.mapped_now_direct) += e.size;
  p.maps[e.addr] = m;
}

void HeapModel::munmap(Process& p, uint64_t addr, uint64_t len) {
  if (!len) return;
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

void HeapModel::on_fork(pid_t parent, pid_t child) {
  Process* pp = find(parent);
  Process& c = process(child);
  c.ppid = parent;
  if (!pp) return;
  c.comm = pp->comm;
  c.live = pp->live;
  c.maps = pp->maps;
  c.s.in_use_bytes = pp->s.in_use_bytes;
  c.s.in_use_blocks = pp->s.in_use_blocks;
  c.s.peak_in_use_bytes = pp->s.in_use_bytes;
  c.s.inherited_blocks = pp->s.in_use_blocks;
  c.s.mapped_now_allocator = pp->s.mapped_now_allocator;
  c.s.mapped_now_direct = pp->s.mapped_now_direct;
}

void HeapModel::on_exit(pid_t pid, int code) {
  Process& p = process(pid);
  p.exited = true;
  if (!p.exit_code) p.exit_code = code;
}

void HeapModel::on_exec(pid_t pid) {
  Process& p = process(pid);
  p.live.clear();
  p.realloc_parked.clear();
  p.maps.clear();
  p.s.in_use_bytes = p.s.in_use_blocks = 0;
  p.s.mapped_now_allocator = p.s.mapped_now_direct = 0;
  p.s.inherited_blocks = 0;
}

void HeapModel::clear(pid_t pid) {
  Process& p = process(pid);
  p.live.clear();
  p.realloc_parked.clear();
  Summary fresh;
  fresh.brk_start = p.s.brk_start;
  fresh.brk_now = p.s.brk_now;
  p.s = fresh;
}

}  // namespace memtrace::heap
