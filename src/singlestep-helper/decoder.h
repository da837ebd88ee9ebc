// x86-64 instruction decoding for the single-step helper: which bytes does the
// instruction at a faulting ip touch, and can the helper emulate it instead of
// unprotecting the page and single-stepping it.
//
// Capstone 4.0.2 gives explicit memory operands (base/index/scale/disp/size) but
// wrong read/write flags for several stores and no operand for push/pop/call/
// ret/leave (DESIGN.md). So: explicit operands come from capstone, implicit ones
// from the table in decoder.cpp, and read vs write from the fault (tracer.cpp),
// with the static direction below only where the encoding fixes it.
#pragma once
#include <sys/user.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "insn.h"

namespace memtrace::singlestep {

class Decoder {
 public:
  Decoder();
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Decode the instruction in code[0..n) at ip, with the thread's registers.
  // nullopt if capstone cannot decode it.
  std::optional<Insn> decode(uint64_t ip, const uint8_t* code, size_t n,
                             const user_regs_struct& regs) const;

  // Recompute the operand addresses of an already decoded instruction for new
  // register values (rep string elements).
  bool recompute(Insn& insn, const uint8_t* code, size_t n, const user_regs_struct& regs) const;

 private:
  size_t handle_ = 0;
};

// GPR access by capstone register id (64/32/16/8-bit names, rip). nullopt for
// anything else (vector registers, segment registers).
std::optional<uint64_t> reg_read(unsigned reg, const user_regs_struct& r);
// Write with x86 semantics: 32-bit writes zero the upper half, 8/16-bit keep it.
bool reg_write(unsigned reg, uint64_t value, user_regs_struct& r);
unsigned reg_width(unsigned reg);  // bytes, 0 if not a GPR

}  // namespace memtrace::singlestep
