// --track-allocs-from FUNCTION: DHAT-like per-block access counts, attached.
//
// The helper is already ptrace-attached, so it uses software breakpoints
// (int3, or brk #0 on aarch64: arch.h, written through /proc/PID/mem): at malloc/calloc/realloc/free in the
// allocator found in /proc/PID/maps + ELF symbols, and at the return address
// of calls made from inside FUNCTION's symbol range. A block returned to
// FUNCTION becomes a tracked region (its pages protected) until it is freed;
// every access to it is recorded and counted per block. In launch mode libc is
// not mapped at exec, so the allocator breakpoints are installed the first
// time FUNCTION is entered (a "gate" breakpoint on its first byte).
#include <signal.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/wait.h>

#include "allocs.h"

#include <cstdio>
#include <functional>
#include <string>

namespace memtrace::singlestep {
namespace {
constexpr uint64_t kPage = 4096;
uint64_t page_of(uint64_t a) { return a & ~(kPage - 1); }
std::string hex(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "%llx", (unsigned long long)v);
  return b;
}
long ptr_(int req, pid_t tid, uint64_t a, uint64_t d) {
  return ptrace(static_cast<__ptrace_request>(req), tid, reinterpret_cast<void*>(a), reinterpret_cast<void*>(d));
}
}  // namespace

static bool insert_bp(Tracer::AllocState& A, uint64_t addr, const std::function<bool(uint64_t, void*, size_t)>& rd,
                      const std::function<bool(uint64_t, const void*, size_t)>& wr) {
  if (A.saved.count(addr)) return true;
  uint32_t orig = 0;
  if (!rd(addr, &orig, arch::kBreakpointLen) || !wr(addr, arch::kBreakpoint, arch::kBreakpointLen)) return false;
  A.saved[addr] = orig;
  guardian_note("bp " + hex(addr) + " " + std::to_string(orig));
  return true;
}

static void remove_bp(Tracer::AllocState& A, uint64_t addr, const std::function<bool(uint64_t, const void*, size_t)>& wr) {
  auto it = A.saved.find(addr);
  if (it == A.saved.end()) return;
  wr(addr, &it->second, arch::kBreakpointLen);
  A.saved.erase(it);
  guardian_note("unbp " + hex(addr));
}

Result<void> Tracer::arm_alloc_tracking() {
  allocs_ = std::make_unique<AllocState>();
  report_.track_allocs_from = opt_.track_allocs_from;
  auto f = symbols_->find_function(opt_.track_allocs_from);
  if (!f) return f.error();
  allocs_->caller_lo = f->start;
  allocs_->caller_hi = f->start + std::max<uint64_t>(f->size, 1);
  auto rd = [this](uint64_t a, void* b, size_t n) { return mem_read(a, b, n); };
  auto wr = [this](uint64_t a, const void* b, size_t n) { return mem_write(a, b, n); };
  allocs_->gate = f->start;
  if (!insert_bp(*allocs_, f->start, rd, wr))
    return Error::msg("cannot insert a breakpoint at " + opt_.track_allocs_from);
  return {};
}

