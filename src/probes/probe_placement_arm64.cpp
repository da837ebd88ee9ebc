// The arm64 half of the probe placement analysis (issue 20).
//
// What the arm64 kernel does with the instruction under a uprobe
// (arch/arm64/kernel/probes/uprobes.c arch_uprobe_analyze_insn ->
// decode-insn.c arm_probe_decode_insn; encodings: arch/arm64/include/asm/insn.h):
//
//   aarch64_insn_is_steppable(insn) -> INSN_GOOD: stepped out of line (the
//     instruction runs in the XOL slot under a single-step trap: a second
//     exception per hit). Steppable is everything but:
//       - in the branch/exception/system class: every branch (b, bl, b.cond,
//         cbz/cbnz, tbz/tbnz, br/blr/ret and their pointer-authenticated
//         forms), msr, exceptions (svc, brk, ...), eret; mrs of DAIF; hints
//         off the kernel's list. The list (aarch64_insn_is_steppable_hint, the
//         same in 6.1 and 6.12): nop, xpaclri, pacia1716, pacib1716,
//         paciaz, paciasp, pacibz, pacibsp, bti, bti c, bti j, bti jc. The
//         aut* hints (autiasp, ...) were on it from 5.8 until "arm64: kprobe:
//         disable probe of ptrauth instruction" (2020: they may fault);
//         refused on 6.1 and 6.12 (tests/probes/arm64/uprobe_cost.py).
//       - literal loads (ldr/ldrsw/prfm literal) and adr/adrp (PC-relative),
//       - exclusives (ldxr/stxr/ldaxr/stlxr/ldxp/stxp/casp: the monitor is
//         cleared by the trap, the store-exclusive would fail forever).
//   Not steppable -> simulated (INSN_GOOD_NO_SLOT: one trap, no step):
//     b.cond, cbz/cbnz, tbz/tbnz, adr/adrp, b/bl, br/blr/ret (not the
//     pointer-authenticated braa/blraa/retaa: refused).
//     ldr/ldrsw literal: simulated for uprobes until "arm64: probes: Remove
//     broken LDR (literal) uprobe support" (Oct 2024, 6.12, backported to the
//     stable lines: the simulation read the user address as a kernel one);
//     refused since. The analysis never places a probe on one.
//     nop: simulated since 6.13 ("arm64: insn: Simulate nop instruction for
//     better uprobe performance"); stepped out of line in 5.10, 6.1, 6.12.
//   Anything else -> INSN_REJECTED: the probe cannot be installed (-EINVAL).
//
// Where this leaves a function's entry: `stp x29, x30, [sp, #-N]!`, `mov x29,
// sp`, `bti c`, `paciasp` are all stepped out of line. A later simulated
// instruction (adrp, cbz, b.cond, ...) can take the entry probe only if the
// straight line before it leaves the arguments, x30 (the return address) and
// the frame-pointer chain readable; sp may move (rsp_adjust: the caller's sp
// is sp + rsp_adjust). paciasp signs x30 in place: never skipped. A return
// probe must sit where x30 is neither changed nor saved (the kernel replaces
// x30 when it is hit); where the entry probe cannot share it, both stay at the
// entry: one trap serves both, a second one further on would only add.
#include "common/hex.h"
#include "probes/probe_placement.h"

#include <capstone/capstone.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <set>

