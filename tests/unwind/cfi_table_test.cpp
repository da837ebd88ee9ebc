// CFI tables vs binutils: every row `readelf --debug-dump=frames-interp`
// prints must be what our table says at that pc (CFA rule, rbp rule,
// return address), the end of each FDE must fall back to "no CFI" unless
// another FDE starts there, and the special expressions must be recognised.
#include <gtest/gtest.h>

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

RefDump parse_readelf(const std::string& path) {
  RefDump d;
  std::istringstream in(memtrace::testing::shell_output("readelf --wide --debug-dump=frames-interp '" + path + "' 2>/dev/null"));
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
        if (cols[i] == "rbp") r.rbp = tok[i];
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
    want.cfa = g.cfa == MT_CFA_PLT || g.cfa == MT_CFA_RBP_DEREF ? g.cfa : MT_CFA_UNSUPPORTED;
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

struct Counts {
  size_t fdes = 0, rows = 0, bad = 0;
};

Counts compare_with_readelf(const std::string& path, const CfiTable& t) {
  Counts c;
  RefDump d = parse_readelf(path);
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
        if (!matches(rows[i], *got, &why) && c.bad++ < 10)
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

void check_file(const std::string& path, size_t min_fdes) {
  auto t = memtrace::unwind::build_cfi_table(path);
  ASSERT_TRUE(t.ok()) << t.error().message;
  Counts c = compare_with_readelf(path, *t);
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
