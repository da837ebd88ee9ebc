#include "unwind/cfi_table.h"

#include <fcntl.h>
#include <gelf.h>
#include <libelf.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/fd.h"

namespace memtrace::unwind {
namespace {

// DWARF register numbers (x86-64 psABI).
constexpr uint64_t kRegRbp = 6;
constexpr uint64_t kRegRsp = 7;
// aarch64 (DWARF for the Arm 64-bit architecture): x29 the frame pointer,
// x30 the link register (the CIE's return address column), 31 sp.
constexpr uint64_t kRegX29 = 29;
constexpr uint64_t kRegSp64 = 31;

// Which registers the rows follow: fp is the one kept as "rbp" (x86-64's
// rbp, aarch64's x29), sp the CFA register of a function's entry.
struct Arch {
  bool arm64;
  uint64_t fp, sp;
};
constexpr Arch kArchX86{false, kRegRbp, kRegRsp};
constexpr Arch kArchArm64{true, kRegX29, kRegSp64};

// Pointer encodings (.eh_frame, LSB "DWARF Extensions").
constexpr uint8_t kPeAbsptr = 0x00, kPeUleb = 0x01, kPeUdata2 = 0x02, kPeUdata4 = 0x03,
                  kPeUdata8 = 0x04, kPeSleb = 0x09, kPeSdata2 = 0x0a, kPeSdata4 = 0x0b,
                  kPeSdata8 = 0x0c, kPeOmit = 0xff;
constexpr uint8_t kPePcrel = 0x10, kPeTextrel = 0x20, kPeDatarel = 0x30, kPeFuncrel = 0x40,
                  kPeAligned = 0x50, kPeIndirect = 0x80;

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;