void Tracer::alloc_breakpoint(pid_t tid, Regs& regs) {
  AllocState& A = *allocs_;
  uint64_t bp = arch::breakpoint_addr(regs);
  Thread& t = threads_[tid];
  if (!A.saved.count(bp)) {
    t.resume_sig = SIGTRAP;  // not ours: the program's own SIGTRAP
    return;
  }
  auto rd = [this](uint64_t a, void* b, size_t n) { return mem_read(a, b, n); };
  auto wr = [this](uint64_t a, const void* b, size_t n) { return mem_write(a, b, n); };
  uint64_t now = now_ns();
  if (threads_.size() > 1) stop_world(tid);

  auto block_pages_needed = [&](uint64_t p) {
    for (const auto& r : report_.regions)
      if (r.overlaps(p, kPage)) return true;
    for (const auto& b : report_.blocks)
      if (!b.free_time_ns && b.addr < p + kPage && p < b.addr + b.size) return true;
    return false;
  };
  auto on_free = [&](uint64_t ptr) {
    for (auto& b : report_.blocks) {
      if (b.free_time_ns || b.addr != ptr) continue;
      b.free_time_ns = now;
      for (uint64_t p = page_of(b.addr); p < b.addr + b.size; p += kPage) {
        if (block_pages_needed(p)) continue;
        auto it = pages_.find(p);
        if (it == pages_.end()) continue;
        (void)set_prot(tid, p, 1, it->second.orig_prot);
        pages_.erase(p);
        guardian_note("unpage " + hex(p));
      }
    }
  };

  if (bp == A.gate && !A.installed) {
    A.installed = true;
    ProcessSymbols fresh(pid_);
    const std::pair<const char*, AllocState::Fn> fns[] = {
        {"malloc", AllocState::kMalloc}, {"calloc", AllocState::kCalloc}, {"realloc", AllocState::kRealloc},
        {"free", AllocState::kFree}};
    for (auto [name, fn] : fns) {
      auto s = fresh.find_function(name);
      if (!s) continue;
      A.entries[s->start] = fn;
      insert_bp(A, s->start, rd, wr);
    }
    if (!A.entries.count(bp)) remove_bp(A, bp, wr);  // the gate is no longer needed
  }
  if (auto e = A.entries.find(bp); e != A.entries.end()) {
    uint64_t slot = 0;
    uint64_t ret = arch::return_address_at_entry(regs, &slot);
    if (slot) mem_read(slot, &ret, 8);
    const uint64_t a0 = arch::call_arg(regs, 0), a1 = arch::call_arg(regs, 1);
    if (e->second == AllocState::kFree) {
      on_free(a0);
    } else if (ret >= A.caller_lo && ret < A.caller_hi) {
      AllocState::Pending p{e->second, 0, 0, ret};
      p.size = e->second == AllocState::kMalloc   ? a0
               : e->second == AllocState::kCalloc ? a0 * a1
                                                  : a1;
      p.old_ptr = e->second == AllocState::kRealloc ? a0 : 0;
      if (!opt_.track_alloc_size || p.size == opt_.track_alloc_size) {
        A.pending[tid] = p;
        if (A.return_refs[ret]++ == 0) insert_bp(A, ret, rd, wr);
      }
    }
  }
  if (auto p = A.pending.find(tid); p != A.pending.end() && p->second.ret_addr == bp) {
    uint64_t ptr = arch::return_value(regs);
    if (p->second.fn == AllocState::kRealloc && p->second.old_ptr) on_free(p->second.old_ptr);
    if (ptr && p->second.size) {
      Block b;
      b.addr = ptr;
      b.size = p->second.size;
      b.alloc_time_ns = now;
      report_.blocks.push_back(b);
      auto maps = read_maps(pid_);
      for (uint64_t pg = page_of(ptr); pg < ptr + b.size; pg += kPage) {
        if (pages_.count(pg)) continue;
        int prot = PROT_READ | PROT_WRITE;
        if (maps)
          for (const auto& m : *maps)
            if (pg >= m.start && pg < m.end) prot = m.prot();
        pages_[pg] = Page{prot, prot};
        guardian_note("page " + hex(pg) + " " + std::to_string(prot));
        (void)set_prot(tid, pg, 1, PROT_NONE);
      }
    }
    if (--A.return_refs[bp] == 0 && !A.entries.count(bp) && bp != A.gate) remove_bp(A, bp, wr);
    A.pending.erase(p);
  }
  // Execute the original instruction under the breakpoint: restore, step, re-insert.
  arch::set_pc(regs, bp);
  arch::set_regs(tid, regs);
  if (auto it = A.saved.find(bp); it != A.saved.end()) {
    uint32_t orig = it->second;
    mem_write(bp, &orig, arch::kBreakpointLen);
    ptr_(PTRACE_SINGLESTEP, tid, 0, 0);
    int st = wait_for(tid);
    mem_write(bp, arch::kBreakpoint, arch::kBreakpointLen);
    if (WIFSTOPPED(st) && WSTOPSIG(st) != SIGTRAP) t.resume_sig = WSTOPSIG(st);
    if (!WIFSTOPPED(st)) handle(tid, st);
  }
}

void Tracer::disarm_alloc_tracking(pid_t tid) {
  if (!allocs_) return;
  auto wr = [this](uint64_t a, const void* b, size_t n) { return mem_write(a, b, n); };
  // Threads stopped right after one of our int3s go back to the original
  // instruction (a brk leaves pc on it: nothing to move).
  for (auto& [id, t] : threads_) {
    if (t.resume_sig != SIGTRAP) continue;
    Regs r;
    if (arch::get_regs(id, r) && allocs_->saved.count(arch::breakpoint_addr(r))) {
      arch::set_pc(r, arch::breakpoint_addr(r));
      arch::set_regs(id, r);
      t.resume_sig = 0;
    }
  }
  while (!allocs_->saved.empty()) remove_bp(*allocs_, allocs_->saved.begin()->first, wr);
}

}  // namespace memtrace::singlestep
