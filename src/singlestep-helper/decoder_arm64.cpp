#include "decoder_arm64.h"

#include <capstone/capstone.h>

#include <cstring>
#include <string>

namespace memtrace::singlestep {
namespace {

// A general register's value: x0-x30, w0-w30 (the low half), sp/wsp; the zero
// registers read 0. nullopt for anything else.
std::optional<uint64_t> gpr(unsigned reg, const Arm64Regs& r) {
  if (reg >= ARM64_REG_X0 && reg <= ARM64_REG_X28) return r.x[reg - ARM64_REG_X0];
  if (reg == ARM64_REG_X29) return r.x[29];
  if (reg == ARM64_REG_X30) return r.x[30];
  if (reg >= ARM64_REG_W0 && reg <= ARM64_REG_W30) return r.x[reg - ARM64_REG_W0] & 0xffffffffull;
  if (reg == ARM64_REG_SP) return r.sp;
  if (reg == ARM64_REG_WSP) return r.sp & 0xffffffffull;
  if (reg == ARM64_REG_XZR || reg == ARM64_REG_WZR) return 0;
  return std::nullopt;
}

// Bytes one register operand moves to or from memory: general registers by
// their name (the mnemonic's b/h suffix is applied by the caller), scalar
// SIMD/FP registers by theirs (b/h/s/d/q), vector registers by their
// arrangement (8B..1D: 8 bytes, 16B..2D, 1Q: 16). 0 if not a register.
uint32_t reg_bytes(const cs_arm64_op& op) {
  unsigned r = op.reg;
  if ((r >= ARM64_REG_X0 && r <= ARM64_REG_X28) || r == ARM64_REG_X29 || r == ARM64_REG_X30 ||
      r == ARM64_REG_XZR || r == ARM64_REG_SP)
    return 8;
  if ((r >= ARM64_REG_W0 && r <= ARM64_REG_W30) || r == ARM64_REG_WZR || r == ARM64_REG_WSP) return 4;
  if (r >= ARM64_REG_B0 && r <= ARM64_REG_B31) return 1;
  if (r >= ARM64_REG_H0 && r <= ARM64_REG_H31) return 2;
  if (r >= ARM64_REG_S0 && r <= ARM64_REG_S31) return 4;
  if (r >= ARM64_REG_D0 && r <= ARM64_REG_D31) return 8;
  if (r >= ARM64_REG_Q0 && r <= ARM64_REG_Q31) return 16;
  if (r >= ARM64_REG_V0 && r <= ARM64_REG_V31) {
    switch (op.vas) {
      case ARM64_VAS_8B: case ARM64_VAS_4H: case ARM64_VAS_2S: case ARM64_VAS_1D: return 8;
      default: return 16;
    }
  }
  return 0;
}

bool is_gpr(unsigned r) {
  return (r >= ARM64_REG_X0 && r <= ARM64_REG_X28) || r == ARM64_REG_X29 || r == ARM64_REG_X30 ||
         (r >= ARM64_REG_W0 && r <= ARM64_REG_W30) || r == ARM64_REG_XZR || r == ARM64_REG_WZR;
}

// Element bytes of a vector register operand (single-lane and replicating
// LD1-4/ST1-4 move one element per register).
uint32_t element_bytes(const cs_arm64_op& op) {
  switch (op.vess) {
    case ARM64_VESS_B: return 1;
    case ARM64_VESS_H: return 2;
    case ARM64_VESS_S: return 4;
    case ARM64_VESS_D: return 8;
    default: break;
  }
  switch (op.vas) {
    case ARM64_VAS_8B: case ARM64_VAS_16B: return 1;
    case ARM64_VAS_4H: case ARM64_VAS_8H: return 2;
    case ARM64_VAS_2S: case ARM64_VAS_4S: return 4;
    case ARM64_VAS_1D: case ARM64_VAS_2D: return 8;
    default: return 16;
  }
}

bool starts(const char* m, const char* p) { return std::strncmp(m, p, std::strlen(p)) == 0; }

// The memory-touching instruction classes of the base ISA and SIMD that
// capstone 4 decodes. Everything else (data processing, branches, prfm,
// barriers) touches no memory the helper models.
enum class Kind { kNone, kLoad, kStore, kLoadExclusive, kStoreExclusive, kVectorStruct };

Kind kind_of(const cs_insn* in) {
  const char* m = in->mnemonic;
  if (starts(m, "prfm") || starts(m, "prfum")) return Kind::kNone;
  // ldxr ldaxr ldxp ldaxp (+b/h): exclusive loads; stxr stlxr stxp stlxp: exclusive stores.
  if (starts(m, "ldxr") || starts(m, "ldaxr") || starts(m, "ldxp") || starts(m, "ldaxp")) return Kind::kLoadExclusive;
  if (starts(m, "stxr") || starts(m, "stlxr") || starts(m, "stxp") || starts(m, "stlxp")) return Kind::kStoreExclusive;
  if ((m[0] == 'l' && m[1] == 'd' && m[2] >= '1' && m[2] <= '4') ||
      (m[0] == 's' && m[1] == 't' && m[2] >= '1' && m[2] <= '4'))
    return Kind::kVectorStruct;
  if (m[0] == 'l' && m[1] == 'd') return Kind::kLoad;   // ldr ldur ldp ldnp ldtr ldar ldapr ldrs* ...
  if (m[0] == 's' && m[1] == 't') return Kind::kStore;  // str stur stp stnp sttr stlr ...
  return Kind::kNone;
}

// The access size of a general-register load/store from its mnemonic's
// suffix: ...b 1, ...h 2, ldrsw/ldursw/ldtrsw 4; 0: the register's width.
uint32_t gpr_suffix_bytes(const char* m) {
  size_t n = std::strlen(m);
  if (n >= 2 && std::strcmp(m + n - 2, "sw") == 0) return 4;
  if (m[n - 1] == 'b') return 1;
  if (m[n - 1] == 'h') return 2;
  return 0;
}

// --- LSE atomics (ARMv8.1), from the encoding: capstone 4 does not decode them.

std::string xreg(unsigned n, bool x, bool sp_ok) {
  if (n == 31) return sp_ok ? (x ? "sp" : "wsp") : (x ? "xzr" : "wzr");
  return (x ? "x" : "w") + std::to_string(n);
}

// LDADD/LDCLR/LDEOR/LDSET/LDSMAX/LDSMIN/LDUMAX/LDUMIN (and their ST aliases), SWP,
// LDAPR: size 111 0 00 A R 1 Rs o3 opc 00 Rn Rt. CAS: size 0010001 L 1 Rs o0 11111
// Rn Rt. CASP: 0 sz 0010000 L 1 Rs o0 11111 Rn Rt.
bool decode_lse(uint32_t w, const Arm64Regs& r, Insn& out) {
  unsigned rn = (w >> 5) & 31, rt = w & 31, rs = (w >> 16) & 31;
  uint64_t base = rn == 31 ? r.sp : r.x[rn];
  if ((w & 0x3f200c00u) == 0x38200000u) {
    unsigned size = w >> 30, a = (w >> 23) & 1, rl = (w >> 22) & 1, o3 = (w >> 15) & 1, opc = (w >> 12) & 7;
    static const char* const kOps[] = {"add", "clr", "eor", "set", "smax", "smin", "umax", "umin"};
    const char* sfx = size == 0 ? "b" : size == 1 ? "h" : "";
    bool x = size == 3;
    std::string ord = std::string(a ? "a" : "") + (rl ? "l" : "");
    if (o3 == 1 && opc == 4 && rs == 31 && a && !rl) {  // ldapr (RCpc load)
      out.text = std::string("ldapr") + sfx + " " + xreg(rt, x, false) + ", [" + xreg(rn, true, true) + "]";
      out.ops.push_back({base, 1u << size, Dir::kRead});
      return true;
    }
    if (o3 == 1 && opc != 0) return false;  // unallocated
    if (o3 == 1) {
      out.text = "swp" + ord + sfx + " " + xreg(rs, x, false) + ", " + xreg(rt, x, false) + ", [" +
                 xreg(rn, true, true) + "]";
    } else if (rt == 31 && !a) {  // the STADD.. aliases: the old value is not kept
      out.text = std::string("st") + kOps[opc] + (rl ? "l" : "") + sfx + " " + xreg(rs, x, false) + ", [" +
                 xreg(rn, true, true) + "]";
    } else {
      out.text = std::string("ld") + kOps[opc] + ord + sfx + " " + xreg(rs, x, false) + ", " + xreg(rt, x, false) +
                 ", [" + xreg(rn, true, true) + "]";
    }
    out.ops.push_back({base, 1u << size, Dir::kReadWrite});
    return true;
  }
  bool cas = (w & 0x3fa07c00u) == 0x08a07c00u;
  bool casp = (w & 0xbfa07c00u) == 0x08207c00u;
  if (cas || casp) {
    unsigned l = (w >> 22) & 1, o0 = (w >> 15) & 1;
    std::string ord = std::string(l ? "a" : "") + (o0 ? "l" : "");
    if (cas) {
      unsigned size = w >> 30;
      bool x = size == 3;
      const char* sfx = size == 0 ? "b" : size == 1 ? "h" : "";
      out.text = "cas" + ord + sfx + " " + xreg(rs, x, false) + ", " + xreg(rt, x, false) + ", [" +
                 xreg(rn, true, true) + "]";
      out.ops.push_back({base, 1u << size, Dir::kReadWrite});
    } else {
      bool x = (w >> 30) & 1;
      out.text = "casp" + ord + " " + xreg(rs, x, false) + ", " + xreg(rs + 1, x, false) + ", " + xreg(rt, x, false) +
                 ", " + xreg(rt + 1, x, false) + ", [" + xreg(rn, true, true) + "]";
      out.ops.push_back({base, x ? 16u : 8u, Dir::kReadWrite});
    }
    return true;
  }
  return false;
}

// The memory operand's address: base, plus (unless post-indexed: the access is
// at the base, the immediate or register after the operand only updates it)
// the displacement and the index register, extended and shifted.
std::optional<uint64_t> address(const cs_arm64& a, int mem_i, const Arm64Regs& r) {
  const cs_arm64_op& op = a.operands[mem_i];
  auto base = gpr(op.mem.base, r);
  if (!base) return std::nullopt;
  bool post = a.writeback && mem_i + 1 < a.op_count;
  if (post) return *base;
  uint64_t ea = *base + static_cast<uint64_t>(static_cast<int64_t>(op.mem.disp));
  if (op.mem.index != ARM64_REG_INVALID) {
    auto iv = gpr(op.mem.index, r);
    if (!iv) return std::nullopt;
    uint64_t v = *iv;
    switch (op.ext) {
      case ARM64_EXT_UXTW: v &= 0xffffffffull; break;
      case ARM64_EXT_SXTW: v = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(v))); break;
      default: break;  // uxtx/sxtx/lsl: the 64-bit register
    }
    if (op.shift.type == ARM64_SFT_LSL) v <<= op.shift.value;
    ea += v;
  }
  return ea;
}

