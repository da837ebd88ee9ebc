// aarch64: registers through PTRACE_GETREGSET/SETREGSET (NT_PRSTATUS: x0-x30,
// sp, pc, pstate; NT_ARM_SYSTEM_CALL: the number the kernel will run, which
// is not x8 once the call has entered), `svc #0`, the number in x8,
// arguments in x0-x5, the result in x0 (which a restart gives back the
// first argument: the kernel's orig_x0).
#include <elf.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include <cstring>

#include "arch.h"

#ifndef NT_ARM_SYSTEM_CALL
#define NT_ARM_SYSTEM_CALL 0x404
#endif

namespace memtrace::singlestep::arch {

const char* const kName = "aarch64";
const size_t kSyscallInsnLen = 4;
const char* const kWatchpointIp = "(hw watchpoint: ip is the access)";

namespace {
constexpr size_t kPrstatusBytes = offsetof(Arm64Regs, syscallno);  // = sizeof(user_pt_regs), 272
static_assert(kPrstatusBytes == 34 * 8);
}  // namespace

bool get_regs(pid_t tid, Regs& r) {
  iovec iov{&r, kPrstatusBytes};
  if (ptrace(PTRACE_GETREGSET, tid, reinterpret_cast<void*>(NT_PRSTATUS), &iov) != 0) return false;
  iovec sys{&r.syscallno, sizeof r.syscallno};
  return ptrace(PTRACE_GETREGSET, tid, reinterpret_cast<void*>(NT_ARM_SYSTEM_CALL), &sys) == 0;
}

bool set_regs(pid_t tid, const Regs& r) {
  Regs c = r;
  iovec iov{&c, kPrstatusBytes};
  if (ptrace(PTRACE_SETREGSET, tid, reinterpret_cast<void*>(NT_PRSTATUS), &iov) != 0) return false;
  iovec sys{&c.syscallno, sizeof c.syscallno};
  return ptrace(PTRACE_SETREGSET, tid, reinterpret_cast<void*>(NT_ARM_SYSTEM_CALL), &sys) == 0;
}

uint64_t pc(const Regs& r) { return r.pc; }
void set_pc(Regs& r, uint64_t pc) { r.pc = pc; }

size_t find_syscall_insn(const uint8_t* code, size_t n) {
  const uint32_t kSvc0 = 0xd4000001;  // svc #0
  for (size_t i = 0; i + 4 <= n; i += 4) {
    uint32_t w;
    std::memcpy(&w, code + i, 4);
    if (w == kSvc0) return i;
  }
  return n;
}

void load_injected_syscall(Regs& r, uint64_t insn, long nr, const uint64_t a[6]) {
  r.x[8] = static_cast<uint64_t>(nr);
  for (int i = 0; i < 6; i++) r.x[i] = a[i];
  r.pc = insn;
  // At a system call's entry stop: the interrupted call is skipped (x86's orig_rax = -1).
  r.syscallno = -1;
}

long syscall_result(const Regs& r) { return static_cast<long>(r.x[0]); }

void restart_by_hand(Regs&) {}

void set_syscall_arg(Regs& r, int i, uint64_t v) { r.x[i] = v; }

void replace_syscall_at_entry(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2) {
  r.syscallno = static_cast<int32_t>(nr);  // x8 keeps the program's: the re-run takes it from there
  r.x[0] = a0, r.x[1] = a1, r.x[2] = a2;
}

void rerun_from_entry(Regs& e) {
  e.pc -= 4;  // x0 at the entry stop is still the first argument, x8 the number
}

void rerun_as(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2) {
  r.pc -= 4;
  r.x[8] = static_cast<uint64_t>(nr);
  r.x[0] = a0, r.x[1] = a1, r.x[2] = a2;
}

void restart_interrupted(Regs& res, const Regs& entry) {
  res.pc -= 4;
  res.x[0] = entry.x[0];  // the kernel's orig_x0
}

const uint8_t kBreakpoint[4] = {0x00, 0x00, 0x20, 0xd4};  // brk #0
const size_t kBreakpointLen = 4;
uint64_t breakpoint_addr(const Regs& r) { return r.pc; }
uint64_t call_arg(const Regs& r, int i) { return r.x[i]; }
uint64_t return_address_at_entry(const Regs& r, uint64_t* slot) {
  *slot = 0;
  return r.x[30];
}
uint64_t return_value(const Regs& r) { return r.x[0]; }

// size 001000 o2=0 L=0 o1 Rs o0 Rt2 Rn Rt: o1 = pair, Rs the status register.
bool store_exclusive_data(const uint8_t* code, size_t n, const Regs& r, uint8_t data[16], uint32_t* size) {
  if (n < 4) return false;
  uint32_t w;
  std::memcpy(&w, code, 4);
  if ((w & 0x3fc00000u) != 0x08000000u) return false;
  unsigned sz = w >> 30, rt = w & 31, rt2 = (w >> 10) & 31;
  bool pair = (w >> 21) & 1;
  auto x = [&](unsigned i) { return i == 31 ? 0 : r.x[i]; };  // 31: xzr
  if (!pair) {
    *size = 1u << sz;
    uint64_t v = x(rt);
    std::memcpy(data, &v, *size);
  } else {
    if (sz < 2) return false;
    uint32_t each = sz == 3 ? 8 : 4;
    uint64_t a = x(rt), b = x(rt2);
    std::memcpy(data, &a, each);
    std::memcpy(data + each, &b, each);
    *size = 2 * each;
  }
  return true;
}

void complete_store_exclusive(Regs& r, const uint8_t* code, bool stored) {
  uint32_t w;
  std::memcpy(&w, code, 4);
  unsigned rs = (w >> 16) & 31;
  if (rs != 31) r.x[rs] = stored ? 0 : 1;  // a w register: the upper half zeroed
  r.pc += 4;
}

int syscall_nargs(uint64_t nr) {
  switch (nr) {
    case SYS_exit: case SYS_exit_group: case SYS_close: case SYS_brk: return 1;
    case SYS_sigaltstack: case SYS_set_robust_list: case SYS_clone3: case SYS_kill: case SYS_nanosleep:
    case SYS_fstat: case SYS_munmap: case SYS_set_tid_address: return 2;
    case SYS_tgkill: case SYS_getrandom: case SYS_ioctl: case SYS_fcntl: case SYS_lseek: case SYS_readv:
    case SYS_writev: return 3;
    case SYS_rt_sigprocmask: case SYS_rt_sigaction: case SYS_rseq: case SYS_clock_nanosleep: case SYS_openat:
    case SYS_newfstatat: case SYS_wait4: return 4;
    case SYS_clone: case SYS_prctl: case SYS_ppoll: return 5;
    case SYS_sched_yield: case SYS_getpid: case SYS_gettid: return 0;
    default: return 6;
  }
}

}  // namespace memtrace::singlestep::arch
