#include "common/hex.h"
#include "probes/probe_placement.h"

#include <capstone/capstone.h>
#include <sys/utsname.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>

namespace memtrace::probes {

namespace {

// One capstone handle per thread (Intel syntax, details on).
struct Capstone {
  csh h = 0;
  bool ok = false;
  Capstone() {
    ok = cs_open(CS_ARCH_X86, CS_MODE_64, &h) == CS_ERR_OK;
    if (ok) cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
  }
  ~Capstone() {
    if (ok) cs_close(&h);
  }
};
csh cs() {
  thread_local Capstone c;
  return c.ok ? c.h : 0;
}

// One decoded instruction, owned.
struct Insn {
  cs_insn* p = nullptr;
  explicit Insn(cs_insn* i) : p(i) {}
  Insn(const Insn&) = delete;
  Insn& operator=(const Insn&) = delete;
  ~Insn() {
    if (p) cs_free(p, 1);
  }
  const cs_x86& x86() const { return p->detail->x86; }
  std::string text() const {
    std::string s = p->mnemonic;
    if (p->op_str[0]) s += std::string(" ") + p->op_str;
    return s;
  }
};

std::optional<Insn> decode(const uint8_t* code, size_t len, uint64_t addr) {
  csh h = cs();
  if (!h || len == 0) return std::nullopt;
  cs_insn* out = nullptr;
  if (cs_disasm(h, code, len, addr, 1, &out) != 1) return std::nullopt;
  return std::optional<Insn>(std::in_place, out);
}

// The kernel's nops (arch/x86/include/asm/nops.h, 64-bit), x86_nops[len].
const std::vector<std::vector<uint8_t>>& x86_nops() {
  static const std::vector<std::vector<uint8_t>> n = {
      {},
      {0x90},
      {0x66, 0x90},
      {0x0f, 0x1f, 0x00},
      {0x0f, 0x1f, 0x40, 0x00},
      {0x0f, 0x1f, 0x44, 0x00, 0x00},
      {0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00},
      {0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00},
      {0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00},
      // 9..11 start with 0x2e (cs): refused by is_prefix_bad before this check.
  };
  return n;
}

// One-byte opcodes that good_insns_64 rejects (uprobe_init_insn: -ENOTSUPP).
bool bad_opcode_64(uint8_t op) {
  static const uint8_t bad[] = {0x06, 0x07, 0x0e, 0x16, 0x17, 0x1e, 0x1f, 0x27, 0x2f, 0x37, 0x3f,
                                0x60, 0x61, 0x62, 0x6c, 0x6d, 0x6e, 0x6f, 0x82, 0x9a, 0xcc, 0xcd,
                                0xce, 0xcf, 0xd4, 0xd5, 0xd6, 0xe4, 0xe5, 0xe6, 0xe7, 0xea, 0xec,
                                0xed, 0xee, 0xef, 0xf1, 0xf4, 0xfa, 0xfb};
  return std::find(std::begin(bad), std::end(bad), op) != std::end(bad);
}

bool is_jcc8(uint8_t op) { return op >= 0x70 && op <= 0x7f; }

// GPR family (x86 encoding number 0..15) of a capstone register, -1 if none.
int gpr(unsigned r) {
  switch (r) {
    case X86_REG_RAX: case X86_REG_EAX: case X86_REG_AX: case X86_REG_AL: case X86_REG_AH: return 0;
    case X86_REG_RCX: case X86_REG_ECX: case X86_REG_CX: case X86_REG_CL: case X86_REG_CH: return 1;
    case X86_REG_RDX: case X86_REG_EDX: case X86_REG_DX: case X86_REG_DL: case X86_REG_DH: return 2;
    case X86_REG_RBX: case X86_REG_EBX: case X86_REG_BX: case X86_REG_BL: case X86_REG_BH: return 3;
    case X86_REG_RSP: case X86_REG_ESP: case X86_REG_SP: case X86_REG_SPL: return 4;
    case X86_REG_RBP: case X86_REG_EBP: case X86_REG_BP: case X86_REG_BPL: return 5;
    case X86_REG_RSI: case X86_REG_ESI: case X86_REG_SI: case X86_REG_SIL: return 6;
    case X86_REG_RDI: case X86_REG_EDI: case X86_REG_DI: case X86_REG_DIL: return 7;
    case X86_REG_R8: case X86_REG_R8D: case X86_REG_R8W: case X86_REG_R8B: return 8;
    case X86_REG_R9: case X86_REG_R9D: case X86_REG_R9W: case X86_REG_R9B: return 9;
    case X86_REG_R10: case X86_REG_R10D: case X86_REG_R10W: case X86_REG_R10B: return 10;
    case X86_REG_R11: case X86_REG_R11D: case X86_REG_R11W: case X86_REG_R11B: return 11;
    case X86_REG_R12: case X86_REG_R12D: case X86_REG_R12W: case X86_REG_R12B: return 12;
    case X86_REG_R13: case X86_REG_R13D: case X86_REG_R13W: case X86_REG_R13B: return 13;
    case X86_REG_R14: case X86_REG_R14D: case X86_REG_R14W: case X86_REG_R14B: return 14;
    case X86_REG_R15: case X86_REG_R15D: case X86_REG_R15W: case X86_REG_R15B: return 15;
    default: return -1;
  }
}
const char* gpr_name(int f) {
  static const char* n[] = {"rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
                            "r8",  "r9",  "r10", "r11", "r12", "r13", "r14", "r15"};
  return f >= 0 && f < 16 ? n[f] : "?";
}
// System V argument i -> GPR family.
const int kArgGpr[6] = {7, 6, 2, 1, 8, 9};

std::string plus(uint64_t off) { return "+" + hex(off); }

bool has_group(const cs_insn* i, uint8_t g) {
  for (uint8_t k = 0; k < i->detail->groups_count; k++)
    if (i->detail->groups[k] == g) return true;
  return false;
}
bool is_control_flow(const cs_insn* i) {
  if (has_group(i, X86_GRP_JUMP) || has_group(i, X86_GRP_CALL) || has_group(i, X86_GRP_RET) ||
      has_group(i, X86_GRP_INT) || has_group(i, X86_GRP_IRET))
    return true;
  switch (i->id) {
    case X86_INS_SYSCALL: case X86_INS_SYSENTER: case X86_INS_UD2: case X86_INS_UD0:
    case X86_INS_HLT: case X86_INS_INT3: case X86_INS_INT: case X86_INS_INT1:
    case X86_INS_LOOP: case X86_INS_LOOPE: case X86_INS_LOOPNE: case X86_INS_JRCXZ:
    case X86_INS_JECXZ: case X86_INS_XBEGIN: case X86_INS_XABORT: case X86_INS_XEND:
      return true;
    default:
      return false;
  }
}
// Instructions whose first (Intel) operand is only read.
bool first_operand_read_only(unsigned id) {
  switch (id) {
    case X86_INS_CMP: case X86_INS_TEST: case X86_INS_BT: case X86_INS_PUSH:
    case X86_INS_UCOMISS: case X86_INS_UCOMISD: case X86_INS_COMISS: case X86_INS_COMISD:
    case X86_INS_PTEST: case X86_INS_VPTEST: case X86_INS_NOP: case X86_INS_ENDBR64:
    case X86_INS_PREFETCH: case X86_INS_PREFETCHT0: case X86_INS_PREFETCHT1:
    case X86_INS_PREFETCHT2: case X86_INS_PREFETCHNTA: case X86_INS_PREFETCHW:
      return true;
    default:
      return false;
  }
}
bool writes_all_register_operands(unsigned id) {
  switch (id) {
    case X86_INS_XCHG: case X86_INS_XADD: case X86_INS_CMPXCHG: case X86_INS_CMPXCHG8B:
    case X86_INS_CMPXCHG16B:
      return true;
    default:
      return false;
  }
}
bool is_string_op(unsigned id) {
  switch (id) {
    case X86_INS_MOVSB: case X86_INS_MOVSW: case X86_INS_MOVSD: case X86_INS_MOVSQ:
    case X86_INS_STOSB: case X86_INS_STOSW: case X86_INS_STOSD: case X86_INS_STOSQ:
    case X86_INS_LODSB: case X86_INS_LODSW: case X86_INS_LODSD: case X86_INS_LODSQ:
    case X86_INS_CMPSB: case X86_INS_CMPSW: case X86_INS_CMPSD: case X86_INS_CMPSQ:
    case X86_INS_SCASB: case X86_INS_SCASW: case X86_INS_SCASD: case X86_INS_SCASQ:
      return true;
    default:
      return false;
  }
}

// GPR families an instruction writes: capstone's explicit and implicit lists,
// plus the destination operand (capstone 4's access flags are not trusted alone).
uint32_t written_gprs(const Insn& in) {
  uint32_t mask = 0;
  cs_regs rr, ww;
  uint8_t nr = 0, nw = 0;
  if (cs_regs_access(cs(), in.p, rr, &nr, ww, &nw) == CS_ERR_OK)
    for (uint8_t k = 0; k < nw; k++)
      if (int f = gpr(ww[k]); f >= 0) mask |= 1u << f;
  const cs_x86& x = in.x86();
  for (uint8_t k = 0; k < x.op_count; k++) {
    const cs_x86_op& op = x.operands[k];
    if (op.type != X86_OP_REG) continue;
    bool w = (op.access & CS_AC_WRITE) || writes_all_register_operands(in.p->id) ||
             (k == 0 && !first_operand_read_only(in.p->id));
    if (w)
      if (int f = gpr(op.reg); f >= 0) mask |= 1u << f;
  }
  switch (in.p->id) {  // implicit results capstone 4 may miss
    case X86_INS_MUL: case X86_INS_DIV: case X86_INS_IDIV: case X86_INS_CQO: case X86_INS_CDQ:
    case X86_INS_CWD: case X86_INS_RDTSC: case X86_INS_RDTSCP: case X86_INS_RDPMC:
    case X86_INS_CPUID: case X86_INS_XGETBV:
      mask |= 1u << 0 | 1u << 2 | 1u << 1 | 1u << 3;
      break;
    case X86_INS_IMUL:
      if (x.op_count == 1) mask |= 1u << 0 | 1u << 2;
      break;
    default:
      break;
  }
  return mask;
}

struct Scan {
  std::set<uint64_t> targets;       // direct branch targets (offsets from entry) inside the function
  std::optional<uint64_t> indirect; // first indirect jmp
  uint64_t bytes = 0;
};

Scan scan_branches(const std::vector<uint8_t>& code, uint64_t addr) {
  Scan s;
  size_t off = 0;
  while (off < code.size()) {
    auto in = decode(code.data() + off, code.size() - off, addr + off);
    if (!in) {
      off++;
      continue;
    }
    const cs_x86& x = in->x86();
    bool jump = has_group(in->p, X86_GRP_JUMP) || has_group(in->p, X86_GRP_CALL);
    if (jump && x.op_count >= 1 && x.operands[0].type == X86_OP_IMM) {
      uint64_t t = static_cast<uint64_t>(x.operands[0].imm);
      if (t >= addr && t < addr + code.size()) s.targets.insert(t - addr);
    } else if (has_group(in->p, X86_GRP_JUMP) && !s.indirect) {
      s.indirect = off;
    }
    off += in->p->size;
  }
  s.bytes = code.size();
  return s;
}

}  // namespace

KernelCaps KernelCaps::for_version(int major, int minor) {
  KernelCaps c;
  c.major = major;
  c.minor = minor;
  auto at_least = [&](int M, int m) { return major > M || (major == M && minor >= m); };
  c.push = at_least(4, 15);
  c.nop_prefixed = at_least(6, 2);
  c.nop_x86_nops = at_least(6, 16);
  c.arm64_nop = at_least(6, 13);
  return c;
}

const KernelCaps& KernelCaps::running() {
  static const KernelCaps caps = [] {
    struct utsname u;
    int M = 0, m = 0;
    if (uname(&u) == 0) sscanf(u.release, "%d.%d", &M, &m);
    return for_version(M, m);
  }();
  return caps;
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kEmulated: return "emulated";
    case Verdict::kSingleStep: return "single-stepped out of line";
    case Verdict::kRefused: return "refused by the kernel";
    case Verdict::kUndecodable: return "undecodable";
  }
  return "?";
}