  bool need(size_t n) {
    if (!ok || static_cast<size_t>(end - p) < n) ok = false;
    return ok;
  }
  template <typename T>
  T fixed() {
    T v{};
    if (!need(sizeof(T))) return v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  uint8_t u8() { return fixed<uint8_t>(); }
  uint64_t uleb() {
    uint64_t v = 0;
    unsigned shift = 0;
    while (need(1)) {
      uint8_t b = *p++;
      if (shift < 64) v |= uint64_t(b & 0x7f) << shift;
      shift += 7;
      if (!(b & 0x80)) break;
    }
    return v;
  }
  int64_t sleb() {
    int64_t v = 0;
    unsigned shift = 0;
    uint8_t b = 0;
    while (need(1)) {
      b = *p++;
      if (shift < 64) v |= int64_t(b & 0x7f) << shift;
      shift += 7;
      if (!(b & 0x80)) break;
    }
    if (shift < 64 && (b & 0x40)) v |= -(int64_t(1) << shift);
    return v;
  }
  void skip(uint64_t n) {
    if (need(n)) p += n;
  }
};

struct Section {
  const uint8_t* data = nullptr;
  size_t size = 0;
  uint64_t addr = 0;
  bool eh = true;  // .eh_frame (else .debug_frame)
};

// value of an encoded pointer at r.p (only the encodings compilers emit for
// FDE initial locations; "indirect" and "aligned" are refused).
bool read_encoded(Reader& r, uint8_t enc, const Section& s, uint64_t text_addr, uint64_t* out) {
  if (enc == kPeOmit) return false;
  uint64_t pos_addr = s.addr + static_cast<uint64_t>(r.p - s.data);
  uint64_t v = 0;
  switch (enc & 0x0f) {
    case kPeAbsptr: v = r.fixed<uint64_t>(); break;
    case kPeUleb: v = r.uleb(); break;
    case kPeUdata2: v = r.fixed<uint16_t>(); break;
    case kPeUdata4: v = r.fixed<uint32_t>(); break;
    case kPeUdata8: v = r.fixed<uint64_t>(); break;
    case kPeSleb: v = static_cast<uint64_t>(r.sleb()); break;
    case kPeSdata2: v = static_cast<uint64_t>(int64_t(r.fixed<int16_t>())); break;
    case kPeSdata4: v = static_cast<uint64_t>(int64_t(r.fixed<int32_t>())); break;
    case kPeSdata8: v = r.fixed<uint64_t>(); break;
    default: r.ok = false; return false;
  }
  switch (enc & 0x70) {
    case 0: break;
    case kPePcrel: v += pos_addr; break;
    case kPeTextrel: v += text_addr; break;
    case kPeDatarel:
    case kPeFuncrel:
    case kPeAligned:
    default: return false;
  }
  if (enc & kPeIndirect) return false;
  *out = v;
  return r.ok;
}

// Size of the value part of an encoding (FDE address range uses only it).
bool read_encoded_value(Reader& r, uint8_t enc, uint64_t* out) {
  switch (enc & 0x0f) {
    case kPeAbsptr: *out = r.fixed<uint64_t>(); break;
    case kPeUleb: *out = r.uleb(); break;
    case kPeUdata2: *out = r.fixed<uint16_t>(); break;
    case kPeUdata4: *out = r.fixed<uint32_t>(); break;
    case kPeUdata8: *out = r.fixed<uint64_t>(); break;
    case kPeSleb: *out = static_cast<uint64_t>(r.sleb()); break;
    case kPeSdata2: *out = static_cast<uint64_t>(int64_t(r.fixed<int16_t>())); break;
    case kPeSdata4: *out = static_cast<uint64_t>(int64_t(r.fixed<int32_t>())); break;
    case kPeSdata8: *out = r.fixed<uint64_t>(); break;
    default: r.ok = false; return false;
  }
  return r.ok;
}

struct Rule {
  enum Kind : uint8_t { kUnset, kUndef, kSame, kOffset, kValOffset, kReg, kExpr, kValExpr } kind = kUnset;
  int64_t off = 0;
  const uint8_t* expr = nullptr;
  size_t len = 0;
};

struct State {
  bool cfa_expr = false;
  uint64_t cfa_reg = kRegRsp;
  int64_t cfa_off = 0;
  const uint8_t* expr = nullptr;
  size_t expr_len = 0;
  Rule rbp, ra;
};

struct Cie {
  uint64_t code_align = 1;
  int64_t data_align = -8;
  uint64_t ra_reg = 16;
  uint8_t fde_enc = kPeAbsptr;
  bool has_z = false;
  const uint8_t* insns = nullptr;
  const uint8_t* insns_end = nullptr;
};

struct FdeRows {
  uint64_t begin = 0, end = 0;
  bool debug_frame = false;
  bool synthetic = false;  // made here, no FDE (aarch64 .plt): not counted as one
  std::vector<std::pair<uint64_t, mt_unwind_row>> rows;  // (vaddr, row without pc)
};

// The .plt expression every x86-64 linker emits:
//   DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit<N>; DW_OP_ge;
//   DW_OP_lit3; DW_OP_shl; DW_OP_plus
// (CFA = rsp + 8, + 8 more once the entry's push has run). Returns N or -1.
int plt_threshold(const uint8_t* e, size_t n) {
  static const uint8_t head[] = {0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a};
  static const uint8_t tail[] = {0x2a, 0x33, 0x24, 0x22};
  if (n != sizeof(head) + 1 + sizeof(tail)) return -1;
  if (std::memcmp(e, head, sizeof(head)) != 0) return -1;
  if (e[6] < 0x30 || e[6] > 0x4f) return -1;
  if (std::memcmp(e + 7, tail, sizeof(tail)) != 0) return -1;
  return e[6] - 0x30;
}

// DW_OP_breg6 k [; DW_OP_deref]: returns true and k when the expression is
// exactly that (deref selects which form).
bool breg6(const uint8_t* e, size_t n, bool deref, int64_t* k) {
  if (n < 2 || e[0] != 0x76) return false;
  Reader r{e + 1, e + n};
  *k = r.sleb();
  if (!r.ok) return false;
  if (deref) return r.p + 1 == r.end && *r.p == 0x06;
  return r.p == r.end;
}

// x86-64: the return address at CFA-8 (else unsupported), the CFA on rsp or
// rbp or one of the two expressions, rbp saved at the CFA or by breg6.
// aarch64: the CFA on sp or x29, no expressions; x30 (the return address
// column) still in its register (unset or same value: the CIE says nothing
// about it, so at every entry and in leaf functions) or saved at the CFA.
// Both: the return address undefined is the outermost frame (_start).
RowInfo to_info(const State& s, const Arch& a) {
  RowInfo row;
  row.cfa = MT_CFA_UNSUPPORTED;
  row.rbp = MT_RBP_SAME;
  if (s.ra.kind == Rule::kUndef) {
    row.cfa = MT_CFA_END;
    return row;
  }
  if (a.arm64) {
    if (s.ra.kind == Rule::kOffset) {
      row.ra = MT_RA_AT_CFA;
      row.ra_off = s.ra.off;
    } else if (s.ra.kind != Rule::kUnset && s.ra.kind != Rule::kSame) {
      return row;  // in another register, an expression
    }
  } else if (s.ra.kind != Rule::kOffset || s.ra.off != -8) {
    return row;  // unsupported
  }
  int64_t k = 0;
  if (!s.cfa_expr) {
    if (s.cfa_reg == a.sp) row.cfa = MT_CFA_RSP;
    else if (s.cfa_reg == a.fp) row.cfa = MT_CFA_RBP;
    else return row;
    row.cfa_off = s.cfa_off;
  } else if (int t = a.arm64 ? -1 : plt_threshold(s.expr, s.expr_len); t >= 0) {
    row.cfa = MT_CFA_PLT;
    row.cfa_off = t;
  } else if (!a.arm64 && breg6(s.expr, s.expr_len, true, &k)) {
    row.cfa = MT_CFA_RBP_DEREF;
    row.cfa_off = k;
  } else {
    return row;
  }
  switch (s.rbp.kind) {
    case Rule::kUnset:
    case Rule::kSame:
      row.rbp = MT_RBP_SAME;
      break;
    case Rule::kOffset:
      row.rbp = MT_RBP_AT_CFA;
      row.rbp_off = s.rbp.off;
      break;
    case Rule::kExpr:
      if (!a.arm64 && breg6(s.rbp.expr, s.rbp.len, false, &k)) {
        row.rbp = MT_RBP_AT_RBP;
        row.rbp_off = k;
      } else {
        row.rbp = MT_RBP_UNKNOWN;
      }
      break;
    default:
      // DW_CFA_undefined rbp (outermost frames) and register/val rules.
      row.rbp = MT_RBP_UNKNOWN;
      break;
  }
  return row;
}

mt_unwind_row to_row(const State& s, const Arch& a) {
  return a.arm64 ? encode_row_arm64(to_info(s, a)) : encode_row(to_info(s, a));
}

bool same_row(const mt_unwind_row& a, const mt_unwind_row& b) {
  return a.kind == b.kind && a.cfa_off == b.cfa_off && a.rbp_off == b.rbp_off;
}

// Runs CFA instructions [p, end) from state `st`. `init` is the CIE's state
// (DW_CFA_restore). With rows == nullptr (CIE initial instructions) advances
// are refused. Returns false on malformed input.
bool run_cfa(const uint8_t* p, const uint8_t* end, const Cie& cie, const Section& sec,
             uint64_t text_addr, State& st, const State& init, uint64_t* loc, uint64_t fde_end,
             std::vector<std::pair<uint64_t, mt_unwind_row>>* rows, const Arch& arch) {
  Reader r{p, end};
  std::vector<State> stack;
  auto set_rule = [&](uint64_t reg, Rule rule) {
    if (reg == arch.fp) st.rbp = rule;
    if (reg == cie.ra_reg) st.ra = rule;
  };
  auto restore = [&](uint64_t reg) {
    if (reg == arch.fp) st.rbp = init.rbp;
    if (reg == cie.ra_reg) st.ra = init.ra;
  };
  auto advance = [&](uint64_t delta) {
    if (!rows) return false;
    rows->emplace_back(*loc, to_row(st, arch));
    *loc += delta * cie.code_align;
    return true;
  };
  while (r.ok && r.p < r.end) {
    uint8_t op = r.u8();
    uint8_t hi = op & 0xc0, lo = op & 0x3f;
    if (hi == 0x40) {
      if (!advance(lo)) return false;
      continue;
    }
    if (hi == 0x80) {
      set_rule(lo, Rule{Rule::kOffset, static_cast<int64_t>(r.uleb()) * cie.data_align});
      continue;
    }
    if (hi == 0xc0) {
      restore(lo);
      continue;
    }
    switch (op) {
      case 0x00: break;  // nop
      case 0x01: {       // set_loc
        uint64_t to = 0;
        if (!read_encoded(r, cie.fde_enc, sec, text_addr, &to) || to < *loc || !rows) return false;
        rows->emplace_back(*loc, to_row(st, arch));
        *loc = to;
        break;
      }
      case 0x02: if (!advance(r.u8())) return false; break;
      case 0x03: if (!advance(r.fixed<uint16_t>())) return false; break;
      case 0x04: if (!advance(r.fixed<uint32_t>())) return false; break;
      case 0x05: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kOffset, int64_t(r.uleb()) * cie.data_align}); break; }
      case 0x06: restore(r.uleb()); break;
      case 0x07: set_rule(r.uleb(), Rule{Rule::kUndef}); break;
      case 0x08: set_rule(r.uleb(), Rule{Rule::kSame}); break;
      case 0x09: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kReg, int64_t(r.uleb())}); break; }
      case 0x0a: stack.push_back(st); break;
      case 0x0b:
        if (stack.empty()) return false;
        {
          // DWARF: restore_state restores register rules; the CFA rule comes
          // back too (GCC relies on it).
          st = stack.back();
          stack.pop_back();
        }
        break;
      case 0x0c: st.cfa_expr = false; st.cfa_reg = r.uleb(); st.cfa_off = int64_t(r.uleb()); break;
      case 0x0d: st.cfa_expr = false; st.cfa_reg = r.uleb(); break;
      case 0x0e: st.cfa_off = int64_t(r.uleb()); break;
      case 0x0f: {
        uint64_t n = r.uleb();
        st.cfa_expr = true;
        st.expr = r.p;
        st.expr_len = n;
        r.skip(n);
        break;
      }
      case 0x10:
      case 0x16: {
        uint64_t reg = r.uleb();
        uint64_t n = r.uleb();
        Rule rule{op == 0x10 ? Rule::kExpr : Rule::kValExpr, 0, r.p, static_cast<size_t>(n)};
        r.skip(n);
        set_rule(reg, rule);
        break;
      }
      case 0x11: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kOffset, r.sleb() * cie.data_align}); break; }
      case 0x12: st.cfa_expr = false; st.cfa_reg = r.uleb(); st.cfa_off = r.sleb() * cie.data_align; break;
      case 0x13: st.cfa_off = r.sleb() * cie.data_align; break;
      case 0x14: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kValOffset, int64_t(r.uleb()) * cie.data_align}); break; }
      case 0x15: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kValOffset, r.sleb() * cie.data_align}); break; }
      case 0x2d:  // aarch64: AARCH64_negate_ra_state (x30 signed from here, or no more:
                  // the walk strips the PAC bits of every return address anyway);
                  // elsewhere GNU_window_save (SPARC)
        if (!arch.arm64) return false;
        break;
      case 0x2e: r.uleb(); break;  // GNU_args_size
      case 0x2f: { uint64_t reg = r.uleb(); set_rule(reg, Rule{Rule::kOffset, -int64_t(r.uleb()) * cie.data_align}); break; }
      default: return false;
    }
  }
  (void)fde_end;
  return r.ok;
}

