#include "decoder.h"

#include <capstone/capstone.h>

#include <cstring>

namespace memtrace::singlestep {
namespace {

struct GprName {
  unsigned r64, r32, r16, r8, r8h;
  unsigned long long user_regs_struct::*field;
};

const GprName kGprs[] = {
    {X86_REG_RAX, X86_REG_EAX, X86_REG_AX, X86_REG_AL, X86_REG_AH, &user_regs_struct::rax},
    {X86_REG_RBX, X86_REG_EBX, X86_REG_BX, X86_REG_BL, X86_REG_BH, &user_regs_struct::rbx},
    {X86_REG_RCX, X86_REG_ECX, X86_REG_CX, X86_REG_CL, X86_REG_CH, &user_regs_struct::rcx},
    {X86_REG_RDX, X86_REG_EDX, X86_REG_DX, X86_REG_DL, X86_REG_DH, &user_regs_struct::rdx},
    {X86_REG_RSI, X86_REG_ESI, X86_REG_SI, X86_REG_SIL, 0, &user_regs_struct::rsi},
    {X86_REG_RDI, X86_REG_EDI, X86_REG_DI, X86_REG_DIL, 0, &user_regs_struct::rdi},
    {X86_REG_RBP, X86_REG_EBP, X86_REG_BP, X86_REG_BPL, 0, &user_regs_struct::rbp},
    {X86_REG_RSP, X86_REG_ESP, X86_REG_SP, X86_REG_SPL, 0, &user_regs_struct::rsp},
    {X86_REG_R8, X86_REG_R8D, X86_REG_R8W, X86_REG_R8B, 0, &user_regs_struct::r8},
    {X86_REG_R9, X86_REG_R9D, X86_REG_R9W, X86_REG_R9B, 0, &user_regs_struct::r9},
    {X86_REG_R10, X86_REG_R10D, X86_REG_R10W, X86_REG_R10B, 0, &user_regs_struct::r10},
    {X86_REG_R11, X86_REG_R11D, X86_REG_R11W, X86_REG_R11B, 0, &user_regs_struct::r11},
    {X86_REG_R12, X86_REG_R12D, X86_REG_R12W, X86_REG_R12B, 0, &user_regs_struct::r12},
    {X86_REG_R13, X86_REG_R13D, X86_REG_R13W, X86_REG_R13B, 0, &user_regs_struct::r13},
    {X86_REG_R14, X86_REG_R14D, X86_REG_R14W, X86_REG_R14B, 0, &user_regs_struct::r14},
    {X86_REG_R15, X86_REG_R15D, X86_REG_R15W, X86_REG_R15B, 0, &user_regs_struct::r15},
};

struct RegRef {
  unsigned long long user_regs_struct::*field;
  unsigned width;  // bytes
  unsigned shift;  // 8 for ah/bh/ch/dh
};

std::optional<RegRef> find_reg(unsigned reg) {
  for (const auto& g : kGprs) {
    if (reg == g.r64) return RegRef{g.field, 8, 0};
    if (reg == g.r32) return RegRef{g.field, 4, 0};
    if (reg == g.r16) return RegRef{g.field, 2, 0};
    if (reg == g.r8) return RegRef{g.field, 1, 0};
    if (g.r8h && reg == g.r8h) return RegRef{g.field, 1, 8};
  }
  if (reg == X86_REG_RIP) return RegRef{&user_regs_struct::rip, 8, 0};
  return std::nullopt;
}

uint64_t mask(unsigned width) { return width >= 8 ? ~0ull : ((1ull << (width * 8)) - 1); }

bool is_vector_reg(unsigned reg) {
  return (reg >= X86_REG_XMM0 && reg <= X86_REG_XMM31) || (reg >= X86_REG_YMM0 && reg <= X86_REG_YMM31) ||
         (reg >= X86_REG_ZMM0 && reg <= X86_REG_ZMM31);
}

// Element size of a string instruction, 0 if id is not one.
struct StringOp {
  unsigned size;
  bool reads_rsi, reads_rdi, writes_rdi;
};
std::optional<StringOp> string_op(const cs_insn* in) {
  const cs_x86& x = in->detail->x86;
  // MOVSD/CMPSD are also SSE instructions: the string forms have no register operand.
  for (int i = 0; i < x.op_count; i++)
    if (x.operands[i].type == X86_OP_REG || x.operands[i].type == X86_OP_IMM) {
      if (in->id == X86_INS_MOVSD || in->id == X86_INS_CMPSD) return std::nullopt;
    }
  switch (in->id) {
    case X86_INS_MOVSB: return StringOp{1, true, false, true};
    case X86_INS_MOVSW: return StringOp{2, true, false, true};
    case X86_INS_MOVSD: return StringOp{4, true, false, true};
    case X86_INS_MOVSQ: return StringOp{8, true, false, true};
    case X86_INS_STOSB: return StringOp{1, false, false, true};
    case X86_INS_STOSW: return StringOp{2, false, false, true};
    case X86_INS_STOSD: return StringOp{4, false, false, true};
    case X86_INS_STOSQ: return StringOp{8, false, false, true};
    case X86_INS_LODSB: return StringOp{1, true, false, false};
    case X86_INS_LODSW: return StringOp{2, true, false, false};
    case X86_INS_LODSD: return StringOp{4, true, false, false};
    case X86_INS_LODSQ: return StringOp{8, true, false, false};
    case X86_INS_SCASB: return StringOp{1, false, true, false};
    case X86_INS_SCASW: return StringOp{2, false, true, false};
    case X86_INS_SCASD: return StringOp{4, false, true, false};
    case X86_INS_SCASQ: return StringOp{8, false, true, false};
    case X86_INS_CMPSB: return StringOp{1, true, true, false};
    case X86_INS_CMPSW: return StringOp{2, true, true, false};
    case X86_INS_CMPSD: return StringOp{4, true, true, false};
    case X86_INS_CMPSQ: return StringOp{8, true, true, false};
    default: return std::nullopt;
  }
}

// Instructions whose explicit memory operand is a pure destination when written.
bool pure_store(const cs_insn* in) {
  const char* m = in->mnemonic;
  auto starts = [&](const char* p) { return std::strncmp(m, p, std::strlen(p)) == 0; };
  return starts("mov") || starts("vmov") || starts("set") || starts("pextr") || starts("vpextr") ||
         starts("extractps") || starts("vextract") || starts("fst") || starts("fist") || starts("fnst") ||
         starts("fbstp") || starts("stmxcsr") || starts("vstmxcsr") || starts("fxsave") || starts("xsave") ||
         starts("vcvtps2ph") || starts("vpmov") || starts("vcompress") || starts("vpcompress") ||
         starts("maskmov") || starts("vmaskmov") || starts("vpmaskmov") || starts("vscatter") ||
         starts("vpscatter");
}

bool no_access(unsigned id) {
  switch (id) {
    case X86_INS_LEA: case X86_INS_NOP: case X86_INS_PREFETCH: case X86_INS_PREFETCHNTA:
    case X86_INS_PREFETCHT0: case X86_INS_PREFETCHT1: case X86_INS_PREFETCHT2: case X86_INS_PREFETCHW:
    case X86_INS_CLFLUSH: case X86_INS_CLFLUSHOPT: case X86_INS_ENDBR64:
      return true;
    default:
      return false;
  }
}

std::optional<uint64_t> effective_address(const cs_insn* in, const cs_x86_op& op, const user_regs_struct& r) {
  uint64_t ea = static_cast<uint64_t>(op.mem.disp);
  if (op.mem.base != X86_REG_INVALID) {
    if (op.mem.base == X86_REG_RIP) {
      ea += in->address + in->size;
    } else {
      auto v = reg_read(op.mem.base, r);
      if (!v) return std::nullopt;
      ea += *v;
    }
  }
  if (op.mem.index != X86_REG_INVALID) {
    if (is_vector_reg(op.mem.index)) return std::nullopt;  // VSIB gather/scatter: not modelled
    auto v = reg_read(op.mem.index, r);
    if (!v) return std::nullopt;
    ea += *v * static_cast<uint64_t>(op.mem.scale);
  }
  if (op.mem.segment == X86_REG_FS) ea += r.fs_base;
  if (op.mem.segment == X86_REG_GS) ea += r.gs_base;
  if (in->detail->x86.addr_size == 4) ea &= 0xffffffffull;
  return ea;
}

bool fill_ops(const cs_insn* in, const user_regs_struct& r, Insn& out) {
  const cs_x86& x = in->detail->x86;
  out.ops.clear();
  out.rep_string = false;
  const uint64_t rsp = r.rsp;
  if (no_access(in->id)) return true;

  if (auto s = string_op(in)) {
    out.rep_string = x.prefix[0] == X86_PREFIX_REP || x.prefix[0] == X86_PREFIX_REPNE;
    if (out.rep_string && (x.addr_size == 4 ? (r.rcx & 0xffffffff) : r.rcx) == 0) return true;
    uint64_t rsi = r.rsi, rdi = r.rdi;
    if (x.addr_size == 4) rsi &= 0xffffffff, rdi &= 0xffffffff;
    if (s->reads_rsi) out.ops.push_back({rsi, s->size, Dir::kRead});
    if (s->reads_rdi) out.ops.push_back({rdi, s->size, Dir::kRead});
    if (s->writes_rdi) out.ops.push_back({rdi, s->size, Dir::kWrite});
    return true;
  }

  // Explicit memory operands.
  int mem_count = 0;
  for (int i = 0; i < x.op_count; i++) {
    const cs_x86_op& op = x.operands[i];
    if (op.type != X86_OP_MEM) continue;
    auto ea = effective_address(in, op, r);
    if (!ea) return false;
    uint32_t size = op.size;
    // bt/bts/btr/btc [mem], reg: the bit offset in reg is signed and unbounded.
    if ((in->id == X86_INS_BT || in->id == X86_INS_BTS || in->id == X86_INS_BTR || in->id == X86_INS_BTC) &&
        x.op_count == 2 && x.operands[1].type == X86_OP_REG) {
      auto bit = reg_read(x.operands[1].reg, r);
      unsigned w = reg_width(x.operands[1].reg);
      if (!bit) return false;
      int64_t b = w == 8 ? static_cast<int64_t>(*bit) : w == 4 ? static_cast<int32_t>(*bit) : static_cast<int16_t>(*bit);
      *ea += static_cast<uint64_t>(b >> 3);
      size = 1;
    }
    Dir d = Dir::kUnknown;
    if (in->id == X86_INS_PUSH || in->id == X86_INS_CALL || in->id == X86_INS_JMP) d = Dir::kRead;
    if (in->id == X86_INS_POP) d = Dir::kWrite;
    out.ops.push_back({*ea, size, d});
    mem_count++;
  }
  // Implicit stack operands.
  switch (in->id) {
    case X86_INS_PUSH: case X86_INS_PUSHFQ: case X86_INS_CALL:
      out.ops.push_back({rsp - 8, 8, Dir::kWrite});
      break;
    case X86_INS_POP: case X86_INS_POPFQ: case X86_INS_RET:
      out.ops.push_back({rsp, 8, Dir::kRead});
      if (in->id == X86_INS_POP && mem_count) {
        // pop [mem]: the destination address is computed with rsp already incremented.
        for (auto& o : out.ops)
          if (o.dir == Dir::kWrite) o.ea += 8;
      }
      break;
    case X86_INS_LEAVE:
      out.ops.push_back({r.rbp, 8, Dir::kRead});
      break;
    default:
      break;
  }
  return true;
}

void fill_emulation(const cs_insn* in, Insn& out) {
  const cs_x86& x = in->detail->x86;
  out.emul = Emul::kNone;
  if (x.op_count != 2 || x.prefix[0] != 0) return;  // no lock/rep
  if (x.operands[0].type == X86_OP_MEM && x.operands[0].mem.segment != X86_REG_INVALID &&
      x.operands[0].mem.segment != X86_REG_FS && x.operands[0].mem.segment != X86_REG_GS)
    return;
  const cs_x86_op& a = x.operands[0];
  const cs_x86_op& b = x.operands[1];
  switch (in->id) {
    case X86_INS_MOV:
      if (a.type == X86_OP_REG && b.type == X86_OP_MEM && reg_width(a.reg) && reg_width(a.reg) == b.size) {
        out.emul = Emul::kLoad;
        out.reg = a.reg;
      } else if (a.type == X86_OP_MEM && b.type == X86_OP_REG && reg_width(b.reg) == a.size) {
        out.emul = Emul::kStoreReg;
        out.reg = b.reg;
      } else if (a.type == X86_OP_MEM && b.type == X86_OP_IMM) {
        out.emul = Emul::kStoreImm;
        out.imm = b.imm;
      }
      break;
    case X86_INS_MOVZX: case X86_INS_MOVSX: case X86_INS_MOVSXD:
      if (a.type == X86_OP_REG && b.type == X86_OP_MEM && reg_width(a.reg)) {
        out.emul = Emul::kLoad;
        out.reg = a.reg;
        out.sign_extend = in->id != X86_INS_MOVZX;
      }
      break;
    default:
      break;
  }
}

}  // namespace

std::optional<uint64_t> reg_read(unsigned reg, const user_regs_struct& r) {
  auto ref = find_reg(reg);
  if (!ref) return std::nullopt;
  return (r.*(ref->field) >> ref->shift) & mask(ref->width);
}

bool reg_write(unsigned reg, uint64_t value, user_regs_struct& r) {
  auto ref = find_reg(reg);
  if (!ref) return false;
  auto& f = r.*(ref->field);
  if (ref->width == 8) f = value;
  else if (ref->width == 4) f = value & 0xffffffffull;
  else f = (f & ~(mask(ref->width) << ref->shift)) | ((value & mask(ref->width)) << ref->shift);
  return true;
}

unsigned reg_width(unsigned reg) {
  auto ref = find_reg(reg);
  return ref && reg != X86_REG_RIP ? ref->width : 0;
}

Decoder::Decoder() {
  csh h = 0;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &h) == CS_ERR_OK) {
    cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
    handle_ = h;
  }
}