bool fill_ops(const cs_insn* in, const Arm64Regs& r, uint32_t dc_zva_bytes, Insn& out) {
  const cs_arm64& a = in->detail->arm64;
  out.ops.clear();
  out.exclusive = 0;
  // dc zva, Xt: zeroes the whole block that holds Xt (glibc's memset uses it).
  if (in->id == ARM64_INS_DC && a.op_count == 2 && a.operands[0].type == ARM64_OP_SYS &&
      a.operands[0].sys == ARM64_DC_ZVA) {
    if (!dc_zva_bytes) return true;
    auto v = gpr(a.operands[1].reg, r);
    if (!v) return false;
    out.ops.push_back({*v & ~static_cast<uint64_t>(dc_zva_bytes - 1), dc_zva_bytes, Dir::kWrite});
    return true;
  }
  Kind k = kind_of(in);
  if (k == Kind::kNone) return true;
  int mem_i = -1;
  for (int i = 0; i < a.op_count; i++)
    if (a.operands[i].type == ARM64_OP_MEM) {
      mem_i = i;
      break;
    }
  Dir dir = (k == Kind::kStore || k == Kind::kStoreExclusive) ? Dir::kWrite
            : k == Kind::kVectorStruct ? (in->mnemonic[0] == 's' ? Dir::kWrite : Dir::kRead)
                                       : Dir::kRead;
  if (mem_i < 0) {
    // ldr/ldrsw/ldr q.. (literal): the second operand is the absolute address.
    if (k == Kind::kLoad && a.op_count == 2 && a.operands[0].type == ARM64_OP_REG &&
        a.operands[1].type == ARM64_OP_IMM) {
      uint32_t size = reg_bytes(a.operands[0]);
      if (is_gpr(a.operands[0].reg) && gpr_suffix_bytes(in->mnemonic)) size = gpr_suffix_bytes(in->mnemonic);
      out.ops.push_back({static_cast<uint64_t>(a.operands[1].imm), size, Dir::kRead});
      return true;
    }
    return k == Kind::kNone;
  }
  auto ea = address(a, mem_i, r);
  if (!ea) return false;
  // The registers moved: those before the memory operand, less the status
  // register of a store-exclusive.
  int first = k == Kind::kStoreExclusive ? 1 : 0;
  uint32_t size = 0;
  for (int i = first; i < mem_i; i++) {
    const cs_arm64_op& op = a.operands[i];
    if (op.type != ARM64_OP_REG) return false;
    if (k == Kind::kVectorStruct) {
      // One element per register for a single lane (ld1 {v0.s}[1]) or a replicating load (ld1r).
      bool one = op.vector_index >= 0 || in->mnemonic[3] == 'r';
      size += one ? element_bytes(op) : reg_bytes(op);
    } else {
      uint32_t b = reg_bytes(op);
      if (is_gpr(op.reg) && gpr_suffix_bytes(in->mnemonic)) b = gpr_suffix_bytes(in->mnemonic);
      size += b;
    }
  }
  if (!size) return false;
  out.ops.push_back({*ea, size, dir});
  if (k == Kind::kLoadExclusive) out.exclusive = 1;
  if (k == Kind::kStoreExclusive) {
    out.exclusive = 2;
    out.reg = a.operands[0].reg;
  }
  return true;
}

