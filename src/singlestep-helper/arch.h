// What the tracer needs of the CPU it runs on: a stopped thread's registers,
// the decoder for its instructions, and the system call convention (number,
// arguments, result, the instruction and how to re-run it). One file per
// architecture implements it (arch_x86_64.cpp, arch_arm64.cpp); tracer.cpp
// is the same code for both.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#if defined(__aarch64__)
#include "decoder_arm64.h"
#else
#include "decoder.h"
#endif

namespace memtrace::singlestep {

#if defined(__aarch64__)
using Regs = Arm64Regs;             // NT_PRSTATUS + NT_ARM_SYSTEM_CALL
using NativeDecoder = Arm64Decoder;
inline unsigned reg_width(unsigned reg) { return arm64_reg_width(reg); }
#else
using Regs = user_regs_struct;      // PTRACE_GETREGS
using NativeDecoder = Decoder;
#endif

namespace arch {

extern const char* const kName;      // "x86-64", "aarch64"
extern const size_t kSyscallInsnLen;  // syscall: 2, svc #0: 4
extern const char* const kWatchpointIp;  // what a hardware watchpoint's ip is (the record's insn text)

bool get_regs(pid_t tid, Regs& r);
bool set_regs(pid_t tid, const Regs& r);
uint64_t pc(const Regs& r);
void set_pc(Regs& r, uint64_t pc);

// The first system call instruction in code[0..n), as an offset; n if none.
size_t find_syscall_insn(const uint8_t* code, size_t n);

// Registers for running system call nr with arguments a[0..5] at the system
// call instruction at insn (the injected call), and its result once it ran.
void load_injected_syscall(Regs& r, uint64_t insn, long nr, const uint64_t a[6]);
long syscall_result(const Regs& r);
// Registers saved at a stop inside a system call the stop interrupted
// (-ERESTART*, not restarted yet), made to issue that call again from its
// instruction with no restart left to the kernel: what an injection
// restores, so that the program's call goes on whatever stops came between
// (x86-64; arm64 keeps them as they are: its first argument is gone).
void restart_by_hand(Regs& r);

// At a system call's entry stop: argument i (0-based) changed.
void set_syscall_arg(Regs& r, int i, uint64_t v);
// At its entry stop: the kernel runs nr(a0, a1, a2) instead.
void replace_syscall_at_entry(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2);
// Registers of the entry stop, made to run that system call again from the
// instruction (after a call run in its place).
void rerun_from_entry(Regs& entry);
// At an exit stop: run nr(a0, a1, a2) next, from the same instruction.
void rerun_as(Regs& r, long nr, uint64_t a0, uint64_t a1, uint64_t a2);
// The result registers of a call interrupted by a signal (-ERESTART*): made
// to run it again after the signal, as SA_RESTART would; entry: its entry stop.
void restart_interrupted(Regs& result, const Regs& entry);

// aarch64's store-exclusives (STXR, STLXR, STXP, STLXP, and their b/h forms):
// the bytes the one at code would store with registers r (data, *size).
// False for any other instruction, and always on x86-64.
bool store_exclusive_data(const uint8_t* code, size_t n, const Regs& r, uint8_t data[16], uint32_t* size);
// Its status register set (0 stored, 1 not) and the pc past it.
void complete_store_exclusive(Regs& r, const uint8_t* code, bool stored);

// Software breakpoints (--track-allocs-from): the instruction (int3; brk #0),
// and the breakpoint's address from the registers at its SIGTRAP (x86-64:
// rip is past the int3; aarch64: pc is at the brk).
extern const uint8_t kBreakpoint[4];
extern const size_t kBreakpointLen;
uint64_t breakpoint_addr(const Regs& r);
// At a function's entry: integer argument i, and its return address: in
// memory at *slot (x86-64: [rsp]), or, with *slot 0, the value returned
// (aarch64: x30). After it returned: its result.
uint64_t call_arg(const Regs& r, int i);
uint64_t return_address_at_entry(const Regs& r, uint64_t* slot);
uint64_t return_value(const Regs& r);

// Arguments a system call takes (the rest of the registers hold leftovers),
// 6 if not known.
int syscall_nargs(uint64_t nr);

}  // namespace arch
}  // namespace memtrace::singlestep