Decoder::~Decoder() {
  if (handle_) {
    csh h = handle_;
    cs_close(&h);
  }
}

std::optional<Insn> Decoder::decode(uint64_t ip, const uint8_t* code, size_t n,
                                    const user_regs_struct& regs) const {
  if (!handle_) return std::nullopt;
  cs_insn* in = nullptr;
  size_t count = cs_disasm(handle_, code, n, ip, 1, &in);
  if (count == 0) return std::nullopt;
  Insn out;
  out.ip = ip;
  out.len = in->size;
  out.id = in->id;
  out.text = std::string(in->mnemonic) + (in->op_str[0] ? " " : "") + in->op_str;
  bool ok = fill_ops(in, regs, out);
  if (ok) {
    const cs_x86& x = in->detail->x86;
    out.rmw_if_written = !pure_store(in) || x.prefix[0] == X86_PREFIX_LOCK;
    fill_emulation(in, out);
  }
  cs_free(in, count);
  if (!ok) {
    out.ops.clear();  // operands not modelled: the fault address alone is recorded
    out.emul = Emul::kNone;
  }
  return out;
}

bool Decoder::recompute(Insn& insn, const uint8_t* code, size_t n, const user_regs_struct& regs) const {
  cs_insn* in = nullptr;
  size_t count = cs_disasm(handle_, code, n, insn.ip, 1, &in);
  if (count == 0) return false;
  bool ok = fill_ops(in, regs, insn);
  cs_free(in, count);
  return ok;
}

}  // namespace memtrace::singlestep
