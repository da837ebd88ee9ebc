// CFI tables vs binutils: every row `readelf --debug-dump=frames-interp`
// prints must be what our table says at that pc (CFA rule, rbp rule,
// return address), the end of each FDE must fall back to "no CFI" unless
// another FDE starts there, and the special expressions must be recognised.
#include <elf.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "test_env.h"
#include "unwind/cfi_table.h"
#include "shell.h"

using memtrace::unwind::CfiTable;
using memtrace::unwind::RowInfo;

namespace {


struct RefRow {
  uint64_t loc;
  std::string cfa, rbp, ra;
};
struct RefFde {
  uint64_t begin, end;
  bool debug_frame;
  std::vector<RefRow> rows;  // empty: the CIE's initial row applies
  std::string cie;
};

struct RefDump {
  std::vector<RefFde> fdes;
  std::map<std::string, std::vector<RefRow>> cie_rows;  // by "section:offset"
};

// readelf: the host's, or aarch64-linux-gnu-readelf (fp "x29").
RefDump parse_readelf(const std::string& path, const std::string& readelf = "readelf",
                      const std::string& fp = "rbp") {
  RefDump d;
  std::istringstream in(memtrace::testing::shell_output(readelf + " --wide --debug-dump=frames-interp '" + path + "' 2>/dev/null"));
  std::string line, section;
  std::vector<std::string> cols;
  std::vector<RefRow>* cur = nullptr;
  while (std::getline(in, line)) {
    if (line.rfind("Contents of the .eh_frame", 0) == 0) section = "eh";
    else if (line.rfind("Contents of the .debug_frame", 0) == 0) section = "debug";
    std::istringstream ls(line);
    std::vector<std::string> tok;
    for (std::string t; ls >> t;) {
      if (t[0] == '(' && !tok.empty()) tok.back() += " " + t;  // "r9 (r9)" is one column
      else tok.push_back(t);
    }
    if (tok.size() >= 4 && tok[3] == "CIE") {
      cur = &d.cie_rows[section + ":" + tok[0]];
      continue;
    }
    if (tok.size() >= 6 && tok[3] == "FDE") {
      RefFde f{};
      f.debug_frame = section == "debug";
      f.cie = section + ":" + tok[4].substr(4);
      auto pc = tok[5].substr(3);
      auto dots = pc.find("..");
      f.begin = std::stoull(pc.substr(0, dots), nullptr, 16);
      f.end = std::stoull(pc.substr(dots + 2), nullptr, 16);
      d.fdes.push_back(f);
      cur = &d.fdes.back().rows;
      continue;
    }
    if (!tok.empty() && tok[0] == "LOC") {
      cols = tok;
      continue;
    }
    if (cur && tok.size() == cols.size() && tok.size() >= 3 && tok[0].size() == 16 &&
        tok[0].find_first_not_of("0123456789abcdef") == std::string::npos) {
      RefRow r{std::stoull(tok[0], nullptr, 16), "", "", ""};
      for (size_t i = 1; i < cols.size(); i++) {
        if (cols[i] == "CFA") r.cfa = tok[i];
        if (cols[i] == fp) r.rbp = tok[i];
        if (cols[i] == "ra") r.ra = tok[i];
      }
      cur->push_back(r);
    }
  }
  return d;
}

// What readelf's row means for our table; `alts` lists the other answers a
// row printed as "exp" may legitimately have.
bool matches(const RefRow& ref, const mt_unwind_row& got, std::string* why) {
  RowInfo want;
  RowInfo g = memtrace::unwind::decode_row(got);
  auto num = [](const std::string& s, size_t at) { return std::stoll(s.substr(at)); };
  if (ref.ra == "u") {
    want.cfa = MT_CFA_END;
  } else if (ref.ra != "c-8") {
    want.cfa = MT_CFA_UNSUPPORTED;
  } else if (ref.cfa.rfind("rsp+", 0) == 0) {
    want.cfa = MT_CFA_RSP;
    want.cfa_off = num(ref.cfa, 4);
  } else if (ref.cfa.rfind("rbp+", 0) == 0) {
    want.cfa = MT_CFA_RBP;
    want.cfa_off = num(ref.cfa, 4);
  } else if (ref.cfa == "exp") {
    // readelf does not print the expression: any of our expression kinds.
    want.cfa = g.cfa == MT_CFA_PLT || g.cfa == MT_CFA_RBP_DEREF ? g.cfa : uint8_t(MT_CFA_UNSUPPORTED);
    want.cfa_off = g.cfa_off;
  } else {
    want.cfa = MT_CFA_UNSUPPORTED;
  }
  if (ref.rbp.empty() || ref.rbp == "s") {
    want.rbp = MT_RBP_SAME;
  } else if (ref.rbp == "u") {
    want.rbp = g.rbp == MT_RBP_UNKNOWN ? MT_RBP_UNKNOWN : MT_RBP_SAME;  // unset or undefined
  } else if (ref.rbp.rfind("c", 0) == 0) {
    want.rbp = MT_RBP_AT_CFA;
    want.rbp_off = num(ref.rbp, 1);
  } else if (ref.rbp == "exp") {
    want.rbp = g.rbp == MT_RBP_AT_RBP ? MT_RBP_AT_RBP : MT_RBP_UNKNOWN;
    want.rbp_off = g.rbp_off;
  } else {
    want.rbp = MT_RBP_UNKNOWN;
  }
  mt_unwind_row w = memtrace::unwind::encode_row(want);
  if (w.kind == got.kind && w.cfa_off == got.cfa_off && w.rbp_off == got.rbp_off) return true;
  RowInfo wi = memtrace::unwind::decode_row(w);
  char buf[256];
  std::snprintf(buf, sizeof buf, "readelf CFA=%s rbp=%s ra=%s; want %s%+ld rbp %d%+ld, got %s%+ld rbp %d%+ld",
                ref.cfa.c_str(), ref.rbp.c_str(), ref.ra.c_str(), memtrace::unwind::cfa_type_name(wi.cfa),
                (long)wi.cfa_off, wi.rbp, (long)wi.rbp_off, memtrace::unwind::cfa_type_name(g.cfa),
                (long)g.cfa_off, g.rbp, (long)g.rbp_off);
  *why = buf;
  return false;
}

// aarch64: readelf's row (CFA on sp or x29, x29, ra = x30) as our arm64 row.
// readelf prints "u" both for a rule never set and for DW_CFA_undefined:
// x30 undefined is told by the FDEs that say so (undef_ra: from that row on).
bool matches_arm64(const RefRow& ref, const mt_unwind_row& got, bool undef_ra, std::string* why) {
  RowInfo want;
  RowInfo g = memtrace::unwind::decode_row_arm64(got);
  auto num = [](const std::string& s, size_t at) { return std::stoll(s.substr(at)); };
  if (ref.cfa.rfind("sp+", 0) == 0 || ref.cfa.rfind("sp-", 0) == 0) {  // (ld.so has sp-16)
    want.cfa = MT_CFA_RSP;
    want.cfa_off = num(ref.cfa, 2);
  } else if (ref.cfa.rfind("x29+", 0) == 0) {
    want.cfa = MT_CFA_RBP;
    want.cfa_off = num(ref.cfa, 4);
  } else {
    want.cfa = MT_CFA_UNSUPPORTED;
  }
  if (ref.rbp.empty() || ref.rbp == "s") {
    want.rbp = MT_RBP_SAME;
  } else if (ref.rbp == "u") {
    want.rbp = g.rbp == MT_RBP_UNKNOWN ? MT_RBP_UNKNOWN : MT_RBP_SAME;
  } else if (ref.rbp.rfind("c", 0) == 0) {
    want.rbp = MT_RBP_AT_CFA;
    want.rbp_off = num(ref.rbp, 1);
  } else {
    want.rbp = MT_RBP_UNKNOWN;
  }
  if (ref.ra.empty() || ref.ra == "s" || (ref.ra == "u" && !undef_ra)) {
    want.ra = MT_RA_REG;
  } else if (ref.ra == "u") {
    want = RowInfo{};
    want.cfa = MT_CFA_END;
  } else if (ref.ra.rfind("c", 0) == 0) {
    want.ra = MT_RA_AT_CFA;
    want.ra_off = num(ref.ra, 1);
  } else {
    want.cfa = MT_CFA_UNSUPPORTED;
  }
  mt_unwind_row w = memtrace::unwind::encode_row_arm64(want);
  if (w.kind == got.kind && w.cfa_off == got.cfa_off && w.rbp_off == got.rbp_off) return true;
  RowInfo wi = memtrace::unwind::decode_row_arm64(w);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "readelf CFA=%s x29=%s ra=%s; want %s%+ld x29 %d%+ld x30 %d%+ld, got %s%+ld x29 %d%+ld x30 %d%+ld",
                ref.cfa.c_str(), ref.rbp.c_str(), ref.ra.c_str(), memtrace::unwind::cfa_type_name(wi.cfa),
                (long)wi.cfa_off, wi.rbp, (long)wi.rbp_off, wi.ra, (long)wi.ra_off,
                memtrace::unwind::cfa_type_name(g.cfa), (long)g.cfa_off, g.rbp, (long)g.rbp_off, g.ra,
                (long)g.ra_off);
  *why = buf;
  return false;
}