Verdict kernel_verdict(const uint8_t* insn, size_t len, const KernelCaps& caps, size_t* insn_len) {
  auto in = decode(insn, len, 0);
  if (!in) return Verdict::kUndecodable;
  size_t n = in->p->size;
  if (insn_len) *insn_len = n;

  // Prefixes as the kernel's decoder sees them: legacy prefixes, then REX.
  size_t i = 0;
  bool p66 = false, bad_prefix = false;
  while (i < n) {
    uint8_t b = insn[i];
    if (b == 0x26 || b == 0x2e || b == 0x36 || b == 0x3e || b == 0xf0) {
      bad_prefix = true;  // is_prefix_bad: es/cs/ss/ds, lock
    } else if (b == 0x66) {
      p66 = true;
    } else if (!(b == 0x64 || b == 0x65 || b == 0x67 || b == 0xf2 || b == 0xf3)) {
      break;
    }
    i++;
  }
  size_t legacy = i;
  uint8_t rex = 0;
  if (i < n && (insn[i] & 0xf0) == 0x40) rex = insn[i++];
  if (i >= n) return Verdict::kUndecodable;
  if (bad_prefix) return Verdict::kRefused;
  uint8_t op = insn[i];
  if (op == 0x8e && i + 1 < n && ((insn[i + 1] >> 3) & 7) == 2) return Verdict::kRefused;  // mov to ss
  if (bad_opcode_64(op)) return Verdict::kRefused;

  // branch_setup_xol_ops: the kernel's nops first (6.16+), then the switch.
  if (caps.nop_x86_nops && n < x86_nops().size() && std::memcmp(insn, x86_nops()[n].data(), n) == 0)
    return Verdict::kEmulated;
  if (op == 0x90) return (caps.nop_prefixed || !p66) ? Verdict::kEmulated : Verdict::kRefused;
  bool branch = op == 0xeb || op == 0xe9 || op == 0xe8 || is_jcc8(op) ||
                (op == 0x0f && i + 1 < n && insn[i + 1] >= 0x80 && insn[i + 1] <= 0x8f);
  if (branch) return p66 ? Verdict::kRefused : Verdict::kEmulated;

  // push_setup_xol_ops: 50-57 alone, or with exactly REX 0x41.
  if (caps.push && op >= 0x50 && op <= 0x57) {
    if (n == 1) return Verdict::kEmulated;
    if (n == 2 && legacy == 0 && rex == 0x41) return Verdict::kEmulated;
  }
  return Verdict::kSingleStep;
}

