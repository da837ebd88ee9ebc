// src/symbolize against binutils addr2line on fixture programs built by CMake,
// plus live processes through /proc, separate debug files, hostile files.
#include <elf.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "procfs/proc_maps.h"
#include "symbolize/call_site.h"
#include "symbolize/symbolize.h"
#include "test_env.h"
#include "shell.h"

namespace fs = std::filesystem;
using namespace memtrace::symbolize;

namespace {

const std::string kFx = FX_DIR;
// No test here asks a debuginfod server (tests/debuginfo does): a developer's
// DEBUGINFOD_URLS would make the missing-debug-file cases slow and changing.
[[maybe_unused]] const int kNoDebuginfod = ::unsetenv("DEBUGINFOD_URLS");


std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

std::string tmpdir() {
  char t[] = "/tmp/symtest.XXXXXX";
  return ::mkdtemp(t);
}

// Instruction addresses of .text (every instruction, sampled down to max).
std::vector<uint64_t> text_addresses(const std::string& file, size_t max = 2500) {
  std::vector<uint64_t> all;
  static const std::regex re(R"(^\s+([0-9a-f]+):)");
  for (const auto& l : lines(memtrace::testing::shell_output("objdump -d --no-show-raw-insn -j .text '" + file + "' 2>/dev/null"))) {
    std::smatch m;
    if (std::regex_search(l, m, re)) all.push_back(std::stoull(m[1], nullptr, 16));
  }
  if (all.size() <= max) return all;
  std::vector<uint64_t> v;
  for (size_t i = 0; i < max; ++i) v.push_back(all[i * all.size() / max]);
  return v;
}

struct RefFrame {
  std::string function, file;
  std::string line;  // "?" when the tool does not know
};
using RefAnswer = std::vector<RefFrame>;

// Run an addr2line-like tool with -a -f -i -C over addrs (stdin), parse per address.
std::map<uint64_t, RefAnswer> oracle(const std::string& tool, const std::string& file,
                                     const std::vector<uint64_t>& addrs) {
  std::string in = tmpdir() + "/addrs";
  {
    std::ofstream o(in);
    for (auto a : addrs) o << std::hex << "0x" << a << "\n";
  }
  std::map<uint64_t, RefAnswer> res;
  auto ls = lines(memtrace::testing::shell_output(tool + " -a -f -i -C -e '" + file + "' < " + in));
  fs::remove_all(fs::path(in).parent_path());
  static const std::regex disc(R"( \(discriminator \d+\))");
  uint64_t cur = 0;
  for (size_t i = 0; i < ls.size(); ++i) {
    if (ls[i].rfind("0x", 0) == 0) {
      cur = std::stoull(ls[i], nullptr, 16);
      res[cur];
      continue;
    }
    if (i + 1 >= ls.size()) break;
    RefFrame f;
    f.function = ls[i];
    // elfutils: "name inlined at FILE:LINE in OUTER" on the first line
    if (auto p = f.function.find(" inlined at "); p != std::string::npos) f.function.resize(p);
    std::string loc = std::regex_replace(ls[i + 1], disc, "");
    ++i;
    // file:line or file:line:col (elfutils)
    auto c1 = loc.rfind(':');
    std::string tail = loc.substr(c1 + 1);
    std::string head = loc.substr(0, c1);
    auto c2 = head.rfind(':');
    if (c2 != std::string::npos && !head.empty() &&
        std::all_of(head.begin() + static_cast<long>(c2) + 1, head.end(), ::isdigit) && c2 + 1 < head.size()) {
      tail = head.substr(c2 + 1);
      head = head.substr(0, c2);
    }
    f.file = head;
    f.line = tail;
    res[cur].push_back(f);
  }
  return res;
}

std::set<std::string> nm_names(const std::string& file) {
  std::set<std::string> s;
  for (auto& l : lines(memtrace::testing::shell_output("nm -C --defined-only '" + file + "' 2>/dev/null"))) {
    if (l.size() > 19) s.insert(l.substr(19));
  }
  return s;
}

struct CompareStats {
  size_t addresses = 0, frames = 0, mismatches = 0, via_elfutils = 0, via_symbol = 0;
  std::vector<std::string> examples;
};

// Compare the library's answers for `syms_file` (loaded at `bias`) with the
// tools run on `ref_file` (same code; unstripped copy for stripped binaries).
// Rule: equal to binutils addr2line; where binutils and elfutils disagree on
// a field (binutils names an inlined frame after the containing ELF symbol, or
// takes the file from an STT_FILE symbol), equal to elfutils; a function name
// may also be the demangled ELF symbol starting at that function (binutils does
// the same once it has looked up the function's entry).
CompareStats compare_with_addr2line(const std::string& syms_file, const std::string& ref_file, uint64_t bias,
                                    Options opts = {}) {
  CompareStats st;
  auto addrs = text_addresses(ref_file);
  EXPECT_GT(addrs.size(), 50u) << ref_file;
  auto bu = oracle("addr2line", ref_file, addrs);
  auto eu = oracle("eu-addr2line", ref_file, addrs);
  auto names = nm_names(ref_file);
  Symbolizer sym(opts);
  AddressSpace as;
  auto r = sym.add_file(as, syms_file, bias);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  for (uint64_t a : addrs) {
    ++st.addresses;
    const Symbolized& s = sym.symbolize(as, a + bias, false);
    const RefAnswer& b = bu[a];
    const RefAnswer& e = eu[a];
    auto fail = [&](const std::string& why) {
      ++st.mismatches;
      if (st.examples.size() < 12) {
        std::ostringstream o;
        o << std::hex << "0x" << a << std::dec << ": " << why << " | ours:";
        for (auto& f : s.frames) o << " [" << f.function << " @ " << f.file << ":" << f.line << "]";
        o << " | addr2line:";
        for (auto& f : b) o << " [" << f.function << " @ " << f.file << ":" << f.line << "]";
        st.examples.push_back(o.str());
      }
    };
    bool b_unknown = b.size() == 1 && b[0].function == "??" && b[0].line == "?";
    // binutils names the padding after a function by it, past its st_size;
    // elfutils (and we) say ?? there.
    bool e_noname = std::any_of(e.begin(), e.end(), [](const RefFrame& f) { return f.function == "??"; });
    if (s.unknown != Unknown::None) {
      if (e_noname && !b_unknown) ++st.via_elfutils;
      else if (!b_unknown && !(b.size() == 1 && b[0].function == "??")) fail(std::string("unknown: ") + to_string(s.unknown));
      continue;
    }
    if (s.frames.size() != b.size()) {
      fail("frame count");
      continue;
    }
    for (size_t i = 0; i < b.size(); ++i) {
      ++st.frames;
      const Frame& f = s.frames[i];
      const RefFrame* ef = (e.size() == b.size()) ? &e[i] : nullptr;
      std::string fn = f.function.empty() ? "??" : f.function;
      if (fn != b[i].function) {
        if ((ef && fn == ef->function) || (fn == "??" && e_noname)) ++st.via_elfutils;
        else if (names.count(fn) && ef && ef->function == b[i].function) ++st.via_symbol;
        else {
          fail("function #" + std::to_string(i));
          break;
        }
      }
      std::string line = f.line ? std::to_string(f.line) : "?";
      bool b_nofile = b[i].file == "??" || b[i].line == "?";
      if (b_nofile && f.file.empty()) continue;
      if (f.file != b[i].file || (line != b[i].line && !(line == "?" && b[i].line == "0"))) {
        if (ef && f.file == ef->file && line == ef->line) ++st.via_elfutils;
        else {
          fail("file:line #" + std::to_string(i));
          break;
        }
      }
    }
  }
  return st;
}

void expect_matches(const std::string& file, const std::string& ref, uint64_t bias, Options opts = {}) {
  auto st = compare_with_addr2line(file, ref, bias, opts);
  std::string ex;
  for (auto& e : st.examples) ex += "\n  " + e;
  EXPECT_EQ(st.mismatches, 0u) << file << ": " << st.mismatches << " of " << st.addresses << " addresses differ" << ex;
  std::printf("[ compare  ] %s: %zu addresses, %zu frames, 0x%llx bias, %zu fields settled by eu-addr2line, %zu by ELF symbol name\n",
              fs::path(file).filename().c_str(), st.addresses, st.frames, static_cast<unsigned long long>(bias),
              st.via_elfutils, st.via_symbol);
}

constexpr uint64_t kPieBias = 0x7f1234560000;

}  // namespace