struct Counts {
  size_t fdes = 0, rows = 0, bad = 0;
};

// FDEs whose instructions make x30 undefined (aarch64): FDE start -> the
// first pc where it is.
std::map<uint64_t, uint64_t> undefined_ra_fdes(const std::string& path) {
  std::map<uint64_t, uint64_t> out;
  std::istringstream in(memtrace::testing::shell_output("aarch64-linux-gnu-readelf --wide --debug-dump=frames '" +
                                                        path + "' 2>/dev/null"));
  uint64_t begin = 0, loc = 0;
  for (std::string line; std::getline(in, line);) {
    if (auto at = line.find(" FDE cie="); at != std::string::npos) {
      auto pc = line.find("pc=", at);
      begin = loc = pc == std::string::npos ? 0 : std::stoull(line.substr(pc + 3), nullptr, 16);
    } else if (auto adv = line.find("DW_CFA_advance_loc"); adv != std::string::npos) {
      if (auto to = line.find(" to ", adv); to != std::string::npos) loc = std::stoull(line.substr(to + 4), nullptr, 16);
    } else if (line.find("DW_CFA_undefined: r30") != std::string::npos && !out.count(begin)) {
      out[begin] = loc;
    }
  }
  return out;
}

Counts compare_with_readelf(const std::string& path, const CfiTable& t, bool arm64 = false) {
  Counts c;
  RefDump d = arm64 ? parse_readelf(path, "aarch64-linux-gnu-readelf", "x29") : parse_readelf(path);
  std::map<uint64_t, uint64_t> undef_ra;
  if (arm64) undef_ra = undefined_ra_fdes(path);
  EXPECT_FALSE(d.fdes.empty()) << "readelf printed no FDE for " << path;
  // FDEs of .debug_frame only count where no .eh_frame FDE covers them.
  std::vector<std::pair<uint64_t, uint64_t>> eh;
  for (auto& f : d.fdes)
    if (!f.debug_frame) eh.emplace_back(f.begin, f.end);
  std::map<uint64_t, bool> starts;
  for (auto& f : d.fdes) starts[f.begin] = true;
  for (auto& f : d.fdes) {
    if (f.begin == f.end) continue;
    if (f.debug_frame) {
      bool covered = false;
      for (auto& [b, e] : eh) covered |= b < f.end && f.begin < e;
      if (covered) continue;
    }
    c.fdes++;
    std::vector<RefRow> rows = f.rows;
    if (rows.empty()) {
      auto it = d.cie_rows.find(f.cie);
      if (it == d.cie_rows.end() || it->second.empty()) continue;
      rows = {it->second.back()};
      rows[0].loc = f.begin;
    }
    for (size_t i = 0; i < rows.size(); i++) {
      c.rows++;
      uint64_t last = i + 1 < rows.size() ? rows[i + 1].loc - 1 : f.end - 1;
      for (uint64_t at : {rows[i].loc, last}) {
        const mt_unwind_row* got = t.lookup(at);
        std::string why;
        if (!got) {
          if (c.bad++ < 10) ADD_FAILURE() << path << " pc 0x" << std::hex << at << ": no row";
          continue;
        }
        auto u = undef_ra.find(f.begin);
        bool ok = arm64 ? matches_arm64(rows[i], *got, u != undef_ra.end() && rows[i].loc >= u->second, &why)
                        : matches(rows[i], *got, &why);
        if (!ok && c.bad++ < 10)
          ADD_FAILURE() << path << " pc 0x" << std::hex << at << ": " << why;
      }
    }
    if (!starts.count(f.end)) {
      const mt_unwind_row* after = t.lookup(f.end);
      if (after && MT_ROW_CFA(after) != MT_CFA_NONE && c.bad++ < 10)
        ADD_FAILURE() << path << " pc 0x" << std::hex << f.end << " (end of FDE) should have no CFI";
    }
  }
  return c;
}

