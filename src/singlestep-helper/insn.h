// What the single-step helper knows of one instruction, whatever the
// architecture: the memory it touches in this execution, and whether the
// helper may execute it itself. decoder.h (x86-64) and decoder_arm64.h fill it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace memtrace::singlestep {

enum class Dir : uint8_t {
  kUnknown,    // one explicit operand: the fault decides (read, write, read-write)
  kRead,       // fixed by the encoding (source of movs, stack slot of ret, ...)
  kWrite,      // fixed by the encoding (destination of movs/stos, push slot)
  kReadWrite,  // fixed by the encoding (arm64 atomics; x86 does not use it)
};

struct MemOp {
  uint64_t ea = 0;
  uint32_t size = 0;
  Dir dir = Dir::kUnknown;
};

// How the helper may execute the instruction without unprotecting the page.
enum class Emul : uint8_t {
  kNone,
  kLoad,      // dst GPR <- mem (mov, movzx, movsx, movsxd)
  kStoreReg,  // mem <- src GPR (mov)
  kStoreImm,  // mem <- imm (mov)
};

struct Insn {
  uint64_t ip = 0;
  uint32_t len = 0;
  unsigned id = 0;           // X86_INS_* or ARM64_INS_* (0: an LSE atomic, decoded without capstone)
  std::string text;          // "mov dword ptr [rip + 0x2f1a], eax", "ldp x0, x1, [sp, #-0x10]!"
  std::vector<MemOp> ops;    // every memory access of this execution (one rep element)
  bool rep_string = false;   // rep/repe/repne + string op: one element per step
  bool rmw_if_written = false;  // a written explicit operand is read-write (add, xchg, lock ...)
  // Emulation (kLoad/kStore*): register id (capstone), extension, immediate.
  Emul emul = Emul::kNone;
  unsigned reg = 0;        // x86_reg of the GPR operand
  bool sign_extend = false;
  int64_t imm = 0;
  // arm64 exclusives: 1 a load-exclusive, 2 a store-exclusive (reg: its
  // status register, a capstone ARM64_REG_W*). x86: always 0.
  uint8_t exclusive = 0;
};

}  // namespace memtrace::singlestep
