// Tracer, part 3 of 3: system calls of traced threads whose buffers lie on
// protected pages.
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

// ---------------------------------------------------------------- system calls

// A system call whose buffer lies on a protected page would fail with EFAULT.
// read/pread64/recvfrom and write/pwrite64/sendto get their buffer redirected to
// a scratch slot in the tracee (pages stay protected, other threads keep running);
// any other system call with a pointer into a protected page runs with the
// pages opened (counted in stats.syscalls_unprotected).
void Tracer::handle_syscall(pid_t tid) {
  Thread& t = threads_[tid];
  SyscallInfo si{};
  if (pt(PTRACE_GET_SYSCALL_INFO_NR, tid, sizeof si, reinterpret_cast<uint64_t>(&si)) <= 0) return;
  using Open = Thread::Open;
  if (t.open != Open::kNone) {
    Regs r;
    get_regs(tid, r);
    if (si.op == 2 && t.open == Open::kOpening) {  // our mprotect(open) returned: run the real call
      for (uint64_t p = t.open_lo; p < t.open_lo + t.open_len; p += kPage)
        if (pages_.count(p)) pages_[p].cur_prot = pages_[p].orig_prot;
      Regs e = t.entry_regs;
      arch::rerun_from_entry(e);
      set_regs(tid, e);
      t.open = Open::kRunning;
      report_.unprotected_syscalls++;
    } else if (si.op == 2 && t.open == Open::kRunning) {  // the real call returned: close again
      t.result_regs = r;
      Regs c = r;
      arch::rerun_as(c, SYS_mprotect, t.open_lo, t.open_len, PROT_NONE);
      set_regs(tid, c);
      t.open = Open::kClosing;
    } else if (si.op == 2 && t.open == Open::kClosing) {
      for (uint64_t p = t.open_lo; p < t.open_lo + t.open_len; p += kPage)
        if (pages_.count(p)) pages_[p].cur_prot = PROT_NONE;
      Regs res = t.result_regs;
      long rv = arch::syscall_result(res);
      if (rv <= -512 && rv >= -516)  // interrupted: restart it after the signal (as SA_RESTART would)
        arch::restart_interrupted(res, t.entry_regs);
      set_regs(tid, res);
      t.open = Open::kNone;
    }
    return;
  }
  if (si.op == 1 /* PTRACE_SYSCALL_INFO_ENTRY */) {
    uint64_t nr = si.entry.nr;
    const uint64_t* a = si.entry.args;
    bool in = nr == SYS_read || nr == SYS_pread64 || nr == SYS_recvfrom;
    bool out = nr == SYS_write || nr == SYS_pwrite64 || nr == SYS_sendto;
    if (in || out) {
      uint64_t buf = a[1], len = a[2];
      bool hits = false;
      for (uint64_t p = page_of(buf); len && p < buf + len; p += kPage) hits |= page_armed(p);
      if (!hits) return;
      int slot = -1;
      for (int i = 0; i < kSlots; i++)
        if (!slot_busy_[static_cast<size_t>(i)]) {
          slot = i;
          break;
        }
      if (slot < 0) return;  // all slots busy: leave it (very unlikely)
      uint64_t n = std::min<uint64_t>(len, kSlotSize);
      uint64_t dst = scratch_ + static_cast<uint64_t>(slot) * kSlotSize;
      if (out) {
        std::vector<uint8_t> tmp(n);
        if (!mem_read(buf, tmp.data(), n) || !mem_write(dst, tmp.data(), n)) return;
      }
      Regs r;
      get_regs(tid, r);
      arch::set_syscall_arg(r, 1, dst);
      arch::set_syscall_arg(r, 2, n);
      set_regs(tid, r);
      slot_busy_[static_cast<size_t>(slot)] = true;
      t.redirect_slot = slot;
      t.redirect_in = in;
      t.redirect_buf = buf;
      t.redirect_len = len;
      report_.syscalls_redirected++;
      return;
    }
    if (nr == SYS_mprotect || nr == SYS_munmap || nr == SYS_mmap || nr == SYS_mremap || nr == SYS_madvise) return;
    // Another system call with an argument pointing into a protected page. Only
    // the arguments the call has: the other registers hold leftovers.
    int nargs = arch::syscall_nargs(nr);
    for (int i = 0; i < nargs; i++) {
      uint64_t p = page_of(a[i]);
      if (!page_armed(p)) continue;
      // The run of contiguous tracked pages around it.
      uint64_t lo = p, hi = p + kPage;
      while (pages_.count(lo - kPage)) lo -= kPage;
      while (pages_.count(hi)) hi += kPage;
      int prot = pages_[p].orig_prot;
      get_regs(tid, t.entry_regs);
      Regs m = t.entry_regs;
      // the kernel runs mprotect(open) instead; the real call follows
      arch::replace_syscall_at_entry(m, SYS_mprotect, lo, hi - lo, static_cast<uint64_t>(prot));
      set_regs(tid, m);
      t.open_lo = lo;
      t.open_len = hi - lo;
      t.open = Open::kOpening;
      if (getenv("MEMTRACE_SS_DEBUG"))
        std::fprintf(stderr, "open pages for syscall %llu arg%d %llx tid %d\n", (unsigned long long)nr, i,
                     (unsigned long long)a[i], tid);
      return;
    }
    return;
  }
  if (si.op == 2 /* EXIT */ && t.redirect_slot >= 0) {
    uint64_t now = now_ns();
    uint64_t src = scratch_ + static_cast<uint64_t>(t.redirect_slot) * kSlotSize;
    int64_t ret = si.exit.rval;
    if (ret > 0) {
      if (t.redirect_in) {
        std::vector<uint8_t> tmp(static_cast<size_t>(ret));
        if (mem_read(src, tmp.data(), tmp.size())) mem_write(t.redirect_buf, tmp.data(), tmp.size());
      }
      record_raw(tid, si.instruction_pointer - arch::kSyscallInsnLen, t.redirect_buf, static_cast<uint64_t>(ret),
                 t.redirect_in ? Access::kWrite : Access::kRead, now, t.redirect_in ? "syscall (kernel writes)" : "syscall (kernel reads)");
    }
    Regs r;
    get_regs(tid, r);
    arch::set_syscall_arg(r, 1, t.redirect_buf);
    arch::set_syscall_arg(r, 2, t.redirect_len);
    set_regs(tid, r);
    slot_busy_[static_cast<size_t>(t.redirect_slot)] = false;
    t.redirect_slot = -1;
  }
}

}  // namespace memtrace::singlestep