// ---- addr2line comparisons ---------------------------------------------------

TEST(Addr2line, O0_PIE) { expect_matches(kFx + "/fx_O0_pie", kFx + "/fx_O0_pie", kPieBias); }
TEST(Addr2line, O2_PIE) { expect_matches(kFx + "/fx_O2_pie", kFx + "/fx_O2_pie", kPieBias); }
TEST(Addr2line, O0_NonPIE) { expect_matches(kFx + "/fx_O0_nopie", kFx + "/fx_O0_nopie", 0); }
TEST(Addr2line, O2_NonPIE) { expect_matches(kFx + "/fx_O2_nopie", kFx + "/fx_O2_nopie", 0); }
TEST(Addr2line, NoSeparateCode) { expect_matches(kFx + "/fx_O2_noseparate", kFx + "/fx_O2_noseparate", kPieBias); }
TEST(Addr2line, SharedLibrary) { expect_matches(kFx + "/libfxlib.so", kFx + "/libfxlib.so", 0x7f5500000000); }
TEST(Addr2line, SharedLibraryUser) { expect_matches(kFx + "/fx_shared", kFx + "/fx_shared", kPieBias); }

TEST(Addr2line, StrippedWithBuildIdDebugFile) {
  Options o;
  o.debug_root = kFx + "/debugroot";
  expect_matches(kFx + "/fx_bid", kFx + "/fx_bid.full", kPieBias, o);
}

