// Internals tracer.cpp, tracer_faults.cpp and tracer_syscalls.cpp share
// (one Tracer, three files along what a stop is about: starting, running and
// detaching; an access to a protected page; a system call).
#pragma once

#include <signal.h>
#include <sys/ptrace.h>

#include <cstdint>

#include "arch.h"

// <sys/ptrace.h> and <linux/ptrace.h> disagree on a few names; use raw numbers.
#ifndef PTRACE_GET_SYSCALL_INFO_NR
#define PTRACE_GET_SYSCALL_INFO_NR 0x420e
#endif

namespace memtrace::singlestep::internal {

inline constexpr uint64_t kPage = 4096;
inline constexpr uint64_t kSlotSize = 256 * 1024;
inline constexpr int kSlots = 8;
inline constexpr long kOptions = PTRACE_O_TRACECLONE | PTRACE_O_TRACEEXEC | PTRACE_O_TRACESYSGOOD;

inline uint64_t page_of(uint64_t a) { return a & ~(kPage - 1); }

inline long pt(int req, pid_t tid, uint64_t addr, uint64_t data) {
  return ptrace(static_cast<__ptrace_request>(req), tid, reinterpret_cast<void*>(addr),
                reinterpret_cast<void*>(data));
}

using arch::get_regs;
using arch::set_regs;
inline bool get_siginfo(pid_t tid, siginfo_t& si) {
  return pt(PTRACE_GETSIGINFO, tid, 0, reinterpret_cast<uint64_t>(&si)) == 0;
}

// Linux ptrace_syscall_info (linux/ptrace.h), kept local to avoid header clashes.
struct SyscallInfo {
  uint8_t op;
  uint8_t pad[3];
  uint32_t arch;
  uint64_t instruction_pointer;
  uint64_t stack_pointer;
  union {
    struct {
      uint64_t nr;
      uint64_t args[6];
    } entry;
    struct {
      int64_t rval;
      uint8_t is_error;
    } exit;
    struct {
      uint64_t nr;
      uint64_t args[6];
      uint32_t ret_data;
    } seccomp;
  };
};


}  // namespace memtrace::singlestep::internal