// Parses one CIE at offset `off` of the section.
bool parse_cie(const Section& sec, size_t off, uint64_t text_addr, Cie* cie) {
  Reader r{sec.data + off, sec.data + sec.size};
  uint64_t len = r.fixed<uint32_t>();
  bool dwarf64 = false;
  if (len == 0xffffffffu) {
    len = r.fixed<uint64_t>();
    dwarf64 = true;
  }
  if (!r.ok || len > static_cast<uint64_t>(r.end - r.p)) return false;
  const uint8_t* end = r.p + len;
  r.end = end;
  uint64_t id = dwarf64 ? r.fixed<uint64_t>() : r.fixed<uint32_t>();
  uint64_t want = sec.eh ? 0 : (dwarf64 ? ~uint64_t(0) : 0xffffffffu);
  if (id != want) return false;
  uint8_t version = r.u8();
  const char* aug = reinterpret_cast<const char*>(r.p);
  size_t aug_len = strnlen(aug, static_cast<size_t>(r.end - r.p));
  r.skip(aug_len + 1);
  std::string augs(aug, aug_len);
  if (augs.find("eh") != std::string::npos) r.skip(8);
  if (!sec.eh && version >= 4) {
    uint8_t asz = r.u8();
    r.u8();  // segment selector size
    if (asz != 8) return false;
  }
  cie->code_align = r.uleb();
  cie->data_align = r.sleb();
  cie->ra_reg = version == 1 ? r.u8() : r.uleb();
  cie->fde_enc = kPeAbsptr;
  cie->has_z = !augs.empty() && augs[0] == 'z';
  if (cie->has_z) {
    uint64_t alen = r.uleb();
    const uint8_t* aend = r.p + alen;
    for (size_t i = 1; i < augs.size() && r.ok; i++) {
      switch (augs[i]) {
        case 'L': r.u8(); break;
        case 'R': cie->fde_enc = r.u8(); break;
        case 'P': {
          uint8_t enc = r.u8();
          uint64_t dummy;
          Reader rr = r;
          // personality pointer: skip by its size (indirect/pcrel irrelevant)
          if (!read_encoded_value(rr, enc & 0x0f, &dummy)) return false;
          r.p = rr.p;
          break;
        }
        case 'S':
        case 'B':
        case 'G':
          break;
        default:
          i = augs.size();  // unknown: rest is skipped by the length
          break;
      }
    }
    if (!r.ok || aend > r.end) return false;
    r.p = aend;
  }
  if (!sec.eh) cie->fde_enc = kPeAbsptr;
  cie->insns = r.p;
  cie->insns_end = end;
  (void)text_addr;
  return r.ok;
}