TEST(Addr2line, StrippedWithDebuglink) {
  Options o;
  o.debug_root = "/nonexistent";
  expect_matches(kFx + "/fx_dl", kFx + "/fx_dl.full", kPieBias, o);
}

// ---- separate debug files --------------------------------------------------------

namespace {
std::string debug_file_for(const std::string& bin, Options o) {
  Symbolizer sym(o);
  AddressSpace as;
  EXPECT_TRUE(sym.add_file(as, bin, 0).ok());
  auto code = text_addresses(kFx + "/fx_O2_pie", 1);  // any .text address: same layout
  if (code.empty()) return "no .text";
  uint64_t a = code[0];
  return sym.debug_file(as, a);
}
std::string build_id_debug(const std::string& bin) {
  std::string id = memtrace::testing::shell_output("readelf -n '" + bin + "' | awk '/Build ID/ {print $3}'");
  while (!id.empty() && id.back() == '\n') id.pop_back();
  return kFx + "/debugroot/.build-id/" + id.substr(0, 2) + "/" + id.substr(2) + ".debug";
}
}  // namespace

TEST(DebugFiles, BuildIdUnderDebugRoot) {
  Options o;
  o.debug_root = kFx + "/debugroot";
  EXPECT_EQ(debug_file_for(kFx + "/fx_bid", o), build_id_debug(kFx + "/fx_bid"));
  o.debug_root = "/nonexistent";
  EXPECT_EQ(debug_file_for(kFx + "/fx_bid", o), "");
}

TEST(DebugFiles, DebuglinkInDotDebugWithCrc) {
  Options o;
  o.debug_root = "/nonexistent";
  EXPECT_EQ(debug_file_for(kFx + "/fx_dl", o), kFx + "/.debug/fx_dl.debug");
  // Same name, other content: the CRC rejects it.
  std::string d = tmpdir();
  fs::copy_file(kFx + "/fx_dl", d + "/fx_dl");
  fs::create_directories(d + "/.debug");
  fs::copy_file(build_id_debug(kFx + "/fx_bid"), d + "/.debug/fx_dl.debug");
  EXPECT_EQ(debug_file_for(d + "/fx_dl", o), "") << "debuglink matched by name only";
  fs::copy_file(kFx + "/.debug/fx_dl.debug", d + "/fx_dl.debug");  // next to the file
  fs::copy_file(kFx + "/fx_dl.full", d + "/fx_dl.full");
  EXPECT_EQ(debug_file_for(d + "/fx_dl", o), d + "/fx_dl.debug");
  fs::remove_all(d);
}

TEST(DebugFiles, SymbolsDirMatchedByBuildIdOnly) {
  std::string stage = tmpdir();
  fs::create_directories(stage + "/some/where");
  // Staged under an arbitrary name: found by build-id.
  fs::copy_file(build_id_debug(kFx + "/fx_bid"), stage + "/some/where/anything.bin");
  // A decoy with the name a path-based search would pick.
  fs::copy_file(kFx + "/.debug/fx_dl.debug", stage + "/fx_bid.debug");
  Options o;
  o.symbol_dirs = {stage};
  o.debug_root = "/nonexistent";
  EXPECT_EQ(debug_file_for(kFx + "/fx_bid", o), stage + "/some/where/anything.bin");
  // The staging dir is searched before the debug root.
  o.debug_root = kFx + "/debugroot";
  EXPECT_EQ(debug_file_for(kFx + "/fx_bid", o), stage + "/some/where/anything.bin");
  // Only the decoy: nothing.
  fs::remove(stage + "/some/where/anything.bin");
  o.debug_root = "/nonexistent";
  Symbolizer sym(o);
  EXPECT_EQ(debug_file_for(kFx + "/fx_bid", o), "");
  fs::remove_all(stage);
  expect_matches(kFx + "/fx_bid", kFx + "/fx_bid.full", 0, [&] {
    Options p;
    p.debug_root = kFx + "/debugroot";
    return p;
  }());
}

// ---- live processes ----------------------------------------------------------------

namespace {

struct Child {
  pid_t pid = -1;
  int in_w = -1;  // closing it lets the child exit
  std::vector<std::tuple<uint64_t, int, std::string>> callsites;  // ra, line, function

  ~Child() { stop(); }
  void stop() {
    if (in_w >= 0) ::close(in_w);
    in_w = -1;
    if (pid > 0) {
      int st;
      ::waitpid(pid, &st, 0);
    }
    pid = -1;
  }
};

// Start prog with "wait", read its callsite lines (it then blocks on stdin).
// If ns_dir is set, the child enters a new mount namespace, mounts a tmpfs on
// ns_dir, copies prog there and runs that copy: a file only its namespace sees.
void start(Child& c, const std::string& prog, const std::string& ns_dir = "") {
  int out[2], in[2];
  ASSERT_EQ(::pipe(out), 0);
  ASSERT_EQ(::pipe(in), 0);
  c.pid = ::fork();
  ASSERT_GE(c.pid, 0);
  if (c.pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::close(in[1]);
    ::close(out[0]);
    std::string exe = prog;
    if (!ns_dir.empty()) {
      if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
          ::mount("tmpfs", ns_dir.c_str(), "tmpfs", 0, nullptr) != 0)
        ::_exit(126);
      exe = ns_dir + "/" + fs::path(prog).filename().string();
      std::error_code ec;
      fs::copy_file(prog, exe, ec);
      if (ec) ::_exit(125);
    }
    ::execl(exe.c_str(), exe.c_str(), "wait", nullptr);
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  c.in_w = in[1];
  FILE* f = ::fdopen(out[0], "r");
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) {
    char fn[256];
    unsigned long long ra;
    int line;
    if (std::sscanf(buf, "callsite %llx %d %255s", &ra, &line, fn) == 3) c.callsites.emplace_back(ra, line, fn);
    if (std::string(buf) == "ready\n") break;
  }
  std::fclose(f);
}