void check_file(const std::string& path, size_t min_fdes, bool arm64 = false) {
  auto t = memtrace::unwind::build_cfi_table(path);
  ASSERT_TRUE(t.ok()) << t.error().message;
  Counts c = compare_with_readelf(path, *t, arm64);
  EXPECT_EQ(c.bad, 0u);
  EXPECT_GE(c.fdes, min_fdes);
  EXPECT_EQ(t->fdes, c.fdes) << "FDEs used by us vs readelf";
  std::printf("%s: %zu FDEs, %zu readelf rows checked, %zu table rows, %zu bytes\n", path.c_str(),
              c.fdes, c.rows, t->rows.size(), t->bytes());
}

size_t count_kind(const CfiTable& t, uint8_t kind) {
  size_t n = 0;
  for (auto& r : t.rows) n += MT_ROW_CFA(&r) == kind;
  return n;
}

}  // namespace

TEST(CfiTable, LibcMatchesReadelf) { check_file("/lib/x86_64-linux-gnu/libc.so.6", 3000); }
TEST(CfiTable, LdSoMatchesReadelf) { check_file("/lib64/ld-linux-x86-64.so.2", 100); }
TEST(CfiTable, LibstdcxxMatchesReadelf) { check_file("/lib/x86_64-linux-gnu/libstdc++.so.6", 3000); }
TEST(CfiTable, Python3MatchesReadelf) { check_file("/usr/bin/python3.11", 5000); }
TEST(CfiTable, GitMatchesReadelf) { check_file("/usr/bin/git", 3000); }
TEST(CfiTable, FixtureOmitFpMatchesReadelf) { check_file(UNW_DIR "/unwind_target", 5); }
TEST(CfiTable, FixtureSharedLibMatchesReadelf) { check_file(UNW_DIR "/libunwind_nofp.so", 3); }
// Only .debug_frame (no .eh_frame): compiled -fno-asynchronous-unwind-tables -g.
TEST(CfiTable, DebugFrameOnlyMatchesReadelf) {
  check_file(UNW_DIR "/debug_frame_only", 3);
  auto t = memtrace::unwind::build_cfi_table(UNW_DIR "/debug_frame_only");
  ASSERT_TRUE(t.ok());
  EXPECT_GT(t->fdes_debug_frame, 0u);
}