// Walks a .eh_frame or .debug_frame section, appending FDE row lists.
void parse_section(const Section& sec, uint64_t text_addr, std::vector<FdeRows>* out,
                   size_t* skipped, const Arch& arch) {
  size_t off = 0;
  while (off + 4 <= sec.size) {
    Reader r{sec.data + off, sec.data + sec.size};
    uint64_t len = r.fixed<uint32_t>();
    bool dwarf64 = false;
    if (len == 0) {
      if (sec.eh) break;  // terminator
      off += 4;
      continue;
    }
    if (len == 0xffffffffu) {
      len = r.fixed<uint64_t>();
      dwarf64 = true;
    }
    size_t hdr = dwarf64 ? 12 : 4;
    if (!r.ok || len > sec.size - off - hdr) break;
    size_t next = off + hdr + len;
    const uint8_t* id_pos = r.p;
    uint64_t id = dwarf64 ? r.fixed<uint64_t>() : r.fixed<uint32_t>();
    bool is_cie = sec.eh ? id == 0 : id == (dwarf64 ? ~uint64_t(0) : 0xffffffffu);
    if (is_cie) {
      off = next;
      continue;
    }
    size_t cie_off = sec.eh ? static_cast<size_t>(id_pos - sec.data) - id : id;
    Cie cie;
    if (cie_off >= sec.size || !parse_cie(sec, cie_off, text_addr, &cie)) {
      ++*skipped;
      off = next;
      continue;
    }
    r.end = sec.data + next;
    uint64_t begin = 0, range = 0;
    if (!read_encoded(r, cie.fde_enc, sec, text_addr, &begin) ||
        !read_encoded_value(r, cie.fde_enc, &range) || range == 0) {
      ++*skipped;
      off = next;
      continue;
    }
    if (cie.has_z) r.skip(r.uleb());
    if (!r.ok) {
      ++*skipped;
      off = next;
      continue;
    }
    State init;
    init.cfa_reg = arch.sp;
    uint64_t loc = begin;
    bool good = run_cfa(cie.insns, cie.insns_end, cie, sec, text_addr, init, init, &loc, 0, nullptr, arch);
    FdeRows f;
    f.begin = begin;
    f.end = begin + range;
    f.debug_frame = !sec.eh;
    State st = init;
    loc = begin;
    good = good && run_cfa(r.p, r.end, cie, sec, text_addr, st, init, &loc, f.end, &f.rows, arch);
    if (!good) {
      ++*skipped;
      off = next;
      continue;
    }
    f.rows.emplace_back(loc, to_row(st, arch));
    // Rows past the FDE's end (advance beyond the range) are dropped.
    while (!f.rows.empty() && f.rows.back().first >= f.end && f.rows.size() > 1) f.rows.pop_back();
    out->push_back(std::move(f));
    off = next;
  }
}