// Plain loads and stores of one general register, without writeback: the
// tracer may do them itself (the page stays protected, the other threads
// run on), as x86's plain movs. Not the acquire/release, exclusive,
// unprivileged (ldtr), pair or SIMD forms.
void fill_emulation(const cs_insn* in, Insn& out) {
  const cs_arm64& a = in->detail->arm64;
  out.emul = Emul::kNone;
  if (out.ops.size() != 1 || a.writeback || a.op_count != 2 || a.operands[0].type != ARM64_OP_REG ||
      a.operands[1].type != ARM64_OP_MEM || !is_gpr(a.operands[0].reg))
    return;
  static const char* const kLoads[] = {"ldr", "ldrb", "ldrh", "ldrsb", "ldrsh", "ldrsw",
                                       "ldur", "ldurb", "ldurh", "ldursb", "ldursh", "ldursw"};
  static const char* const kStores[] = {"str", "strb", "strh", "stur", "sturb", "sturh"};
  for (const char* m : kLoads)
    if (std::strcmp(in->mnemonic, m) == 0) {
      out.emul = Emul::kLoad;
      out.reg = a.operands[0].reg;
      out.sign_extend = std::strncmp(m, "ldrs", 4) == 0 || std::strncmp(m, "ldurs", 5) == 0;
      return;
    }
  for (const char* m : kStores)
    if (std::strcmp(in->mnemonic, m) == 0) {
      out.emul = Emul::kStoreReg;
      out.reg = a.operands[0].reg;
      return;
    }
}

}  // namespace

