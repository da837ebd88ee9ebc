// x86-64: PTRACE_GETREGS/SETREGS, `syscall` (0f 05), the number in rax and
// orig_rax, arguments in rdi rsi rdx r10 r8 r9.
#include <sys/ptrace.h>
#include <sys/syscall.h>

#include "arch.h"

namespace memtrace::singlestep::arch {

const char* const kName = "x86-64";
const size_t kSyscallInsnLen = 2;
const char* const kWatchpointIp = "(hw watchpoint: ip is the next instruction)";

bool get_regs(pid_t tid, Regs& r) { return ptrace(PTRACE_GETREGS, tid, nullptr, &r) == 0; }
bool set_regs(pid_t tid, const Regs& r) { return ptrace(PTRACE_SETREGS, tid, nullptr, &r) == 0; }
uint64_t pc(const Regs& r) { return r.rip; }
void set_pc(Regs& r, uint64_t pc) { r.rip = pc; }

size_t find_syscall_insn(const uint8_t* code, size_t n) {
  for (size_t i = 0; i + 1 < n; i++)
    if (code[i] == 0x0f && code[i + 1] == 0x05) return i;
  return n;
}

void load_injected_syscall(Regs& r, uint64_t insn, long nr, const uint64_t a[6]) {
  r.rax = static_cast<uint64_t>(nr);
  r.orig_rax = static_cast<uint64_t>(-1);  // no syscall restart on the way out of this stop
  r.rdi = a[0], r.rsi = a[1], r.rdx = a[2], r.r10 = a[3], r.r8 = a[4], r.r9 = a[5];
  r.rip = insn;
}

long syscall_result(const Regs& r) { return static_cast<long>(r.rax); }

void restart_by_hand(Regs& r) {
  if (static_cast<long>(r.orig_rax) < 0) return;  // not in a system call
  long ax = static_cast<long>(r.rax);
  // -ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND; -ERESTART_RESTARTBLOCK
  if (ax == -512 || ax == -513 || ax == -514) r.rax = r.orig_rax;
  else if (ax == -516) r.rax = SYS_restart_syscall;
  else return;
  r.rip -= kSyscallInsnLen;
  r.orig_rax = static_cast<uint64_t>(-1);
}

void set_syscall_arg(Regs& r, int i, uint64_t v) {
  unsigned long long Regs::*const kArgs[] = {&Regs::rdi, &Regs::rsi, &Regs::rdx, &Regs::r10, &Regs::r8, &Regs::r9};
  r.*kArgs[i] = v;
}

void replace_syscall_at_entry(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2) {
  r.orig_rax = static_cast<uint64_t>(nr);
  r.rdi = a0, r.rsi = a1, r.rdx = a2;
}

void rerun_from_entry(Regs& e) {
  e.rip -= 2;
  e.rax = e.orig_rax;
}

void rerun_as(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2) {
  r.rip -= 2;
  r.rax = static_cast<uint64_t>(nr);
  r.rdi = a0, r.rsi = a1, r.rdx = a2;
}

void restart_interrupted(Regs& res, const Regs&) {
  res.rip -= 2;
  res.rax = res.orig_rax;
}

bool store_exclusive_data(const uint8_t*, size_t, const Regs&, uint8_t*, uint32_t*) { return false; }
void complete_store_exclusive(Regs&, const uint8_t*, bool) {}

const uint8_t kBreakpoint[4] = {0xcc};
const size_t kBreakpointLen = 1;
uint64_t breakpoint_addr(const Regs& r) { return r.rip - 1; }
uint64_t call_arg(const Regs& r, int i) {
  unsigned long long Regs::*const kArgs[] = {&Regs::rdi, &Regs::rsi, &Regs::rdx, &Regs::rcx, &Regs::r8, &Regs::r9};
  return r.*kArgs[i];
}
uint64_t return_address_at_entry(const Regs& r, uint64_t* slot) {
  *slot = r.rsp;
  return 0;
}
uint64_t return_value(const Regs& r) { return r.rax; }

int syscall_nargs(uint64_t nr) {
  int nargs = 6;
  switch (nr) {
    case SYS_exit: case SYS_exit_group: case SYS_close: case SYS_brk: nargs = 1; break;
    case SYS_sigaltstack: case SYS_set_robust_list: case SYS_clone3: case SYS_arch_prctl: case SYS_kill:
    case SYS_nanosleep: case SYS_fstat: case SYS_munmap: case SYS_set_tid_address: nargs = 2; break;
    case SYS_tgkill: case SYS_getrandom: case SYS_ioctl: case SYS_fcntl: case SYS_lseek: case SYS_poll:
    case SYS_readv: case SYS_writev: nargs = 3; break;
    case SYS_rt_sigprocmask: case SYS_rt_sigaction: case SYS_rseq: case SYS_clock_nanosleep:
    case SYS_openat: case SYS_newfstatat: case SYS_wait4: nargs = 4; break;
    case SYS_clone: case SYS_prctl: nargs = 5; break;
    case SYS_sched_yield: case SYS_getpid: case SYS_gettid: nargs = 0; break;
    default: break;
  }
  return nargs;
}

}  // namespace memtrace::singlestep::arch