// aarch64's .plt has no CFI: a stub (adrp x16; ldr x17; add x16; br x17,
// with bti c first when the linker adds it) moves neither sp nor x30, so
// CFA = sp and the return address is x30. The header stub (PLT0, 32 bytes:
// only the lazy binder's way in) stores x16 and x30 first: past that
// stp x16, x30, [sp, #-16]! the CFA is sp + 16, x30 at CFA-8.
FdeRows plt_rows_arm64(const uint8_t* code, size_t size, uint64_t addr) {
  FdeRows f;
  f.begin = addr;
  f.end = addr + size;
  f.synthetic = true;
  RowInfo stub;
  stub.cfa = MT_CFA_RSP;
  f.rows.emplace_back(addr, encode_row_arm64(stub));
  constexpr uint32_t kStpX16X30 = 0xa9bf7bf0;  // stp x16, x30, [sp, #-16]!
  for (size_t i = 0; i < 2 && size >= 32 && code; i++) {
    uint32_t w;
    std::memcpy(&w, code + 4 * i, 4);
    if (w != kStpX16X30) continue;
    RowInfo saved = stub;
    saved.cfa_off = 16;
    saved.ra = MT_RA_AT_CFA;
    saved.ra_off = -8;
    f.rows.emplace_back(addr + 4 * (i + 1), encode_row_arm64(saved));
    f.rows.emplace_back(addr + 32, encode_row_arm64(stub));
    break;
  }
  return f;
}

}  // namespace