TEST(CfiTable, PltAndRealignExpressionsRecognised) {
  auto git = memtrace::unwind::build_cfi_table("/usr/bin/git");
  ASSERT_TRUE(git.ok());
  EXPECT_GT(count_kind(*git, MT_CFA_PLT), 0u) << ".plt rows of git";
  // main() realigns its stack (AVX locals): CFA = *(rbp-8).
  auto t = memtrace::unwind::build_cfi_table(UNW_DIR "/unwind_target");
  ASSERT_TRUE(t.ok());
  EXPECT_GT(count_kind(*t, MT_CFA_RBP_DEREF), 0u);
  size_t unsupported = 0;
  for (const char* f : {"/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3.11", "/usr/bin/git"}) {
    auto x = memtrace::unwind::build_cfi_table(f);
    ASSERT_TRUE(x.ok());
    unsupported += x->rows_unsupported;
    std::printf("%s: %zu plt rows, %zu *rbp rows, %zu unsupported, %zu end rows\n", f,
                count_kind(*x, MT_CFA_PLT), count_kind(*x, MT_CFA_RBP_DEREF), x->rows_unsupported,
                count_kind(*x, MT_CFA_END));
  }
  EXPECT_LT(unsupported, 50u);
}

TEST(CfiTable, OutermostFramesEndTheStack) {
  // glibc marks the return address undefined in _start's caller-less frame
  // and in clone3's child: the unwinder's "complete stack" markers.
  auto t = memtrace::unwind::build_cfi_table("/lib/x86_64-linux-gnu/libc.so.6");
  ASSERT_TRUE(t.ok());
  EXPECT_GT(count_kind(*t, MT_CFA_END), 0u);
}

