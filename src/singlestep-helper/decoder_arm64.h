// aarch64 load/store decoding for the single-step helper: which bytes does
// the instruction at a faulting pc touch. Host-independent (its registers are
// Arm64Regs, not <sys/user.h>), so the x86-64 unit tests decode arm64 bytes
// too (tests/singlestep/decoder_arm64_test.cpp).
//
// Capstone 4.0.2 (Debian 12) in CS_ARCH_ARM64 mode gives every base-ISA and
// SIMD load/store with its memory operand (base, index, extend/shift, disp),
// writeback, and the post-index immediate or register as a separate operand;
// the LSE atomics (ARMv8.1: LDADD.., SWP, CAS, CASP) it does not know at all,
// so they are decoded here from their encoding. Read vs write is fixed by the
// encoding on arm64 (no x86 "add [mem], reg"): loads read, stores write,
// atomics read-write; the tracer never needs the fault to tell.
#pragma once
#include <cstdint>
#include <optional>

#include "insn.h"

namespace memtrace::singlestep {

// The layout of the kernel's user_pt_regs (NT_PRSTATUS), plus the system call
// number (NT_ARM_SYSTEM_CALL), which the tracer sets for injected calls.
struct Arm64Regs {
  uint64_t x[31] = {};  // x0..x30
  uint64_t sp = 0;
  uint64_t pc = 0;
  uint64_t pstate = 0;
  int32_t syscallno = -1;
};

class Arm64Decoder {
 public:
  // dc_zva_bytes: the block DC ZVA zeroes, 0 if prohibited; by default this
  // CPU's (DCZID_EL0) on aarch64, 64 elsewhere.
  explicit Arm64Decoder(uint32_t dc_zva_bytes = host_dc_zva_bytes());
  static uint32_t host_dc_zva_bytes();
  ~Arm64Decoder();
  Arm64Decoder(const Arm64Decoder&) = delete;
  Arm64Decoder& operator=(const Arm64Decoder&) = delete;

  // The instruction in code[0..n) at ip with the thread's registers. nullopt
  // if neither capstone nor the LSE table knows it. ops is empty for an
  // instruction without a memory access (or one not modelled: the tracer then
  // records the fault address alone).
  std::optional<Insn> decode(uint64_t ip, const uint8_t* code, size_t n, const Arm64Regs& regs) const;
  // The same instruction with new register values.
  bool recompute(Insn& insn, const uint8_t* code, size_t n, const Arm64Regs& regs) const;

 private:
  size_t handle_ = 0;
  uint32_t dc_zva_bytes_;
};

// General registers by capstone id (x0-x30, w0-w30, sp, the zero registers),
// for the tracer's own execution of an instruction; nullopt/false otherwise.
std::optional<uint64_t> reg_read(unsigned reg, const Arm64Regs& r);
bool reg_write(unsigned reg, uint64_t value, Arm64Regs& r);  // w: the upper half zeroed
unsigned arm64_reg_width(unsigned reg);                      // bytes, 0 if not a general register

}  // namespace memtrace::singlestep