mt_unwind_row encode_row_arm64(const RowInfo& in) {
  RowInfo r = in;
  if (r.cfa == MT_CFA_RSP || r.cfa == MT_CFA_RBP) {
    if (r.cfa_off % 8 != 0 || r.cfa_off / 8 < INT16_MIN || r.cfa_off / 8 > INT16_MAX) r.cfa = MT_CFA_UNSUPPORTED;
  } else if (r.cfa != MT_CFA_NONE && r.cfa != MT_CFA_END) {
    r.cfa = MT_CFA_UNSUPPORTED;  // (no expressions kept on aarch64)
  }
  if (r.cfa != MT_CFA_RSP && r.cfa != MT_CFA_RBP) return mt_unwind_row{0, 0, r.cfa, 0};
  // A save slot (bytes from the CFA) into the byte: from the CFA, or from
  // the CFA's register (sp or x29: gcc's frame records at a frame's bottom).
  auto place = [&](int64_t off, int64_t* stored, bool* base) {
    auto fits = [](int64_t v) { return v % 8 == 0 && v / 8 >= INT8_MIN && v / 8 <= INT8_MAX; };
    if (fits(off)) {
      *stored = off / 8;
      *base = false;
      return true;
    }
    if (fits(off + r.cfa_off)) {
      *stored = (off + r.cfa_off) / 8;
      *base = true;
      return true;
    }
    return false;
  };
  if (r.rbp == MT_RBP_AT_RBP) r.rbp = MT_RBP_UNKNOWN;
  int64_t x29_slot = 0, ra_slot = 0;
  bool x29_base = false, ra_base = false;
  if (r.rbp == MT_RBP_AT_CFA && !place(r.rbp_off, &x29_slot, &x29_base)) r.rbp = MT_RBP_UNKNOWN;
  uint8_t ra = MT_RA_REG;
  int64_t slot = r.rbp == MT_RBP_AT_CFA ? x29_slot : 0;
  if (r.ra == MT_RA_AT_CFA || r.ra == MT_RA_PAIR) {
    if (r.rbp == MT_RBP_AT_CFA && r.ra_off == r.rbp_off + 8) {
      ra = MT_RA_PAIR;
    } else if (place(r.ra_off, &ra_slot, &ra_base)) {
      // one slot: x30's wins (x29 saved elsewhere is given up)
      if (r.rbp == MT_RBP_AT_CFA) r.rbp = MT_RBP_UNKNOWN;
      ra = ra_base ? MT_RA_AT_BASE : MT_RA_AT_CFA;
      slot = ra_slot;
    } else {
      return mt_unwind_row{0, 0, MT_CFA_UNSUPPORTED, 0};
    }
  }
  uint8_t x29 = r.rbp == MT_RBP_AT_CFA && x29_base ? uint8_t(MT_X29_AT_BASE_ARM64) : r.rbp;
  mt_unwind_row out{};
  out.cfa_off = static_cast<int16_t>(r.cfa_off / 8);
  out.kind = static_cast<uint8_t>(r.cfa | (x29 << 4) | (ra << 6));
  out.rbp_off = static_cast<int8_t>(slot);
  return out;
}

RowInfo decode_row_arm64(const mt_unwind_row& row) {
  RowInfo r;
  r.cfa = MT_ROW_CFA(&row);
  r.cfa_off = int64_t(row.cfa_off) * 8;
  uint8_t x29 = MT_ROW_X29_ARM64(&row), ra = MT_ROW_RA_ARM64(&row);
  bool base = x29 == MT_X29_AT_BASE_ARM64 || ra == MT_RA_AT_BASE;
  int64_t slot = (int64_t(row.rbp_off) - (base ? row.cfa_off : 0)) * 8;  // from the CFA
  r.rbp = x29 == MT_X29_AT_BASE_ARM64 ? uint8_t(MT_RBP_AT_CFA) : x29;
  if (r.rbp == MT_RBP_AT_CFA) r.rbp_off = slot;
  switch (ra) {
    case MT_RA_PAIR: r.ra = MT_RA_AT_CFA; r.ra_off = slot + 8; break;
    case MT_RA_AT_CFA:
    case MT_RA_AT_BASE: r.ra = MT_RA_AT_CFA; r.ra_off = slot; break;
    default: r.ra = MT_RA_REG; break;
  }
  return r;
}