TEST(CfiTable, NotElfIsAnError) {
  auto t = memtrace::unwind::build_cfi_table("/etc/hostname");
  EXPECT_FALSE(t.ok());
  auto u = memtrace::unwind::build_cfi_table("/nonexistent/file");
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.error().message.find("/nonexistent/file"), std::string::npos);
}

// ---- aarch64 files (issue 20): parsed here, checked against
// aarch64-linux-gnu-readelf. The multiarch libc6:arm64 and the cross
// compiler come with scripts/deps.txt (under CI=true a missing one fails).
namespace {

bool have_arm64_tools() {
  return memtrace::testing::shell_output("command -v aarch64-linux-gnu-readelf 2>/dev/null").size() > 0;
}
#define NEED_ARM64(path)                                                                   \
  if (!have_arm64_tools() || access(path, R_OK) != 0)                                     \
    MEMTRACE_SKIP_OR_FAIL(std::string("needs aarch64-linux-gnu-readelf and ") + path + " (scripts/deps.txt)")

uint64_t arm64_sym(const std::string& path, const std::string& name) {
  std::istringstream in(memtrace::testing::shell_output("aarch64-linux-gnu-nm '" + path + "' 2>/dev/null"));
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string addr, type, sym;
    if (ls >> addr >> type >> sym && sym == name) return std::stoull(addr, nullptr, 16);
  }
  ADD_FAILURE() << name << " not in " << path;
  return 0;
}

uint64_t arm64_section(const std::string& path, const std::string& name) {
  std::istringstream in(memtrace::testing::shell_output("aarch64-linux-gnu-readelf -SW '" + path + "' 2>/dev/null"));
  for (std::string line; std::getline(in, line);) {
    auto at = line.find("] ");
    if (at == std::string::npos) continue;
    std::istringstream ls(line.substr(at + 2));
    std::string sec, type, addr;
    if (ls >> sec >> type >> addr && sec == name) return std::stoull(addr, nullptr, 16);
  }
  ADD_FAILURE() << name << " not in " << path;
  return 0;
}

