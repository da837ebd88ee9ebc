// Tracer, part 2 of 3: an access to a protected page (decode, emulate or step
// over the instruction, record it, re-protect).
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "allocs.h"
#include "hw_watch.h"
#include "ptrace_stop.h"
#include "tracer.h"
#include "tracer_internal.h"

namespace memtrace::singlestep {

using namespace internal;  // NOLINT(google-build-using-namespace): this file's own internals

// ---------------------------------------------------------------- faults

void Tracer::record_raw(pid_t tid, uint64_t ip, uint64_t addr, uint64_t size, Access a, uint64_t now,
                        const std::string& insn_text) {
  bool in = false;
  for (const auto& r : report_.regions) in |= r.overlaps(addr, size ? size : 1);
  for (auto& b : report_.blocks) {
    if (b.free_time_ns || addr >= b.addr + b.size || b.addr >= addr + (size ? size : 1)) continue;
    in = true;
    if (a != Access::kWrite) b.reads++, b.bytes_read += size;
    if (a != Access::kRead) b.writes++, b.bytes_written += size;
  }
  if (!in) {
    report_.unrecorded_same_page++;
    return;
  }
  if (max_reached()) {
    report_.dropped++;
    return;
  }
  Record rec;
  rec.time_ns = now;
  rec.tid = tid;
  rec.ip = ip;
  rec.address = addr;
  rec.size = static_cast<uint32_t>(size);
  rec.access = a;
  rec.function = symbols_->function_of(ip);
  rec.insn = insn_text;
  report_.records.push_back(std::move(rec));
}

void Tracer::record(pid_t tid, const Insn& insn, const MemOp& op, Access a, uint64_t now) {
  record_raw(tid, insn.ip, op.ea, op.size, a, now, insn.text);
}

bool Tracer::emulate(pid_t tid, Regs& regs, const Insn& insn, uint64_t now) {
  if (insn.ops.size() != 1 || insn.ops[0].size > 8) return false;
  const MemOp& op = insn.ops[0];
  uint64_t v = 0;
  switch (insn.emul) {
    case Emul::kLoad: {
      if (!mem_read(op.ea, &v, op.size)) return false;
      unsigned w = reg_width(insn.reg);
      if (insn.sign_extend && op.size < 8) {
        unsigned sh = 64 - op.size * 8;
        v = static_cast<uint64_t>(static_cast<int64_t>(v << sh) >> sh);
      }
      if (w < 8 && w > op.size && !insn.sign_extend) v &= (1ull << (op.size * 8)) - 1;
      if (!reg_write(insn.reg, v, regs)) return false;
      break;
    }
    case Emul::kStoreReg: {
      auto r = reg_read(insn.reg, regs);
      if (!r) return false;
      v = *r;
      if (!mem_write(op.ea, &v, op.size)) return false;
      break;
    }
    case Emul::kStoreImm:
      v = static_cast<uint64_t>(insn.imm);
      if (!mem_write(op.ea, &v, op.size)) return false;
      break;
    default:
      return false;
  }
  arch::set_pc(regs, insn.ip + insn.len);
  if (!set_regs(tid, regs)) return false;
  record(tid, insn, op, insn.emul == Emul::kLoad ? Access::kRead : Access::kWrite, now);
  report_.emulated++;
  return true;
}

// A store-exclusive on a tracked page, performed by the helper the way the
// exclusive monitor decides it (and as QEMU emulates it): stored if the
// memory still holds what the thread's load-exclusive read there, else the
// status register says failed and the program's loop retries. The helper is
// the only one to touch the page meanwhile (every access faults into this
// loop, one at a time), so the compare and the store are one step.
bool Tracer::store_exclusive(pid_t tid, Regs& regs, const IpInfo& info, uint64_t now) {
  const Insn& insn = info.insn;
  Thread* t = thread(tid);
  uint8_t data[16], cur[16];
  uint32_t size = 0;
  if (!t || insn.ops.size() != 1 || !arch::store_exclusive_data(info.bytes, info.n, regs, data, &size) ||
      size != insn.ops[0].size)
    return false;
  const uint64_t ea = insn.ops[0].ea;
  bool stored = t->excl_size == size && t->excl_addr == ea && mem_read(ea, cur, size) &&
                std::memcmp(cur, t->excl_bytes, size) == 0 && mem_write(ea, data, size);
  t->excl_size = 0;
  arch::complete_store_exclusive(regs, info.bytes, stored);
  if (!set_regs(tid, regs)) return false;
  if (stored) record(tid, insn, insn.ops[0], Access::kWrite, now);
  report_.emulated++;
  return true;
}

void Tracer::handle_fault(pid_t tid, uint64_t fault_addr) {
  uint64_t now = now_ns();
  Regs regs;
  if (!get_regs(tid, regs)) return;
  const uint64_t ip = arch::pc(regs);
  uint8_t code[16];
  size_t n = 16;
  while (n > 0 && !mem_read(ip, code, n)) n--;
  IpInfo& info = ips_[ip];
  if (info.n != n || std::memcmp(info.bytes, code, n) != 0 || info.insn.len == 0) {
    info = IpInfo{};
    std::memcpy(info.bytes, code, n);
    info.n = n;
    if (auto d = decoder_.decode(ip, code, n, regs)) info.insn = *d;
    else info.insn.ip = ip, info.insn.len = 0, info.insn.text = "(undecodable)";
  } else {
    decoder_.recompute(info.insn, code, n, regs);
  }
  Insn& insn = info.insn;
  // aarch64: a store-exclusive would fail once stepped (every step, and the
  // system calls that open the page, clear the exclusive monitor): the
  // helper performs it against the value of the thread's load-exclusive.
  if (insn.exclusive == 2 && store_exclusive(tid, regs, info, now)) return;
  // Emulate plain moves: the page stays protected, other threads run on.
  if (opt_.emulate && insn.emul != Emul::kNone && emulate(tid, regs, insn, now)) return;
  if (threads_.size() > 1) stop_world(tid);
  bool stepped = step_over(tid, regs, info, fault_addr, now);
  report_.stepped++;
  if (stepped && insn.exclusive == 1) finish_exclusive(tid, now);
}

// aarch64: after a load-exclusive on a tracked page, step the thread on (the
// world still stopped) to its store-exclusive and perform that: the monitor
// the load set is gone after the step, and a store-exclusive that fails its
// monitor check need not fault (QEMU's does not), so it would never reach
// the helper and the program's loop would retry for ever. A short bounded
// walk: an LL/SC loop is a few instructions; anything else (another memory
// access to a tracked page, a signal) ends it and takes the usual path.
void Tracer::finish_exclusive(pid_t tid, uint64_t now) {
  Thread* t = thread(tid);
  for (int i = 0; i < 32 && t && t->excl_size; i++) {
    Regs r;
    if (!get_regs(tid, r)) return;
    IpInfo info;
    info.n = sizeof info.bytes;
    while (info.n > 0 && !mem_read(arch::pc(r), info.bytes, info.n)) info.n--;
    auto d = decoder_.decode(arch::pc(r), info.bytes, info.n, r);
    if (!d) return;
    info.insn = *d;
    if (d->exclusive == 2 && d->ops.size() == 1 && d->ops[0].ea == t->excl_addr) {
      store_exclusive(tid, r, info, now);
      return;
    }
    for (const MemOp& op : d->ops)
      for (uint64_t p = page_of(op.ea); p < op.ea + std::max<uint32_t>(op.size, 1); p += kPage)
        if (page_armed(p)) return;  // its fault comes next
    pt(PTRACE_SINGLESTEP, tid, 0, 0);
    Stop s(wait_for(tid));
    if (!(s.kind() == Stop::kSignal && s.sig() == SIGTRAP)) {
      t->queued.push_back(s.raw());  // the main loop handles it
      return;
    }
  }
}

// --rearm: the first access to an armed page in this interval. Give the page
// its protection back from the faulting thread itself and let the access run
// again (the SIGSEGV is not delivered). The kernel's page_fault_user
// tracepoint has already seen this fault (memtrace-bpf flags it as an access
// error); nothing is single-stepped.
void Tracer::handle_page_access(pid_t tid, uint64_t fault_addr) {
  uint64_t page = page_of(fault_addr);
  auto it = pages_.find(page);
  if (it == pages_.end()) return;
  if (auto r = set_prot(tid, page, 1, it->second.orig_prot); !r) {
    std::fprintf(stderr, "memtrace-singlestep: %s\n", r.error().message.c_str());
    return;
  }
  report_.page_first_accesses++;
  report_.page_accesses[page]++;
  Regs regs;
  if (Thread* t = thread(tid); t && get_regs(tid, regs)) {
    t->retry_page = page;
    t->retry_ip = arch::pc(regs);
  }
}

// --rearm: a thread whose page was just restored but that has not re-run the
// access yet would fault again on the re-armed page (two first accesses in one
// interval): step it over the access first.
void Tracer::finish_retries() {
  for (auto& [tid, t] : threads_) {
    for (int i = 0; i < 4 && t.retry_page && t.stopped && t.queued.empty(); i++) {
      Regs r;
      if (!get_regs(tid, r) || arch::pc(r) != t.retry_ip) break;
      pt(PTRACE_SINGLESTEP, tid, 0, 0);
      Stop s(wait_for(tid));
      if (s.gone()) {
        t.queued.push_back(s.raw());
        break;
      }
      siginfo_t si;
      if (s.kind() == Stop::kSignal && s.sig() == SIGSEGV && get_siginfo(tid, si) && si.si_code > 0 &&
          page_armed(page_of(reinterpret_cast<uint64_t>(si.si_addr)))) {
        handle_page_access(tid, reinterpret_cast<uint64_t>(si.si_addr));  // another armed page: same interval
        continue;
      }
      if (s.kind() == Stop::kSignal && s.sig() != SIGTRAP) t.resume_sig = s.sig();
      else if (s.kind() != Stop::kSignal) t.queued.push_back(s.raw());
      break;
    }
    t.retry_page = 0;
  }
}

// --rearm: a new interval. Stop every thread (so that none is between a fault
// and its restore), make every opened page inaccessible again, resume.
void Tracer::rearm_now() {
  stop_world(0);
  finish_retries();
  // Inject from a thread stopped by our interrupt (nothing queued to finish).
  pid_t tid = 0;
  for (const auto& [id, t] : threads_)
    if (t.stopped && t.queued.empty() && t.open == Thread::Open::kNone && t.redirect_slot < 0) {
      tid = id;
      break;
    }
  if (tid) {
    // A thread stopped inside a system call whose pages we opened: leave this
    // round to it (the pages are closed again when its call returns).
    bool busy = false;
    for (const auto& [id, t] : threads_) busy |= t.open != Thread::Open::kNone || t.redirect_slot >= 0;
    if (!busy) {
      if (auto r = protect_all(tid, true); !r)
        std::fprintf(stderr, "memtrace-singlestep: rearm: %s\n", r.error().message.c_str());
      else
        report_.rearm_intervals++;
    }
  }
  if (!tid) {
    // Every thread stopped with an event to handle first: stopping a thread
    // in a blocking system call under PTRACE_SYSCALL reports its
    // syscall-exit before our interrupt. Handle those, then re-arm on the
    // next pass of the loop (the deadline stays where it is). Skipping this
    // round instead lost a whole sweep's first accesses: one thread
    // sleeping between sweeps is exactly this case.
    for (const auto& [id, t] : threads_)
      if (!t.queued.empty()) return;
  }
  uint64_t step = static_cast<uint64_t>(opt_.rearm_ms * 1e6);
  uint64_t now = now_ns();
  next_rearm_ns_ += step;
  if (next_rearm_ns_ <= now) next_rearm_ns_ = now + step;  // late: skip, do not catch up
}

// Unprotect the pages the instruction touches, single-step it, record, re-protect.
// Read vs write comes from the fault: a page is first opened read-only unless this
// ip is known to write it; a second fault on the read-only page means a write.
bool Tracer::step_over(pid_t tid, Regs& regs, IpInfo& info, uint64_t fault_addr, uint64_t now) {
  Insn& insn = info.insn;
  Thread* t = thread(tid);
  std::map<uint64_t, int> opened;  // page -> protection we set
  auto op_written = [&](size_t i) {
    return insn.ops[i].dir == Dir::kWrite || insn.ops[i].dir == Dir::kReadWrite ||
           (insn.ops[i].dir == Dir::kUnknown && (info.written_ops >> i) & 1);
  };
  auto want_pages = [&](std::map<uint64_t, int>& want) {
    for (size_t i = 0; i < insn.ops.size(); i++) {
      const MemOp& op = insn.ops[i];
      for (uint64_t p = page_of(op.ea); p < op.ea + std::max<uint32_t>(op.size, 1); p += kPage) {
        auto it = pages_.find(p);
        if (it == pages_.end()) continue;
        int prot = op_written(i) ? it->second.orig_prot : (it->second.orig_prot & ~PROT_WRITE);
        want[p] |= prot;
      }
    }
  };
  std::map<uint64_t, int> want;
  want_pages(want);
  if (want.empty() || !want.count(page_of(fault_addr))) {
    auto it = pages_.find(page_of(fault_addr));
    want[page_of(fault_addr)] |= it->second.orig_prot & ~PROT_WRITE;
  }
  bool undecoded = insn.len == 0 || insn.ops.empty();
  bool ok = false;
  bool fault_written = false;
  Regs after = regs;
  for (int attempt = 0; attempt < 8; attempt++) {
    for (auto [p, prot] : want) {
      if (opened.count(p) && opened[p] == prot) continue;
      if (!set_prot(tid, p, 1, prot)) return false;
      opened[p] = prot;
    }
    set_regs(tid, regs);
    pt(PTRACE_SINGLESTEP, tid, 0, 0);
    Stop s(wait_for(tid));
    if (s.gone()) {
      handle(tid, s.raw());
      return false;
    }
    if (s.kind() == Stop::kSignal && s.sig() == SIGTRAP) {
      ok = true;
      break;
    }
    if (s.kind() == Stop::kSignal && s.sig() == SIGSEGV) {
      siginfo_t si;
      get_siginfo(tid, si);
      uint64_t a = reinterpret_cast<uint64_t>(si.si_addr);
      uint64_t p = page_of(a);
      auto it = pages_.find(p);
      if (it != pages_.end() && opened.count(p) && opened[p] != it->second.orig_prot) {
        // Faulted on a page we opened read-only: the instruction writes there.
        want[p] = it->second.orig_prot;
        for (size_t i = 0; i < insn.ops.size(); i++)
          if (a >= page_of(insn.ops[i].ea) && a < insn.ops[i].ea + insn.ops[i].size + kPage) info.written_ops |= 1u << i;
        fault_written = true;
        continue;
      }
      if (it != pages_.end() && !opened.count(p)) {
        want[p] = it->second.orig_prot & ~PROT_WRITE;  // an operand we did not model
        undecoded = true;
        continue;
      }
      t->resume_sig = SIGSEGV;  // a genuine fault of the program: deliver it
      break;
    }
    if (s.kind() == Stop::kSignal) {
      if (!t->resume_sig) t->resume_sig = s.sig();  // asynchronous signal: deliver after the step
      continue;
    }
    if (s.kind() == Stop::kGroupStop) t->group_stop = true;
    // Another stop (event): treat as not stepped yet and retry.
  }
  if (ok) {
    get_regs(tid, after);
    if (insn.exclusive == 1 && insn.ops.size() == 1 && insn.ops[0].size <= sizeof t->excl_bytes &&
        mem_read(insn.ops[0].ea, t->excl_bytes, insn.ops[0].size)) {
      t->excl_addr = insn.ops[0].ea;  // what the load-exclusive read: the world is stopped
      t->excl_size = insn.ops[0].size;
    }
    if (undecoded) {
      Access a = fault_written ? Access::kReadWrite : Access::kRead;
      record_raw(tid, arch::pc(regs), fault_addr, 1, a, now, insn.text);
    } else {
      for (size_t i = 0; i < insn.ops.size(); i++) {
        const MemOp& op = insn.ops[i];
        Access a = op.dir == Dir::kRead        ? Access::kRead
                   : op.dir == Dir::kWrite     ? Access::kWrite
                   : op.dir == Dir::kReadWrite ? Access::kReadWrite  // arm64 atomics
                   : op_written(i)         ? (insn.rmw_if_written ? Access::kReadWrite : Access::kWrite)
                                           : Access::kRead;
        record(tid, insn, op, a, now);
      }
    }
    // rep string: one element per step while the pages stay open.
    while (insn.rep_string && arch::pc(after) == insn.ip && !max_reached()) {
      if (!decoder_.recompute(insn, info.bytes, info.n, after) || insn.ops.empty()) break;
      bool open_enough = true;
      for (size_t i = 0; i < insn.ops.size(); i++)
        for (uint64_t p = page_of(insn.ops[i].ea); p < insn.ops[i].ea + insn.ops[i].size; p += kPage) {
          auto it = pages_.find(p);
          if (it == pages_.end()) continue;
          auto o = opened.find(p);
          if (o == opened.end() || (op_written(i) && o->second != it->second.orig_prot)) open_enough = false;
        }
      if (!open_enough) break;
      uint64_t tnow = now_ns();
      pt(PTRACE_SINGLESTEP, tid, 0, 0);
      Stop s(wait_for(tid));
      if (s.gone()) {
        handle(tid, s.raw());
        return false;
      }
      Regs before = after;
      get_regs(tid, after);
      if (!(s.kind() == Stop::kSignal && s.sig() == SIGTRAP)) {
        if (s.kind() == Stop::kSignal && !t->resume_sig && s.sig() != SIGSEGV) t->resume_sig = s.sig();
        after = before;
        break;
      }
      for (size_t i = 0; i < insn.ops.size(); i++)
        record(tid, insn, insn.ops[i], insn.ops[i].dir == Dir::kWrite ? Access::kWrite : Access::kRead, tnow);
      report_.stepped++;
    }
  }
  // Re-protect what we opened.
  for (auto [p, prot] : opened) (void)set_prot(tid, p, 1, PROT_NONE);
  set_regs(tid, ok ? after : regs);
  return ok;
}

}  // namespace memtrace::singlestep