mt_unwind_row encode_row(const RowInfo& in) {
  RowInfo r = in;
  mt_unwind_row out{};
  if (r.cfa == MT_CFA_RSP || r.cfa == MT_CFA_RBP || r.cfa == MT_CFA_RBP_DEREF) {
    if (r.cfa_off % 8 != 0 || r.cfa_off / 8 < INT16_MIN || r.cfa_off / 8 > INT16_MAX) {
      r.cfa = MT_CFA_UNSUPPORTED;
      r.cfa_off = 0;
    }
  }
  if (r.cfa == MT_CFA_NONE || r.cfa == MT_CFA_END || r.cfa == MT_CFA_UNSUPPORTED) {
    r.cfa_off = 0;
    r.rbp = MT_RBP_SAME;
  }
  if (r.rbp == MT_RBP_AT_CFA || r.rbp == MT_RBP_AT_RBP) {
    if (r.rbp_off % 8 != 0 || r.rbp_off / 8 < INT8_MIN || r.rbp_off / 8 > INT8_MAX) r.rbp = MT_RBP_UNKNOWN;
  }
  if (r.rbp != MT_RBP_AT_CFA && r.rbp != MT_RBP_AT_RBP) r.rbp_off = 0;
  out.cfa_off = static_cast<int16_t>(r.cfa == MT_CFA_PLT ? r.cfa_off : r.cfa_off / 8);
  out.kind = static_cast<uint8_t>(r.cfa | (r.rbp << 4));
  out.rbp_off = static_cast<int8_t>(r.rbp_off / 8);
  return out;
}

RowInfo decode_row(const mt_unwind_row& row) {
  RowInfo r;
  r.cfa = MT_ROW_CFA(&row);
  r.rbp = MT_ROW_RBP(&row);
  r.cfa_off = r.cfa == MT_CFA_PLT ? row.cfa_off : int64_t(row.cfa_off) * 8;
  r.rbp_off = int64_t(row.rbp_off) * 8;
  return r;
}

const char* cfa_type_name(uint8_t t) {
  switch (t) {
    case MT_CFA_NONE: return "none";
    case MT_CFA_RSP: return "rsp";
    case MT_CFA_RBP: return "rbp";
    case MT_CFA_RBP_DEREF: return "*rbp";
    case MT_CFA_PLT: return "plt";
    case MT_CFA_END: return "end";
    default: return "unsupported";
  }
}

const mt_unwind_row* CfiTable::lookup(uint64_t vaddr) const {
  if (vaddr < base || vaddr - base > UINT32_MAX) return nullptr;
  uint32_t pc = static_cast<uint32_t>(vaddr - base);
  auto it = std::upper_bound(rows.begin(), rows.end(), pc,
                             [](uint32_t v, const mt_unwind_row& r) { return v < r.pc; });
  if (it == rows.begin()) return nullptr;
  return &*(it - 1);
}

Result<CfiTable> build_cfi_table(const std::string& path) {
  auto img = elf::Image::open(path);
  if (!img) return img.error();
  return build_cfi_table(**img);
}

Result<CfiTable> build_cfi_table_fd(int fd, const std::string& what) {
  Fd own(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!own.valid()) return Error::sys("dup fd of " + what);
  auto img = elf::Image::open_fd(std::move(own), what);
  if (!img) return img.error();
  return build_cfi_table(**img);
}