RowInfo arm64_row(const CfiTable& t, uint64_t vaddr) {
  const mt_unwind_row* r = t.lookup(vaddr);
  EXPECT_NE(r, nullptr) << std::hex << vaddr;
  return r ? memtrace::unwind::decode_row_arm64(*r) : RowInfo{};
}

}  // namespace

TEST(CfiTableArm64, LibcMatchesReadelf) {
  NEED_ARM64("/usr/lib/aarch64-linux-gnu/libc.so.6");
  check_file("/usr/lib/aarch64-linux-gnu/libc.so.6", 3000, true);
}
TEST(CfiTableArm64, LdSoMatchesReadelf) {
  NEED_ARM64("/usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1");
  check_file("/usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1", 100, true);
}
TEST(CfiTableArm64, LibstdcxxMatchesReadelf) {
  NEED_ARM64("/usr/aarch64-linux-gnu/lib/libstdc++.so.6");
  check_file("/usr/aarch64-linux-gnu/lib/libstdc++.so.6", 3000, true);
}
// unwind_target.c and unwind_nofp.c built by aarch64-linux-gnu-gcc -O2
// -fomit-frame-pointer, and once more with -mbranch-protection=pac-ret.
TEST(CfiTableArm64, FixturesMatchReadelf) {
  NEED_ARM64(UNW_ARM64_DIR "/unwind_target");
  check_file(UNW_ARM64_DIR "/unwind_target", 5, true);
  check_file(UNW_ARM64_DIR "/libunwind_nofp.so", 3, true);
  check_file(UNW_ARM64_DIR "/unwind_target_pac", 5, true);
}

// The prologues of unwind_target (gcc 12, -O2 -fomit-frame-pointer):
//   c6: str x30, [sp, #-16]!            x30 saved alone, x29 untouched
//   c5: stp x19, x30, [sp, #-16]!       x30 at CFA-8
//   c3: stp x29, x30, [sp, #-160]!; mov x29, sp   (alloca: CFA on x29)
TEST(CfiTableArm64, KnownProloguesGiveTheirRows) {
  const std::string f = UNW_ARM64_DIR "/unwind_target";
  NEED_ARM64(f.c_str());
  auto t = memtrace::unwind::build_cfi_table(f);
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->machine, EM_AARCH64);
  uint64_t c6 = arm64_sym(f, "c6"), c5 = arm64_sym(f, "c5"), c3 = arm64_sym(f, "c3");
  RowInfo r = arm64_row(*t, c6);  // entry: CFA = sp, return address in x30
  EXPECT_EQ(r.cfa, MT_CFA_RSP);
  EXPECT_EQ(r.cfa_off, 0);
  EXPECT_EQ(r.rbp, MT_RBP_SAME);
  EXPECT_EQ(r.ra, MT_RA_REG);
  r = arm64_row(*t, c6 + 4);
  EXPECT_EQ(r.cfa, MT_CFA_RSP);
  EXPECT_EQ(r.cfa_off, 16);
  EXPECT_EQ(r.rbp, MT_RBP_SAME);
  EXPECT_EQ(r.ra, MT_RA_AT_CFA);
  EXPECT_EQ(r.ra_off, -16);
  EXPECT_EQ(MT_ROW_RA_ARM64(t->lookup(c6 + 4)), MT_RA_AT_CFA);
  r = arm64_row(*t, c5 + 4);
  EXPECT_EQ(r.cfa_off, 16);
  EXPECT_EQ(r.ra, MT_RA_AT_CFA);
  EXPECT_EQ(r.ra_off, -8);
  r = arm64_row(*t, c3 + 4);  // after the stp: CFA still on sp
  EXPECT_EQ(r.cfa, MT_CFA_RSP);
  EXPECT_EQ(r.cfa_off, 160);
  r = arm64_row(*t, c3 + 8);  // after mov x29, sp
  EXPECT_EQ(r.cfa, MT_CFA_RBP);
  EXPECT_EQ(r.cfa_off, 160);
  EXPECT_EQ(r.rbp, MT_RBP_AT_CFA);
  EXPECT_EQ(r.rbp_off, -160);
  EXPECT_EQ(r.ra, MT_RA_AT_CFA);
  EXPECT_EQ(r.ra_off, -152);
  // the pair is one slot in the 8 bytes: x29/8 and "x30 right above it"
  const mt_unwind_row* raw = t->lookup(c3 + 8);
  ASSERT_NE(raw, nullptr);
  EXPECT_EQ(raw->kind, MT_CFA_RBP | MT_RBP_AT_CFA << 4 | MT_RA_PAIR << 6);
  EXPECT_EQ(raw->cfa_off, 20);
  EXPECT_EQ(raw->rbp_off, -20);
  // _start: .cfi_undefined x30, the outermost frame
  EXPECT_EQ(arm64_row(*t, arm64_sym(f, "_start") + 4).cfa, MT_CFA_END);
  EXPECT_EQ(t->fdes_skipped, 0u);
}