// The frame that is not inlined (the function the return address is in).
const Frame* outer(const Symbolized& s) { return s.frames.empty() ? nullptr : &s.frames.back(); }

void expect_callsites(Symbolizer& sym, AddressSpace& as, const Child& c, const std::string& src_suffix) {
  ASSERT_FALSE(c.callsites.empty());
  for (auto& [ra, line, fn] : c.callsites) {
    const Symbolized& s = sym.symbolize(as, ra, /*return_address=*/true);
    ASSERT_EQ(s.unknown, Unknown::None) << to_string(s.unknown) << " at " << std::hex << ra;
    const Frame* f = outer(s);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->function, fn);
    EXPECT_EQ(f->line, line) << fn;
    if (fn != "fxlib_work") EXPECT_TRUE(f->file.ends_with(src_suffix)) << f->file;
    else EXPECT_TRUE(f->file.ends_with("fixture_lib.cpp")) << f->file;
    // Without return_address the lookup is of the instruction after the call:
    // same function; the -1 is what guarantees the call's own line.
    const Symbolized& s2 = sym.symbolize(as, ra, false);
    ASSERT_FALSE(s2.frames.empty());
  }
}

}  // namespace

TEST(LiveProcess, PieWithSharedLibrary) {
  Child c;
  start(c, kFx + "/fx_shared");
  ASSERT_EQ(c.callsites.size(), 2u);
  Symbolizer sym;
  AddressSpace as;
  ASSERT_TRUE(sym.update(as, c.pid).ok());
  EXPECT_EQ(as.pid(), c.pid);
  EXPECT_GT(as.mapping_count(), 3u);
  expect_callsites(sym, as, c, "fixture.cpp");
  // The process exits; the mappings and files stay usable.
  c.stop();
  expect_callsites(sym, as, c, "fixture.cpp");
  EXPECT_FALSE(sym.update(as, c.pid > 0 ? c.pid : 999999).ok() && false);
}

TEST(LiveProcess, FilesParsedOncePerRun) {
  Child a, b;
  start(a, kFx + "/fx_shared");
  start(b, kFx + "/fx_shared");
  Symbolizer sym;
  AddressSpace as1, as2;
  ASSERT_TRUE(sym.update(as1, a.pid).ok());
  size_t opened = sym.stats().files_opened;
  ASSERT_TRUE(sym.update(as2, b.pid).ok());
  ASSERT_TRUE(sym.update(as1, a.pid).ok());  // again: nothing new
  EXPECT_EQ(sym.stats().files_opened, opened) << "second process re-opened files";
  expect_callsites(sym, as1, a, "fixture.cpp");
  expect_callsites(sym, as2, b, "fixture.cpp");
  size_t ml = sym.stats().module_lookups;
  expect_callsites(sym, as1, a, "fixture.cpp");  // memoized
  EXPECT_EQ(sym.stats().module_lookups, ml);
}

TEST(LiveProcess, DeletedBinaryThroughMapFiles) {
  MEMTRACE_REQUIRE_ROOT();
  std::string d = tmpdir();
  fs::copy_file(kFx + "/fx_O2_pie", d + "/prog");
  Child c;
  start(c, d + "/prog");
  fs::remove(d + "/prog");  // deleted while running
  {
    Symbolizer sym;
    AddressSpace as;
    ASSERT_TRUE(sym.update(as, c.pid).ok());
    expect_callsites(sym, as, c, "fixture.cpp");
  }
  {  // without map_files the deleted file is gone
    Options o;
    o.use_map_files = false;
    Symbolizer sym(o);
    AddressSpace as;
    ASSERT_TRUE(sym.update(as, c.pid).ok());
    auto& [ra, line, fn] = c.callsites.back();
    EXPECT_EQ(sym.symbolize(as, ra, true).unknown, Unknown::FileGone);
  }
  c.stop();
  fs::remove_all(d);
}