std::optional<uint64_t> reg_read(unsigned reg, const Arm64Regs& r) { return gpr(reg, r); }

bool reg_write(unsigned reg, uint64_t value, Arm64Regs& r) {
  if (reg >= ARM64_REG_X0 && reg <= ARM64_REG_X28) r.x[reg - ARM64_REG_X0] = value;
  else if (reg == ARM64_REG_X29) r.x[29] = value;
  else if (reg == ARM64_REG_X30) r.x[30] = value;
  else if (reg >= ARM64_REG_W0 && reg <= ARM64_REG_W30) r.x[reg - ARM64_REG_W0] = value & 0xffffffffull;
  else if (reg == ARM64_REG_XZR || reg == ARM64_REG_WZR) return true;
  else return false;
  return true;
}

unsigned arm64_reg_width(unsigned reg) {
  if (!is_gpr(reg)) return 0;
  return (reg >= ARM64_REG_W0 && reg <= ARM64_REG_W30) || reg == ARM64_REG_WZR ? 4 : 8;
}

uint32_t Arm64Decoder::host_dc_zva_bytes() {
#if defined(__aarch64__)
  uint64_t v;
  __asm__ volatile("mrs %0, dczid_el0" : "=r"(v));  // readable at EL0; the tracee runs on the same CPUs
  return (v & 16) ? 0 : 4u << (v & 15);
#else
  return 64;
#endif
}

Arm64Decoder::Arm64Decoder(uint32_t dc_zva_bytes) : dc_zva_bytes_(dc_zva_bytes) {
  csh h = 0;
  if (cs_open(CS_ARCH_ARM64, CS_MODE_ARM, &h) == CS_ERR_OK) {
    cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
    handle_ = h;
  }
}

Arm64Decoder::~Arm64Decoder() {
  if (handle_) {
    csh h = handle_;
    cs_close(&h);
  }
}

std::optional<Insn> Arm64Decoder::decode(uint64_t ip, const uint8_t* code, size_t n, const Arm64Regs& regs) const {
  if (n < 4) return std::nullopt;
  Insn out;
  out.ip = ip;
  out.len = 4;
  uint32_t w;
  std::memcpy(&w, code, 4);  // instructions are little-endian
  if (decode_lse(w, regs, out)) return out;
  if (!handle_) return std::nullopt;
  cs_insn* in = nullptr;
  size_t count = cs_disasm(handle_, code, 4, ip, 1, &in);
  if (count == 0) return std::nullopt;
  out.id = in->id;
  out.text = std::string(in->mnemonic) + (in->op_str[0] ? " " : "") + in->op_str;
  bool ok = fill_ops(in, regs, dc_zva_bytes_, out);
  if (ok) fill_emulation(in, out);
  cs_free(in, count);
  if (!ok) {
    out.ops.clear();  // operands not modelled: the fault address alone is recorded
    out.emul = Emul::kNone;
  }
  return out;
}

bool Arm64Decoder::recompute(Insn& insn, const uint8_t* code, size_t n, const Arm64Regs& regs) const {
  auto d = decode(insn.ip, code, n, regs);
  if (!d) return false;
  insn.ops = std::move(d->ops);
  return true;
}

}  // namespace memtrace::singlestep