// PAC: gcc's paciasp is followed by DW_CFA_AARCH64_negate_ra_state (0x2d,
// GNU_window_save's number), which must be parsed, not make the FDE
// unreadable; the rows are the same as without it.
TEST(CfiTableArm64, NegateRaStateIsParsed) {
  const std::string f = UNW_ARM64_DIR "/unwind_target_pac";
  NEED_ARM64(f.c_str());
  std::string raw = memtrace::testing::shell_output("aarch64-linux-gnu-readelf --debug-dump=frames '" + f + "'");
  size_t n = 0;
  for (size_t at = 0; (at = raw.find("DW_CFA_AARCH64_negate_ra_state", at)) != std::string::npos; at++) n++;
  EXPECT_GT(n, 10u) << "the fixture was built without pac-ret";
  auto t = memtrace::unwind::build_cfi_table(f);
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->fdes_skipped, 0u);
  EXPECT_EQ(t->rows_unsupported, 0u);
  uint64_t c6 = arm64_sym(f, "c6");  // paciasp; str x30, [sp, #-16]!
  RowInfo r = arm64_row(*t, c6 + 4);
  EXPECT_EQ(r.cfa_off, 0);
  EXPECT_EQ(r.ra, MT_RA_REG);
  r = arm64_row(*t, c6 + 8);
  EXPECT_EQ(r.cfa_off, 16);
  EXPECT_EQ(r.ra, MT_RA_AT_CFA);
  EXPECT_EQ(r.ra_off, -16);
}

// .plt has no CFI on aarch64: the stubs are CFA = sp, x30; the header stub
// (stp x16, x30, [sp, #-16]!) has x30 at CFA-8 past its first instruction.
TEST(CfiTableArm64, PltStubsReturnThroughX30) {
  const std::string f = "/usr/lib/aarch64-linux-gnu/libc.so.6";
  NEED_ARM64(f.c_str());
  auto t = memtrace::unwind::build_cfi_table(f);
  ASSERT_TRUE(t.ok()) << t.error().message;
  uint64_t plt = arm64_section(f, ".plt");
  RowInfo r = arm64_row(*t, plt);
  EXPECT_EQ(r.cfa, MT_CFA_RSP);
  EXPECT_EQ(r.cfa_off, 0);
  EXPECT_EQ(r.ra, MT_RA_REG);
  r = arm64_row(*t, plt + 4);
  EXPECT_EQ(r.cfa_off, 16);
  EXPECT_EQ(r.ra, MT_RA_AT_CFA);
  EXPECT_EQ(r.ra_off, -8);
  for (uint64_t at : {plt + 32, plt + 44, plt + 48}) {
    r = arm64_row(*t, at);
    EXPECT_EQ(r.cfa, MT_CFA_RSP) << std::hex << at;
    EXPECT_EQ(r.cfa_off, 0) << std::hex << at;
    EXPECT_EQ(r.ra, MT_RA_REG) << std::hex << at;
  }
  // Debian 12's libc6:arm64 2.36: 3 rows of 13,422 the BPF walk cannot
  // follow, none in the .plt: the CFA on x0 in getcontext/setcontext's
  // family (3a744, 3fb6c) and x30 kept in x15 in rawmemchr (96b14)
  EXPECT_EQ(t->rows_unsupported, 3u);
  for (auto& row : t->rows)
    if (MT_ROW_CFA(&row) == MT_CFA_UNSUPPORTED) {
      EXPECT_GE(t->base + row.pc, arm64_section(f, ".text")) << std::hex << t->base + row.pc;
    }
}