bool kernel_emulates(const uint8_t* insn, size_t len, const KernelCaps& caps) {
  return kernel_verdict(insn, len, caps) == Verdict::kEmulated;
}

bool kernel_emulates(const uint8_t* insn, size_t len) {
  return kernel_emulates(insn, len, KernelCaps::running());
}

Placement choose_entry_offset(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs) {
  return choose_entry_offset(code, addr, needs, PlaceOptions{});
}

Placement choose_entry_offset(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs,
                              const PlaceOptions& opts) {
  if (opts.isa == Isa::kArm64) return choose_entry_offset_arm64(code, addr, needs, opts);
  Placement p;
  uint32_t forbidden = 0;  // GPR families the prefix must not write
  for (int a = 0; a < 6; a++)
    if (needs.arg_mask & (1u << a)) forbidden |= 1u << kArgGpr[a];
  if (needs.reads_rbp) forbidden |= 1u << 5;

  // The fallback: offset 0, whatever the kernel does there.
  auto at_zero = [&](const std::string& why) {
    Placement z;
    z.offset = 0;
    z.rsp_adjust = 0;
    z.checked_bytes = code.size();
    size_t n = 0;
    Verdict v = code.empty() ? Verdict::kUndecodable : kernel_verdict(code.data(), code.size(), opts.caps, &n);
    if (auto in = decode(code.data(), code.size(), addr)) z.insn = in->text();
    z.emulated = v == Verdict::kEmulated;
    z.reason = std::string(z.emulated ? "first instruction is emulated" : verdict_name(v)) +
               (why.empty() ? "" : "; " + why);
    return z;
  };
  if (code.empty()) return at_zero("no code bytes");

  int32_t adj = 0;
  std::vector<std::string> skipped;
  std::string stop;
  size_t off = 0;
  const size_t kMaxPrefix = 24;  // instructions; the straight line before a branch is short
  while (off < code.size()) {
    auto in = decode(code.data() + off, code.size() - off, addr + off);
    if (!in) {
      stop = "cannot decode at " + plus(off);
      break;
    }
    const uint8_t* b = code.data() + off;
    size_t n = in->p->size;
    Verdict v = kernel_verdict(b, n, opts.caps);
    // 41 90 is xchg %eax,%r8d, which the kernel's "prefix* + nop" rule would skip as a nop.
    size_t lp = 0;
    while (lp < n && (b[lp] == 0x66 || b[lp] == 0x67 || b[lp] == 0xf2 || b[lp] == 0xf3 ||
                      b[lp] == 0x64 || b[lp] == 0x65))
      lp++;
    bool fake_nop = lp + 1 < n && (b[lp] & 0xf1) == 0x41 && b[lp + 1] == 0x90;
    if (v == Verdict::kEmulated && !fake_nop) {
      if (off == 0) {
        Placement z = at_zero("");
        return z;
      }
      // Reached on every call only if nothing branches into (0, off].
      std::set<uint64_t> targets(opts.incoming_targets.begin(), opts.incoming_targets.end());
      Scan s = scan_branches(code, addr);
      targets.insert(s.targets.begin(), s.targets.end());
      for (uint64_t t : targets)
        if (t > 0 && t <= off) return at_zero("a branch targets " + plus(t) + ", inside the entry path before " + in->text());
      p.offset = off;
      p.insn = in->text();
      p.emulated = true;
      p.rsp_adjust = adj;
      p.skipped = skipped;
      p.checked_bytes = s.bytes;
      std::string kind = in->p->id == X86_INS_PUSH ? "push"
                         : has_group(in->p, X86_GRP_CALL) ? "call"
                         : has_group(in->p, X86_GRP_JUMP) ? "jmp/jcc"
                                                          : "nop";
      p.reason = "first emulated instruction (" + kind + ") on the entry path; before it only ";
      std::string what;
      for (size_t k = 0; k < skipped.size(); k++) what += (k ? "; " : "") + skipped[k];
      p.reason += what + " (no argument" + std::string(needs.reads_rbp ? "/rbp" : "") +
                  " register written, rsp moved by push/sub only)";
      p.reason += opts.whole_function ? "; no branch into it in the function (" + std::to_string(s.bytes) + " bytes)"
                                      : "; branches into it checked in the first " + std::to_string(s.bytes) + " bytes only";
      if (s.indirect) p.reason += "; indirect jmp at " + plus(*s.indirect) + " not followed";
      return p;
    }
    // Not emulated here: step over it if it is straight-line and harmless.
    std::string t = in->text();
    if (skipped.size() >= kMaxPrefix) {
      stop = "entry path longer than " + std::to_string(kMaxPrefix) + " instructions";
      break;
    }
    if (v == Verdict::kRefused && is_control_flow(in->p)) {
      stop = t + " at " + plus(off) + " is refused by the kernel (prefix) and ends the straight line";
      break;
    }
    if (is_control_flow(in->p)) {
      stop = t + " at " + plus(off) + " is a branch the kernel does not emulate";
      break;
    }
    if (is_string_op(in->p->id)) {
      stop = t + " at " + plus(off) + " is a string instruction";
      break;
    }
    uint32_t w = written_gprs(*in);
    if (w & forbidden) {
      int f = __builtin_ctz(w & forbidden);
      stop = t + " at " + plus(off) + " writes " + gpr_name(f) + ", which the probe reads";
      break;
    }
    const cs_x86& x = in->x86();
    if (w & (1u << 4)) {  // rsp
      if (in->p->id == X86_INS_PUSH && !(b[0] == 0x66)) {
        adj += 8;
      } else if ((in->p->id == X86_INS_SUB || in->p->id == X86_INS_ADD) && x.op_count == 2 &&
                 x.operands[0].type == X86_OP_REG && x.operands[0].reg == X86_REG_RSP &&
                 x.operands[1].type == X86_OP_IMM) {
        int64_t imm = x.operands[1].imm;
        int64_t d = in->p->id == X86_INS_SUB ? imm : -imm;
        if (d <= 0 || d > (1 << 20)) {
          stop = t + " at " + plus(off) + " moves rsp up";
          break;
        }
        adj += static_cast<int32_t>(d);
      } else {
        stop = t + " at " + plus(off) + " changes rsp other than by push/sub";
        break;
      }
    }
    // Stores: not over the return address, not through the caller's rbp.
    bool bad_store = false;
    for (uint8_t k = 0; k < x.op_count; k++) {
      const cs_x86_op& op = x.operands[k];
      if (op.type != X86_OP_MEM) continue;
      bool w_mem = (op.access & CS_AC_WRITE) || (k == 0 && !first_operand_read_only(in->p->id));
      if (!w_mem || in->p->id == X86_INS_LEA) continue;
      if (op.mem.base == X86_REG_RSP && op.mem.index == X86_REG_INVALID) {
        int64_t lo = op.mem.disp, hi = op.mem.disp + (op.size ? op.size : 8);
        if (lo < adj + 8 && hi > adj) bad_store = true;
      } else if (op.mem.base == X86_REG_RSP || (needs.reads_rbp && op.mem.base == X86_REG_RBP)) {
        bad_store = true;
      }
    }
    if (bad_store) {
      stop = t + " at " + plus(off) + " may overwrite the return address or the caller's frame";
      break;
    }
    skipped.push_back(t);
    off += n;
  }
  if (stop.empty()) stop = "no emulated instruction in the " + std::to_string(code.size()) + " bytes read";
  return at_zero("no emulated instruction before: " + stop);
}

std::string describe(const Placement& p) {
  std::string s = plus(p.offset) + " " + p.insn + ": " + (p.emulated ? "emulated" : "NOT emulated (single-step or refused)");
  if (p.arm64)
    s += "; return address in x30" +
         (p.rsp_adjust ? ", caller's sp at [sp+" + std::to_string(p.rsp_adjust) + "]" : std::string());
  else
    s += "; return address at [rsp+" + std::to_string(p.rsp_adjust) + "]";
  s += "; " + p.reason;
  return s;
}

}  // namespace memtrace::probes