TEST(LiveProcess, ReplacedBinaryIsNotMisread) {
  std::string d = tmpdir();
  fs::copy_file(kFx + "/fx_O2_pie", d + "/prog");
  Child c;
  start(c, d + "/prog");
  // Replace the file by other code under the same path (new inode).
  fs::remove(d + "/prog");
  fs::copy_file(kFx + "/fx_O0_pie", d + "/prog");
  Options o;
  o.use_map_files = false;
  Symbolizer sym(o);
  AddressSpace as;
  ASSERT_TRUE(sym.update(as, c.pid).ok());
  auto& [ra, line, fn] = c.callsites.back();
  EXPECT_EQ(sym.symbolize(as, ra, true).unknown, Unknown::FileGone);
  c.stop();
  fs::remove_all(d);
}

TEST(LiveProcess, ContainerFileThroughProcRoot) {
  MEMTRACE_REQUIRE_ROOT();
  std::string d = tmpdir();
  Child c;
  start(c, kFx + "/fx_static", d);  // the file exists only in the child's mount namespace
  ASSERT_FALSE(c.callsites.empty());
  ASSERT_FALSE(fs::exists(d + "/fx_static"));
  Options o;
  o.use_map_files = false;  // force /proc/PID/root/PATH
  Symbolizer sym(o);
  AddressSpace as;
  ASSERT_TRUE(sym.update(as, c.pid).ok());
  expect_callsites(sym, as, c, "fixture.cpp");
  c.stop();
  expect_callsites(sym, as, c, "fixture.cpp");  // opened while it lived
  fs::remove_all(d);
}

// ---- mappings, unknowns, hostile files ----------------------------------------------------