TEST(CfiTableArm64, EncodingKeepsWhatFits) {
  using memtrace::unwind::decode_row_arm64;
  using memtrace::unwind::encode_row_arm64;
  RowInfo pair;
  pair.cfa = MT_CFA_RSP;
  pair.cfa_off = 32;
  pair.rbp = MT_RBP_AT_CFA;
  pair.rbp_off = -32;
  pair.ra = MT_RA_AT_CFA;
  pair.ra_off = -24;
  mt_unwind_row w = encode_row_arm64(pair);
  EXPECT_EQ(MT_ROW_RA_ARM64(&w), MT_RA_PAIR);
  RowInfo back = decode_row_arm64(w);
  EXPECT_EQ(back.rbp_off, -32);
  EXPECT_EQ(back.ra_off, -24);
  // x29 and x30 not adjacent: x30 kept, x29 given up
  RowInfo apart = pair;
  apart.ra_off = -8;
  back = decode_row_arm64(encode_row_arm64(apart));
  EXPECT_EQ(back.cfa, MT_CFA_RSP);
  EXPECT_EQ(back.rbp, MT_RBP_UNKNOWN);
  EXPECT_EQ(back.ra, MT_RA_AT_CFA);
  EXPECT_EQ(back.ra_off, -8);
  // gcc's large frames: the record at the bottom (sub sp, sp, #4304; stp
  // x29, x30, [sp]), 4304 bytes below the CFA, is kept from sp
  RowInfo big = pair;
  big.cfa_off = 4304;
  big.rbp_off = -4304;
  big.ra_off = -4296;
  w = encode_row_arm64(big);
  EXPECT_EQ(MT_ROW_X29_ARM64(&w), MT_X29_AT_BASE_ARM64);
  EXPECT_EQ(MT_ROW_RA_ARM64(&w), MT_RA_PAIR);
  EXPECT_EQ(w.rbp_off, 0);
  back = decode_row_arm64(w);
  EXPECT_EQ(back.rbp, MT_RBP_AT_CFA);
  EXPECT_EQ(back.rbp_off, -4304);
  EXPECT_EQ(back.ra_off, -4296);
  RowInfo alone = big;  // x30 alone there
  alone.rbp = MT_RBP_SAME;
  w = encode_row_arm64(alone);
  EXPECT_EQ(MT_ROW_RA_ARM64(&w), MT_RA_AT_BASE);
  back = decode_row_arm64(w);
  EXPECT_EQ(back.rbp, MT_RBP_SAME);
  EXPECT_EQ(back.ra_off, -4296);
  // a slot more than 1 KiB from both the CFA and sp: unsupported
  RowInfo far = pair;
  far.rbp = MT_RBP_SAME;
  far.cfa_off = 8192;
  far.ra_off = -4096;
  EXPECT_EQ(decode_row_arm64(encode_row_arm64(far)).cfa, MT_CFA_UNSUPPORTED);
  // x86-64's kinds that do not exist on aarch64
  RowInfo plt;
  plt.cfa = MT_CFA_PLT;
  EXPECT_EQ(decode_row_arm64(encode_row_arm64(plt)).cfa, MT_CFA_UNSUPPORTED);
}