namespace memtrace::probes {

namespace {

bool is(uint32_t i, uint32_t mask, uint32_t val) { return (i & mask) == val; }

// arch/arm64/include/asm/insn.h, __AARCH64_INSN_FUNCS(name, mask, value).
bool is_b(uint32_t i) { return is(i, 0xFC000000, 0x14000000); }
bool is_bl(uint32_t i) { return is(i, 0xFC000000, 0x94000000); }
bool is_cbz(uint32_t i) { return is(i, 0x7F000000, 0x34000000); }
bool is_cbnz(uint32_t i) { return is(i, 0x7F000000, 0x35000000); }
bool is_tbz(uint32_t i) { return is(i, 0x7F000000, 0x36000000); }
bool is_tbnz(uint32_t i) { return is(i, 0x7F000000, 0x37000000); }
bool is_bcond(uint32_t i) { return is(i, 0xFF000010, 0x54000000); }
bool is_adr_adrp(uint32_t i) { return is(i, 0x1F000000, 0x10000000); }  // adr 0x10000000, adrp 0x90000000
bool is_br(uint32_t i) { return is(i, 0xFFFFFC1F, 0xD61F0000); }
bool is_br_auth(uint32_t i) { return is(i, 0xFEFFF800, 0xD61F0800); }
bool is_blr(uint32_t i) { return is(i, 0xFFFFFC1F, 0xD63F0000); }
bool is_blr_auth(uint32_t i) { return is(i, 0xFEFFF800, 0xD63F0800); }
bool is_ret(uint32_t i) { return is(i, 0xFFFFFC1F, 0xD65F0000); }
bool is_ret_auth(uint32_t i) { return is(i, 0xFFFFFBFF, 0xD65F0BFF); }
bool is_eret(uint32_t i) { return i == 0xD69F03E0; }
bool is_eret_auth(uint32_t i) { return is(i, 0xFFFFFBFF, 0xD69F0BFF); }
bool is_exception(uint32_t i) { return is(i, 0xFF000000, 0xD4000000); }
bool is_hint(uint32_t i) { return is(i, 0xFFFFF01F, 0xD503201F); }
bool is_mrs(uint32_t i) { return is(i, 0xFFF00000, 0xD5300000); }
bool is_msr_imm(uint32_t i) { return is(i, 0xFFF8F01F, 0xD500401F); }
bool is_msr_reg(uint32_t i) { return is(i, 0xFFF00000, 0xD5100000); }
bool is_ldr_lit(uint32_t i) { return is(i, 0xBF000000, 0x18000000); }
bool is_ldrsw_lit(uint32_t i) { return is(i, 0xFF000000, 0x98000000); }
bool is_prfm_lit(uint32_t i) { return is(i, 0xFF000000, 0xD8000000); }
bool is_exclusive(uint32_t i) { return is(i, 0x3F800000, 0x08000000); }
bool is_load_ex(uint32_t i) { return is(i, 0x3F400000, 0x08400000); }
bool is_class_br_sys(uint32_t i) { return ((i >> 25) & 0xE) == 0xA; }  // (insn >> 25) & 0xf: 0xa, 0xb
bool is_branch(uint32_t i) {
  return is_b(i) || is_bl(i) || is_cbz(i) || is_cbnz(i) || is_tbz(i) || is_tbnz(i) || is_ret(i) ||
         is_ret_auth(i) || is_br(i) || is_br_auth(i) || is_blr(i) || is_blr_auth(i) || is_bcond(i);
}
constexpr uint32_t kNop = 0xD503201F;
constexpr uint32_t kSysregDaif = 0xDA11;  // AARCH64_INSN_SPCLREG_DAIF (op0 3, op1 3, CRn 4, CRm 2, op2 1)

// Hints by CRm:op2 (insn & 0xFE0), AARCH64_INSN_HINT_*.
struct HintName {
  uint32_t v;
  const char* name;
  bool steppable;  // aarch64_insn_is_steppable_hint (6.1, 6.12)
  bool writes_lr;  // signs/authenticates/strips x30 in place
};
const HintName kHints[] = {
    {0x000, "nop", true, false},        {0x020, "yield", false, false},     {0x040, "wfe", false, false},
    {0x060, "wfi", false, false},       {0x080, "sev", false, false},       {0x0A0, "sevl", false, false},
    {0x0E0, "xpaclri", true, true},     {0x100, "pacia1716", true, false},  {0x140, "pacib1716", true, false},
    {0x180, "autia1716", false, false}, {0x1C0, "autib1716", false, false}, {0x300, "paciaz", true, true},
    {0x320, "paciasp", true, true},     {0x340, "pacibz", true, true},      {0x360, "pacibsp", true, true},
    {0x380, "autiaz", false, true},     {0x3A0, "autiasp", false, true},    {0x3C0, "autibz", false, true},
    {0x3E0, "autibsp", false, true},    {0x400, "bti", true, false},        {0x440, "bti c", true, false},
    {0x480, "bti j", true, false},      {0x4C0, "bti jc", true, false},
};
const HintName* hint_of(uint32_t i) {
  if (!is_hint(i)) return nullptr;
  for (const auto& h : kHints)
    if ((i & 0xFE0) == h.v) return &h;
  return nullptr;
}

bool steppable(uint32_t i) {  // aarch64_insn_is_steppable
  if (is_class_br_sys(i)) {
    if (is_branch(i) || is_msr_imm(i) || is_msr_reg(i) || is_exception(i) || is_eret(i) || is_eret_auth(i))
      return false;
    if (is_mrs(i)) return ((i & 0x1FFFE0) >> 5) != kSysregDaif;
    if (is_hint(i)) {
      const HintName* h = hint_of(i);
      return h && h->steppable;
    }
    return true;
  }
  if (is_ldr_lit(i) || is_ldrsw_lit(i) || is_adr_adrp(i) || is_prfm_lit(i) || is_exclusive(i)) return false;
  return true;
}

// One capstone arm64 handle per thread, details on.
struct Capstone64 {
  csh h = 0;
  bool ok = false;
  Capstone64() {
    ok = cs_open(CS_ARCH_ARM64, CS_MODE_ARM, &h) == CS_ERR_OK;
    if (ok) cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
  }
  ~Capstone64() {
    if (ok) cs_close(&h);
  }
};
csh cs64() {
  thread_local Capstone64 c;
  return c.ok ? c.h : 0;
}

struct Insn64 {
  cs_insn* p = nullptr;
  explicit Insn64(cs_insn* i) : p(i) {}
  Insn64(const Insn64&) = delete;
  Insn64& operator=(const Insn64&) = delete;
  ~Insn64() {
    if (p) cs_free(p, 1);
  }
};

std::optional<Insn64> decode64(uint32_t w, uint64_t addr) {
  csh h = cs64();
  if (!h) return std::nullopt;
  uint8_t b[4];
  std::memcpy(b, &w, 4);  // little-endian host and target
  cs_insn* out = nullptr;
  if (cs_disasm(h, b, 4, addr, 1, &out) != 1) return std::nullopt;
  return std::optional<Insn64>(std::in_place, out);
}

// Register number: x0..x30 / w0..w30 -> 0..30, sp/wsp -> 31, else -1.
int reg_no(unsigned r) {
  if (r == ARM64_REG_SP || r == ARM64_REG_WSP) return 31;
  if (r == ARM64_REG_X29 || r == ARM64_REG_W29) return 29;
  if (r == ARM64_REG_X30 || r == ARM64_REG_W30) return 30;
  const char* n = cs_reg_name(cs64(), r);
  if (!n || (n[0] != 'x' && n[0] != 'w')) return -1;
  int k = -1;
  if (std::sscanf(n + 1, "%d", &k) != 1 || k < 0 || k > 30) return -1;
  return k;
}

uint32_t word_at(const std::vector<uint8_t>& code, size_t off) {
  uint32_t w;
  std::memcpy(&w, code.data() + off, 4);
  return w;
}

std::string plus(uint64_t off) { return "+" + hex(off); }

int64_t sext(uint64_t v, int bits) { return static_cast<int64_t>(v << (64 - bits)) >> (64 - bits); }

// Target of a direct branch (b, bl, b.cond, cbz/cbnz, tbz/tbnz) at pc.
std::optional<uint64_t> branch_target(uint32_t i, uint64_t pc) {
  if (is_b(i) || is_bl(i)) return pc + sext(i & 0x03FFFFFF, 26) * 4;
  if (is_bcond(i) || is_cbz(i) || is_cbnz(i)) return pc + sext((i >> 5) & 0x7FFFF, 19) * 4;
  if (is_tbz(i) || is_tbnz(i)) return pc + sext((i >> 5) & 0x3FFF, 14) * 4;
  return std::nullopt;
}

// Bytes a store writes: the size of its register(s), two for a pair (stp,
// stnp); 16 if not known.
int store_size(const Insn64& in) {
  std::string m = in.p->mnemonic;
  const cs_arm64& x = in.p->detail->arm64;
  int regs = (m == "stp" || m == "stnp") ? 2 : 1;
  if (m == "strb" || m == "sturb") return 1;
  if (m == "strh" || m == "sturh") return 2;
  if (x.op_count < 1 || x.operands[0].type != ARM64_OP_REG) return 16;
  const char* r = cs_reg_name(cs64(), x.operands[0].reg);
  if (!r) return 16;
  switch (r[0]) {
    case 'x': case 'd': return 8 * regs;
    case 'w': case 's': return 4 * regs;
    case 'q': return 16 * regs;
    case 'h': return 2 * regs;
    case 'b': return 1 * regs;
    default: return 16;
  }
}

}  // namespace

std::vector<uint64_t> arm64_branch_targets(const std::vector<uint8_t>& code, uint64_t code_addr, uint64_t lo,
                                           uint64_t hi) {
  std::vector<uint64_t> out;
  for (size_t off = 0; off + 4 <= code.size(); off += 4)
    if (auto t = branch_target(word_at(code, off), code_addr + off); t && *t >= lo && *t < hi) out.push_back(*t);
  return out;
}

std::string arm64_text(uint32_t insn, uint64_t addr) {
  if (const HintName* h = hint_of(insn)) return h->name;
  if (insn == 0xD65F0BFF) return "retaa";
  if (insn == 0xD65F0FFF) return "retab";
  if (auto in = decode64(insn, addr)) {
    std::string s = in->p->mnemonic;
    if (in->p->op_str[0]) s += std::string(" ") + in->p->op_str;
    return s;
  }
  char b[32];
  std::snprintf(b, sizeof b, ".inst 0x%08x", insn);
  return b;
}

Verdict arm64_kernel_verdict(uint32_t i, const KernelCaps& caps, std::string* why) {
  auto say = [&](const char* w, Verdict v) {
    if (why) *why = w;
    return v;
  };
  if (caps.arm64_nop && i == kNop) return say("nop (simulated since 6.13)", Verdict::kEmulated);
  if (steppable(i)) {
    if (const HintName* h = hint_of(i)) return say(h->name, Verdict::kSingleStep);
    return say("steppable", Verdict::kSingleStep);
  }
  if (is_bcond(i)) return say("b.cond", Verdict::kEmulated);
  if (is_cbz(i) || is_cbnz(i)) return say("cbz/cbnz", Verdict::kEmulated);
  if (is_tbz(i) || is_tbnz(i)) return say("tbz/tbnz", Verdict::kEmulated);
  if (is_adr_adrp(i)) return say("adr/adrp", Verdict::kEmulated);
  if (is_b(i) || is_bl(i)) return say("b/bl", Verdict::kEmulated);
  if (is_br(i) || is_blr(i) || is_ret(i)) return say("br/blr/ret", Verdict::kEmulated);
  // Refused (INSN_REJECTED, -EINVAL at install).
  if (is_ldr_lit(i) || is_ldrsw_lit(i))
    return say("literal load (refused since the 2024 fix; simulated wrongly before)", Verdict::kRefused);
  if (is_prfm_lit(i)) return say("literal prefetch", Verdict::kRefused);
  if (is_exclusive(i)) return say("exclusive load/store", Verdict::kRefused);
  if (is_ret_auth(i) || is_br_auth(i) || is_blr_auth(i)) return say("authenticated branch", Verdict::kRefused);
  if (is_hint(i)) return say("hint not on the kernel's steppable list", Verdict::kRefused);
  if (is_exception(i)) return say("exception-generating", Verdict::kRefused);
  if (is_msr_imm(i) || is_msr_reg(i)) return say("msr", Verdict::kRefused);
  if (is_mrs(i)) return say("mrs daif", Verdict::kRefused);
  return say("not steppable, not simulated", Verdict::kRefused);
}

Placement choose_entry_offset_arm64(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs,
                                    const PlaceOptions& opts) {
  const size_t n = code.size() & ~size_t{3};
  uint32_t forbidden = 1u << 30;  // x30: the return address
  for (int a = 0; a < 8; a++)
    if (needs.arg_mask & (1u << a)) forbidden |= 1u << a;

  auto at_zero = [&](const std::string& why) {
    Placement z;
    z.arm64 = true;
    z.checked_bytes = n;
    if (n < 4) {
      z.insn = "(no code)";
      z.reason = "undecodable" + (why.empty() ? "" : "; " + why);
      return z;
    }
    std::string kind;
    uint32_t w = word_at(code, 0);
    Verdict v = arm64_kernel_verdict(w, opts.caps, &kind);
    z.insn = arm64_text(w, addr);
    z.emulated = v == Verdict::kEmulated;
    z.reason = std::string(z.emulated ? "first instruction is simulated (" + kind + ")"
                                      : std::string(verdict_name(v)) + " (" + kind + ")") +
               (why.empty() ? "" : "; " + why);
    return z;
  };
  if (n < 4) return at_zero("no code bytes");

  int32_t adj = 0;             // bytes sp moved down
  bool lr_saved = false;       // x30 stored before here
  int64_t record_at = -1;      // sp offset of the x29/x30 pair stored, -1: none
  std::vector<std::string> skipped;
  std::string stop;
  const size_t kMaxPrefix = 24;
  for (size_t off = 0; off < n; off += 4) {
    uint32_t w = word_at(code, off);
    std::string kind;
    Verdict v = arm64_kernel_verdict(w, opts.caps, &kind);
    std::string t = arm64_text(w, addr + off);
    if (v == Verdict::kEmulated) {
      if (off == 0) return at_zero("");
      if (needs.return_probe && (adj != 0 || lr_saved)) {
        stop = t + " at " + plus(off) + " is simulated, but past " + (lr_saved ? "the save of x30" : "the move of sp") +
               ": the return probe must stay at the entry, and one trap there serves both";
        break;
      }
      std::set<uint64_t> targets(opts.incoming_targets.begin(), opts.incoming_targets.end());
      for (uint64_t a : arm64_branch_targets(code, addr, addr + 1, addr + off + 1)) targets.insert(a - addr);
      for (uint64_t tg : targets)
        if (tg > 0 && tg <= off)
          return at_zero("a branch targets " + plus(tg) + ", inside the entry path before " + t);
      Placement p;
      p.arm64 = true;
      p.offset = off;
      p.insn = t;
      p.emulated = true;
      p.rsp_adjust = adj;
      p.lr_saved = lr_saved;
      p.skipped = skipped;
      p.checked_bytes = n;
      std::string what;
      for (size_t k = 0; k < skipped.size(); k++) what += (k ? "; " : "") + skipped[k];
      p.reason = "first simulated instruction (" + kind + ") on the entry path; before it only " + what +
                 " (stepped out of line at the entry; no argument register or x30 written" +
                 std::string(needs.reads_rbp ? ", x29 only to the new frame record" : "") + ", sp moved down by " +
                 std::to_string(adj) + ")";
      p.reason += opts.whole_function ? "; no branch into it in the function (" + std::to_string(n) + " bytes)"
                                      : "; branches into it checked in the first " + std::to_string(n) + " bytes only";
      return p;
    }
    if (skipped.size() >= kMaxPrefix) {
      stop = "entry path longer than " + std::to_string(kMaxPrefix) + " instructions";
      break;
    }
    if (v == Verdict::kRefused) {
      if (is_load_ex(w) || is_exclusive(w))
        stop = t + " at " + plus(off) + " is an exclusive load/store: a probe after it would clear the exclusive "
               "monitor (the store-exclusive would fail every time)";
      else
        stop = t + " at " + plus(off) + " is refused by the kernel (" + kind + ") and ends the analysis";
      break;
    }
    const HintName* h = hint_of(w);
    if (h) {
      if (h->writes_lr) {
        stop = t + " at " + plus(off) + " changes x30 (pointer authentication): the return address is only plain before it";
        break;
      }
      skipped.push_back(t);
      continue;  // nop, bti: no effect on the registers the probe reads
    }
    auto in = decode64(w, addr + off);
    if (!in) {
      stop = "cannot decode " + hex(w) + " at " + plus(off);
      break;
    }
    const cs_arm64& x = in->p->detail->arm64;
    // Registers written (capstone's lists; writeback of a base register shows
    // up as a write of it).
    uint32_t wmask = 0;
    cs_regs rr, ww;
    uint8_t nr = 0, nw = 0;
    if (cs_regs_access(cs64(), in->p, rr, &nr, ww, &nw) != CS_ERR_OK) {
      stop = t + " at " + plus(off) + ": registers unknown";
      break;
    }
    for (uint8_t k = 0; k < nw; k++)
      if (int r = reg_no(ww[k]); r >= 0) wmask |= 1u << r;
    bool store = in->p->mnemonic[0] == 's' && in->p->mnemonic[1] == 't';
    if (wmask & forbidden) {
      int r = __builtin_ctz(wmask & forbidden);
      stop = t + " at " + plus(off) + " writes " + (r == 30 ? std::string("x30 (the return address)") : "x" + std::to_string(r) + ", which the probe reads");
      break;
    }
    // Memory operand of a store: the new frame only, by sp.
    const cs_arm64_op* mem = nullptr;
    int imm_after_mem = 0;
    for (uint8_t k = 0; k < x.op_count; k++) {
      if (x.operands[k].type == ARM64_OP_MEM) mem = &x.operands[k];
      else if (mem && x.operands[k].type == ARM64_OP_IMM) imm_after_mem++;
    }
    int new_adj = adj;
    if (store) {
      if (!mem || mem->mem.base != ARM64_REG_SP || mem->mem.index != ARM64_REG_INVALID || imm_after_mem) {
        if (mem && mem->mem.base != ARM64_REG_SP && mem->mem.base != ARM64_REG_X29 && !x.writeback) {
          // a store through another register: not the stack, not read by the probe
        } else {
          stop = t + " at " + plus(off) + " is a store the analysis does not follow (not by sp into the new frame)";
          break;
        }
      } else {
        int64_t d = mem->mem.disp;
        if (x.writeback) {  // pre-index: sp += d first, then the store at [sp]
          if (d >= 0 || d < -(1 << 20)) {
            stop = t + " at " + plus(off) + " moves sp up";
            break;
          }
          new_adj = adj + static_cast<int32_t>(-d);
          d = 0;
        }
        if (d < 0 || d + store_size(*in) > new_adj) {
          stop = t + " at " + plus(off) + " may store outside the new frame (into the caller's)";
          break;
        }
        int64_t rec = record_at >= 0 ? record_at + (new_adj - adj) : -1;  // after this store's writeback
        if (needs.reads_rbp && rec >= 0 && d < rec + 16 && d + store_size(*in) > rec) {
          stop = t + " at " + plus(off) + " stores over the x29/x30 frame record";
          break;
        }
        // Which registers are stored: x29 and x30 as a pair is a frame record.
        int r0 = x.op_count > 0 && x.operands[0].type == ARM64_OP_REG ? reg_no(x.operands[0].reg) : -1;
        int r1 = x.op_count > 1 && x.operands[1].type == ARM64_OP_REG ? reg_no(x.operands[1].reg) : -1;
        if (r0 == 30 || r1 == 30) lr_saved = true;
        if (r0 == 29 && r1 == 30) record_at = d;
        else if (record_at >= 0 && new_adj != adj) record_at += new_adj - adj;
      }
      wmask &= ~(1u << 31);  // the writeback, handled
    }
    if (wmask & (1u << 31)) {  // sp, other than by a store's pre-index
      bool sub_imm = in->p->id == ARM64_INS_SUB && x.op_count == 3 && x.operands[0].type == ARM64_OP_REG &&
                     reg_no(x.operands[0].reg) == 31 && x.operands[1].type == ARM64_OP_REG &&
                     reg_no(x.operands[1].reg) == 31 && x.operands[2].type == ARM64_OP_IMM &&
                     x.operands[2].shift.type == ARM64_SFT_INVALID;
      if (!sub_imm || x.operands[2].imm <= 0 || x.operands[2].imm > (1 << 20)) {
        stop = t + " at " + plus(off) + " changes sp other than down by an immediate";
        break;
      }
      new_adj = adj + static_cast<int32_t>(x.operands[2].imm);
      if (record_at >= 0) record_at += x.operands[2].imm;
    }
    if (wmask & (1u << 29)) {  // x29: only to the frame record just stored
      bool to_record = false;
      if (x.op_count >= 2 && x.operands[0].type == ARM64_OP_REG && x.operands[1].type == ARM64_OP_REG &&
          reg_no(x.operands[1].reg) == 31) {
        int64_t k = -1;
        if (in->p->id == ARM64_INS_MOV && x.op_count == 2) k = 0;
        else if (in->p->id == ARM64_INS_ADD && x.op_count == 3 && x.operands[2].type == ARM64_OP_IMM &&
                 x.operands[2].shift.type == ARM64_SFT_INVALID)
          k = x.operands[2].imm;
        to_record = k >= 0 && k == record_at;
      }
      if (!to_record && needs.reads_rbp) {
        stop = t + " at " + plus(off) + " writes x29 other than to the frame record of x29/x30 just stored";
        break;
      }
    }
    adj = new_adj;
    skipped.push_back(t);
  }
  if (stop.empty()) stop = "no simulated instruction in the " + std::to_string(n) + " bytes read";
  return at_zero("no simulated instruction before: " + stop);
}

}  // namespace memtrace::probes