TEST(Mappings, ParseMapsLine) {
  MappingInfo m;
  ASSERT_TRUE(memtrace::procfs::parse_maps_line("7f0a1c000000-7f0a1c021000 r-xp 00002000 fe:01 1234567    /usr/lib/x86_64-linux-gnu/libc.so.6 (deleted)", m));
  EXPECT_EQ(m.start, 0x7f0a1c000000u);
  EXPECT_EQ(m.end, 0x7f0a1c021000u);
  EXPECT_EQ(m.offset, 0x2000u);
  EXPECT_EQ(m.inode, 1234567u);
  EXPECT_EQ(m.perms, "r-xp");
  EXPECT_EQ(m.path, "/usr/lib/x86_64-linux-gnu/libc.so.6 (deleted)");
  ASSERT_TRUE(memtrace::procfs::parse_maps_line("ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]", m));
  EXPECT_EQ(m.path, "[vsyscall]");
  ASSERT_TRUE(memtrace::procfs::parse_maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0", m));
  EXPECT_EQ(m.path, "");
  EXPECT_FALSE(memtrace::procfs::parse_maps_line("garbage", m));
  EXPECT_FALSE(memtrace::procfs::parse_maps_line("2000-1000 r-xp 0 0:0 0", m));
  EXPECT_EQ(memtrace::procfs::parse_maps("1000-2000 r-xp 00000000 00:00 0 /a\nbad\n3000-4000 r--p 00000000 00:00 0 /b\n").size(), 2u);
}

TEST(Mappings, NewerMappingShadowsOlderOnlyWhereTheyOverlap) {
  Symbolizer sym;
  AddressSpace as;
  // The same file at two places; then a bogus file over part of the first.
  ASSERT_TRUE(sym.add_file(as, kFx + "/fx_O0_pie", 0x100000000).ok());
  uint64_t a = text_addresses(kFx + "/fx_O0_pie", 10)[5];
  std::string before = sym.symbolize(as, 0x100000000 + a, false).frames.at(0).function;
  MappingInfo m;
  m.start = 0x100000000 + (a & ~0xfffull);
  m.end = m.start + 0x1000;
  m.perms = "r-xp";
  m.path = "/nonexistent";
  sym.add_mapping(as, m, "/nonexistent/file");
  EXPECT_EQ(sym.symbolize(as, 0x100000000 + a, false).unknown, Unknown::FileGone);
  uint64_t other = text_addresses(kFx + "/fx_O0_pie", 10)[9];
  if ((other & ~0xfffull) != (a & ~0xfffull)) {
    EXPECT_EQ(sym.symbolize(as, 0x100000000 + other, false).unknown, Unknown::None);
  }
  EXPECT_FALSE(before.empty());
  EXPECT_EQ(sym.symbolize(as, 0x10, false).unknown, Unknown::Unmapped);
}

TEST(Unknowns, Reasons) {
  Symbolizer sym;
  AddressSpace as;
  MappingInfo m;
  m.start = 0x1000;
  m.end = 0x2000;
  m.path = "/etc/hostname";
  sym.add_mapping(as, m, "/etc/passwd");  // not ELF
  EXPECT_EQ(sym.symbolize(as, 0x1800, false).unknown, Unknown::BadFile);
  EXPECT_EQ(sym.symbolize(as, 0x1800, false).module, "/etc/hostname");
  m.start = 0x3000;
  m.end = 0x4000;
  sym.add_mapping(as, m, "/nonexistent");
  EXPECT_EQ(sym.symbolize(as, 0x3800, false).unknown, Unknown::FileGone);
  EXPECT_EQ(sym.symbolize(as, 0x9000, false).unknown, Unknown::Unmapped);
  EXPECT_STREQ(to_string(Unknown::BadFile), "bad file");
}

TEST(Hostile, TruncatedAndCorruptedFilesNeverCrash) {
  std::string src = kFx + "/fx_O2_pie";
  std::ifstream in(src, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 4096u);
  auto addrs = text_addresses(src, 40);
  std::string d = tmpdir();
  std::mt19937_64 rng(42);
  size_t answered = 0;
  for (int iter = 0; iter < 120; ++iter) {
    std::string b = bytes;
    if (iter < 40) {
      b.resize(static_cast<size_t>(rng() % bytes.size()));  // truncated
    } else {
      int flips = 1 + static_cast<int>(rng() % 64);  // corrupted (headers often)
      for (int k = 0; k < flips; ++k) {
        size_t pos = (iter % 2) ? rng() % std::min<size_t>(b.size(), 4096) : rng() % b.size();
        b[pos] = static_cast<char>(rng());
      }
    }
    std::string p = d + "/f" + std::to_string(iter);
    std::ofstream(p, std::ios::binary) << b;
    Symbolizer sym;
    AddressSpace as;
    (void)sym.add_file(as, p, 0);
    MappingInfo m;
    m.start = 0x10000000;
    m.end = m.start + bytes.size() + 0x1000;
    m.path = p;
    sym.add_mapping(as, m, p);
    for (auto a : addrs) {
      (void)sym.symbolize(as, a, true);
      (void)sym.symbolize(as, m.start + a, false);
      ++answered;
    }
    fs::remove(p);
  }
  EXPECT_EQ(answered, 120u * addrs.size());
  fs::remove_all(d);
}

// ---- stripped binaries, MiniDebugInfo ------------------------------------------

namespace {
// Every .text address of `file` (loaded at bias 0, ELF symbols only): our
// function name, "??" when unknown (checking that an unknown frame still says
// where it is: its module and file offset).
std::map<uint64_t, std::string> names_of(const std::string& file, const std::vector<uint64_t>& addrs,
                                         size_t* unknown = nullptr) {
  Options o;
  o.dwarf = false;
  o.debug_root = "/nonexistent";
  Symbolizer sym(o);
  AddressSpace as;
  EXPECT_TRUE(sym.add_file(as, file, 0).ok()) << file;
  std::map<uint64_t, std::string> out;
  for (uint64_t a : addrs) {
    const Symbolized& s = sym.symbolize(as, a, false);
    if (s.unknown != Unknown::None) {
      EXPECT_EQ(s.unknown, Unknown::NoSymbols) << std::hex << a;
      EXPECT_EQ(s.module, file);
      EXPECT_EQ(s.module_offset, a) << "file offset of a .text address (text is at offset == vaddr)";
      if (unknown) ++*unknown;
      out[a] = "??";
    } else {
      EXPECT_EQ(s.frames.size(), 1u);
      out[a] = s.frames.front().function;
    }
  }
  return out;
}
}  // namespace

// A stripped binary names an address only where a .dynsym symbol covers it by
// its size; elsewhere (static functions) it is unknown, as eu-addr2line says,
// never "export+0x1234". Debian's git (stripped, scripts/deps.txt) is issue
// 18's case: "error+0x6228" where error is 188 bytes long.
TEST(Stripped, AddressOutsideEverySymbolIsUnknown) {
  std::string d = tmpdir();
  if (!fs::exists("/usr/bin/git")) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/git (scripts/deps.txt)");
  for (std::string src : {kFx + "/libfxlib.so", std::string("/usr/bin/git")}) {
    std::string stripped = d + "/" + fs::path(src).filename().string() + ".stripped";
    ASSERT_EQ(std::system(("strip --strip-all -o '" + stripped + "' '" + src + "'").c_str()), 0);
    auto addrs = text_addresses(src, 800);
    size_t unknown = 0;
    auto ours = names_of(stripped, addrs, &unknown);
    auto eu = oracle("eu-addr2line", stripped, addrs);
    // Addresses past the end of the exported function before them: what a
    // nearest-symbol lookup would name wrongly.
    std::map<uint64_t, uint64_t> dyn;  // start -> end
    for (auto& l : lines(memtrace::testing::shell_output("nm -D -S --defined-only '" + stripped + "' | awk '$3 ~ /[Tt]/ {print $1, $2}'"))) {
      std::istringstream in(l);
      std::string a, z;
      if (in >> a >> z) dyn[std::stoull(a, nullptr, 16)] = std::stoull(a, nullptr, 16) + std::stoull(z, nullptr, 16);
    }
    size_t named = 0, past_end = 0;
    for (uint64_t a : addrs) {
      std::string ref = eu[a].empty() ? "?" : eu[a][0].function;
      EXPECT_EQ(ours[a], ref) << src << std::hex << " at 0x" << a;
      named += ours[a] != "??";
      auto it = dyn.upper_bound(a);
      past_end += it != dyn.begin() && a >= std::prev(it)->second;
    }
    EXPECT_GT(unknown, 20u) << src << ": the fixture has static functions";
    EXPECT_GT(past_end, 0u) << src << ": some addresses lie past an exported function";
    std::printf("[ stripped ] %s: %zu addresses, %zu named by .dynsym, %zu unknown (%zu past an exported function's end)\n",
                stripped.c_str(), addrs.size(), named, unknown, past_end);
  }
  fs::remove_all(d);
}

// .gnu_debugdata made as Fedora makes it: every function named as with the
// full .symtab (same name, same offset), names .dynsym lacks included.
TEST(MiniDebugInfo, SymbolsAsFromTheFullSymtab) {
  std::string d = tmpdir();
  for (std::string src : {kFx + "/libfxlib.so", kFx + "/fx_O2_pie"}) {
    std::string mini = d + "/" + fs::path(src).filename().string() + ".mini";
    ASSERT_EQ(std::system((std::string(FX_SRC_DIR) + "/make_minidebuginfo.sh '" + src + "' '" + mini + "'").c_str()), 0);
    ASSERT_EQ(memtrace::testing::shell_output("readelf -S '" + mini + "' | grep -c '\\.symtab'"), "0\n") << "stripped";
    auto addrs = text_addresses(src);
    size_t unknown_full = 0, unknown_mini = 0;
    auto full = names_of(src, addrs, &unknown_full);
    auto got = names_of(mini, addrs, &unknown_mini);
    EXPECT_EQ(got, full) << src;
    EXPECT_EQ(unknown_mini, unknown_full);
    // Independently: elfutils reads .gnu_debugdata too.
    auto eu = oracle("eu-addr2line", mini, addrs);
    size_t checked = 0;
    for (uint64_t a : addrs)
      if (!eu[a].empty() && eu[a][0].function != "??") {
        EXPECT_EQ(got[a], eu[a][0].function) << std::hex << "0x" << a;
        ++checked;
      }
    EXPECT_GT(checked, addrs.size() / 2);
  }
  // A static function that only MiniDebugInfo names.
  Options o;
  o.debug_root = "/nonexistent";
  Symbolizer sym(o);
  AddressSpace as;
  ASSERT_TRUE(sym.add_file(as, d + "/libfxlib.so.mini", 0).ok());
  auto apply = memtrace::testing::shell_output("nm '" + kFx + "/libfxlib.so' | awk '/apply/ {print $1}'");
  ASSERT_FALSE(apply.empty());
  const Symbolized& s = sym.symbolize(as, std::stoull(apply, nullptr, 16) + 4, false);
  ASSERT_EQ(s.unknown, Unknown::None);
  EXPECT_EQ(s.frames.front().function,
            "int fxlib::apply<fxlib_work::{lambda(int)#1}>(fxlib_work::{lambda(int)#1}, int) [clone .constprop.0]");
  EXPECT_EQ(s.frames.front().offset, 4u);
  fs::remove_all(d);
}

// A .gnu_debugdata that is not xz, or is truncated: only its names are lost.
TEST(MiniDebugInfo, BadSectionLosesOnlyItsNames) {
  std::string d = tmpdir();
  std::string src = kFx + "/libfxlib.so", mini = d + "/mini.so";
  ASSERT_EQ(std::system((std::string(FX_SRC_DIR) + "/make_minidebuginfo.sh '" + src + "' '" + mini + "'").c_str()), 0);
  auto addrs = text_addresses(src);
  std::string stripped = d + "/stripped.so";
  ASSERT_EQ(std::system(("strip --strip-all -o '" + stripped + "' '" + src + "'").c_str()), 0);
  auto want = names_of(stripped, addrs);
  std::ofstream(d + "/junk", std::ios::binary) << std::string(4096, 'x');
  std::string xz = d + "/dd.xz", trunc = d + "/dd.trunc";
  ASSERT_EQ(std::system(("objcopy --dump-section .gnu_debugdata='" + xz + "' '" + mini + "'").c_str()), 0);
  fs::copy_file(xz, trunc);
  fs::resize_file(trunc, fs::file_size(xz) / 2);
  for (std::string bad : {d + "/junk", trunc}) {
    std::string f = d + "/bad.so";
    fs::remove(f);
    ASSERT_EQ(std::system(("objcopy --update-section .gnu_debugdata='" + bad + "' '" + mini + "' '" + f + "'").c_str()), 0);
    EXPECT_EQ(names_of(f, addrs), want) << bad;
  }
  fs::remove_all(d);
}

// follows_call (call_site.h), on every call instruction of a real libc as
// objdump decodes it: each address after one is a possible return address;
// a function's first byte (what a frame-pointer walk through code without
// frame pointers reads when a function pointer sits where it looks) almost
// never is. Also the signal return trampoline, where a handler "returns".
namespace {
void expect_calls_recognized(const std::string& objdump, const std::string& lib,
                             const std::vector<std::string>& call_mnemonics) {
  if (access(lib.c_str(), R_OK) != 0) MEMTRACE_SKIP_OR_FAIL(lib + " missing (scripts/deps.txt installs it)");
  Symbolizer sym;
  AddressSpace as;
  ASSERT_TRUE(sym.add_file(as, lib, 0));
  std::istringstream dis(memtrace::testing::shell_output(objdump + " -d -w " + lib));
  std::string line;
  size_t calls = 0, missed = 0, starts = 0, taken = 0;
  std::string missed_lines;
  // "addr:\tbytes \tmnemonic operands": x86 bytes one by one, aarch64's as words
  std::regex insn(R"(^\s*([0-9a-f]+):\t((?:[0-9a-f]{2,8} )+)\s*\t(\S+)(?:[ \t]+(\S+))?)");
  std::regex start(R"(^([0-9a-f]+) <([^>]+)>:$)");
  std::smatch m;
  while (std::getline(dis, line)) {
    if (std::regex_search(line, m, start)) {
      uint64_t a = std::stoull(m[1], nullptr, 16);
      starts++;
      taken += sym.follows_call(as, a);
      continue;
    }
    if (!std::regex_search(line, m, insn)) continue;
    std::string mn = m[3];
    if ((mn == "notrack" || mn == "bnd" || mn == "addr32") && m[4].matched) mn = m[4];
    if (std::find(call_mnemonics.begin(), call_mnemonics.end(), mn) == call_mnemonics.end()) continue;
    std::string hexes = m[2];
    std::erase(hexes, ' ');
    uint64_t a = std::stoull(m[1], nullptr, 16) + hexes.size() / 2;
    calls++;
    if (!sym.follows_call(as, a)) {
      missed++;
      if (missed < 5) missed_lines += line + "\n";
    }
  }
  ASSERT_GT(calls, 1000u) << objdump << " " << lib;
  EXPECT_EQ(missed, 0u) << "of " << calls << " calls:\n" << missed_lines;
  ASSERT_GT(starts, 1000u);
  std::cerr << lib << ": " << calls << " calls, " << taken << " of " << starts << " function starts taken\n";
  EXPECT_LT(taken * 100, starts * 15) << taken << " of " << starts << " function starts taken for return addresses";
}
}  // namespace

TEST(FollowsCall, EveryCallOfLibcX86_64) {
  expect_calls_recognized("objdump", "/usr/lib/x86_64-linux-gnu/libc.so.6", {"call"});
  Symbolizer sym;
  AddressSpace as;
  ASSERT_TRUE(sym.add_file(as, "/usr/lib/x86_64-linux-gnu/libc.so.6", 0));
  EXPECT_FALSE(sym.follows_call(as, 0x10)) << "the ELF header";
  EXPECT_FALSE(sym.follows_call(as, 0x7ff000000000)) << "no mapping";
}

TEST(FollowsCall, EveryCallOfLibcAarch64) {
  if (access("/usr/bin/aarch64-linux-gnu-objdump", X_OK) != 0)
    MEMTRACE_SKIP_OR_FAIL("aarch64-linux-gnu-objdump missing (scripts/deps.txt installs binutils-aarch64-linux-gnu)");
  expect_calls_recognized("aarch64-linux-gnu-objdump", "/usr/aarch64-linux-gnu/lib/libc.so.6",
                          {"bl", "blr", "blraa", "blrab", "blraaz", "blrabz"});
}

TEST(FollowsCall, SignalReturnTrampolines) {
  const std::string x86 = std::string("\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05", 9);
  EXPECT_TRUE(follows_call("\x90\x90\x90\x90\x90\x90\x90\x90", x86, EM_X86_64));
  EXPECT_FALSE(follows_call("\x90\x90\x90\x90\x90\x90\x90\x90", "\x90\x90\x90\x90\x90\x90\x90\x90\x90", EM_X86_64));
  const std::string a64 = std::string("\x68\x11\x80\xd2\x01\x00\x00\xd4", 8);
  EXPECT_TRUE(follows_call(std::string("\x1f\x20\x03\xd5", 4), a64, EM_AARCH64));
  EXPECT_FALSE(follows_call(std::string("\x1f\x20\x03\xd5", 4), std::string("\x1f\x20\x03\xd5", 4), EM_AARCH64));
  // call *0x8(%rsp) (ff 54 24 08), call *%r11 (41 ff d3), call *0x2f37(%rip) (ff 15 ...), notrack call *%rax
  EXPECT_TRUE(follows_call(std::string("\x90\x90\x90\x90\xff\x54\x24\x08", 8), "", EM_X86_64));
  EXPECT_TRUE(follows_call(std::string("\x90\x90\x90\x90\x90\x41\xff\xd3", 8), "", EM_X86_64));
  EXPECT_TRUE(follows_call(std::string("\x90\x90\xff\x15\x37\x2f\x00\x00", 8), "", EM_X86_64));
  EXPECT_TRUE(follows_call(std::string("\x90\x90\x90\x90\x90\x3e\xff\xd0", 8), "", EM_X86_64));
  // jmp *%rax (ff e0: /4) is no call
  EXPECT_FALSE(follows_call(std::string("\x90\x90\x90\x90\x90\x90\xff\xe0", 8), "", EM_X86_64));
}