Result<CfiTable> build_cfi_table(const elf::Image& img) {
  const std::string& what = img.path();
  Elf* elf = img.elf();
  if (img.machine() != EM_X86_64 && img.machine() != EM_AARCH64)
    return Error::msg("CFI tables " + what + ": not an x86-64 or aarch64 ELF file");
  const Arch& arch = img.machine() == EM_AARCH64 ? kArchArm64 : kArchX86;
  size_t shstrndx = 0;
  if (elf_getshdrstrndx(elf, &shstrndx) != 0) return Error::msg("section names " + what + ": " + elf_errmsg(-1));

  CfiTable t;
  t.path = what;
  t.build_id = img.build_id_hex();
  t.segments = img.segments();
  t.machine = img.machine();
  Section eh_frame, debug_frame;
  uint64_t text_addr = 0;
  std::vector<FdeRows> fdes;
  for (Elf_Scn* scn = elf_nextscn(elf, nullptr); scn; scn = elf_nextscn(elf, scn)) {
    GElf_Shdr sh;
    if (!gelf_getshdr(scn, &sh)) continue;
    const char* name = elf_strptr(elf, shstrndx, sh.sh_name);
    if (!name) continue;
    bool is_eh = std::strcmp(name, ".eh_frame") == 0;
    bool is_debug = std::strcmp(name, ".debug_frame") == 0;
    if (std::strcmp(name, ".text") == 0) text_addr = sh.sh_addr;
    if (arch.arm64 && std::strcmp(name, ".plt") == 0 && sh.sh_type == SHT_PROGBITS && sh.sh_size) {
      Elf_Data* d = elf_getdata(scn, nullptr);
      fdes.push_back(plt_rows_arm64(d && d->d_size == sh.sh_size ? static_cast<const uint8_t*>(d->d_buf) : nullptr,
                                    sh.sh_size, sh.sh_addr));
      continue;
    }
    if ((!is_eh && !is_debug) || sh.sh_type == SHT_NOBITS) continue;
    if ((sh.sh_flags & SHF_COMPRESSED) && (!img.compressed_sections_sane() || elf_compress(scn, 0, 0) < 0)) continue;
    Elf_Data* d = elf_getdata(scn, nullptr);
    if (!d || !d->d_buf) continue;
    Section& s = is_eh ? eh_frame : debug_frame;
    s.data = static_cast<const uint8_t*>(d->d_buf);
    s.size = d->d_size;
    s.addr = sh.sh_addr;
    s.eh = is_eh;
  }

  if (eh_frame.data) parse_section(eh_frame, text_addr, &fdes, &t.fdes_skipped, arch);
  if (debug_frame.data) parse_section(debug_frame, text_addr, &fdes, &t.fdes_skipped, arch);
  // .eh_frame first at equal start: it is what the runtime uses.
  std::stable_sort(fdes.begin(), fdes.end(), [](const FdeRows& a, const FdeRows& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    return a.debug_frame < b.debug_frame;
  });
  if (fdes.empty()) return t;
  for (const auto& f : fdes)
    if (!f.synthetic) t.fde_ranges.emplace_back(f.begin, f.end);
  uint64_t lo = fdes.front().begin, hi = 0;
  for (auto& f : fdes) hi = std::max(hi, f.end);
  t.base = lo & ~uint64_t(0xfff);
  if (hi - t.base > UINT32_MAX) return Error::msg("CFI tables " + what + ": code spans more than 4 GiB");

  uint64_t covered_to = 0;  // end of the last FDE used
  auto push = [&](uint64_t vaddr, mt_unwind_row row) {
    row.pc = static_cast<uint32_t>(vaddr - t.base);
    if (!t.rows.empty() && t.rows.back().pc == row.pc) {
      t.rows.back() = row;
    } else if (!t.rows.empty() && same_row(t.rows.back(), row)) {
      return;
    } else {
      t.rows.push_back(row);
    }
      };
  for (size_t i = 0; i < fdes.size(); i++) {
    const FdeRows& f = fdes[i];
    if (f.begin < covered_to) {  // overlaps an FDE already used (duplicate in .debug_frame)
      t.fdes_skipped++;
      continue;
    }
    for (auto& [vaddr, row] : f.rows)
      if (vaddr < f.end) push(vaddr, row);
    covered_to = f.end;
    if (!f.synthetic) t.fdes++;
    if (f.debug_frame) t.fdes_debug_frame++;
    // Gap after this FDE: no CFI there.
    size_t j = i + 1;
    while (j < fdes.size() && fdes[j].begin < covered_to) j++;
    if (j == fdes.size() || fdes[j].begin > f.end) push(f.end, mt_unwind_row{0, 0, MT_CFA_NONE, 0});
  }
  t.rows_unsupported = 0;
  for (auto& r : t.rows) t.rows_unsupported += MT_ROW_CFA(&r) == MT_CFA_UNSUPPORTED;
  t.rows.shrink_to_fit();
  return t;
}

}  // namespace memtrace::unwind
