// elf::Image, the one ELF reader, and what is built on it (elf::ElfFile, the
// loader's view; the CFI tables), against binutils on real files: the
// build-id readelf -n prints, the PT_LOAD rows of readelf -l, the symbols of
// readelf -s; a stripped binary, a .gnu_debugdata-only file, and truncated
// copies, which give an error or an image that claims nothing past its end.
#include <elf.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/hex.h"
#include "elf/elf_file.h"
#include "elf/image.h"
#include "shell.h"
#include "unwind/cfi_table.h"

namespace fs = std::filesystem;
using memtrace::elf::ElfFile;
using memtrace::elf::Image;
using memtrace::testing::shell_output;

namespace {

const std::string kLibc = "/lib/x86_64-linux-gnu/libc.so.6";
const std::string kGit = "/usr/bin/git";  // stripped: .dynsym only

std::string q(const std::string& s) { return "'" + s + "'"; }

std::string first_line(std::string s) { return s.substr(0, s.find('\n')); }

std::string readelf_build_id(const std::string& path) {
  return first_line(shell_output("readelf -n " + q(path) + " | awk '/Build ID/ {print $3; exit}'"));
}

// (vaddr, memsz, offset, filesz, flags, align) of every PT_LOAD.
using SegRow = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint32_t, uint64_t>;

std::vector<SegRow> readelf_loads(const std::string& path) {
  std::vector<SegRow> out;
  std::istringstream in(shell_output("readelf -lW " + q(path)));
  for (std::string line; std::getline(in, line);) {
    std::istringstream l(line);
    std::string type, off, va, pa, filesz, memsz;
    if (!(l >> type) || type != "LOAD") continue;
    l >> off >> va >> pa >> filesz >> memsz;
    std::vector<std::string> rest;
    for (std::string t; l >> t;) rest.push_back(t);
    uint32_t flags = 0;
    for (size_t i = 0; i + 1 < rest.size(); i++)
      for (char c : rest[i]) flags |= c == 'R' ? PF_R : c == 'W' ? PF_W : c == 'E' ? PF_X : 0;
    auto h = [](const std::string& s) { return std::stoull(s, nullptr, 16); };
    out.emplace_back(h(va), h(memsz), h(off), h(filesz), flags, rest.empty() ? 0 : h(rest.back()));
  }
  return out;
}

std::vector<SegRow> rows_of(const std::vector<memtrace::elf::Segment>& segs) {
  std::vector<SegRow> out;
  for (const auto& s : segs) out.emplace_back(s.vaddr, s.memsz, s.offset, s.filesz, s.flags, s.align);
  return out;
}

// (dynamic, name without "@VERSION", value, size, type)
using SymRow = std::tuple<bool, std::string, uint64_t, uint64_t, int>;

struct ReadelfSymbols {
  std::multiset<SymRow> defined;  // functions, ifuncs, objects, TLS with a value
  std::set<std::string> imported;  // undefined .dynsym names
};

ReadelfSymbols readelf_symbols(const std::string& path) {
  static const std::map<std::string, int> kTypes = {
      {"FUNC", STT_FUNC}, {"IFUNC", STT_GNU_IFUNC}, {"OBJECT", STT_OBJECT}, {"TLS", STT_TLS}};
  ReadelfSymbols r;
  std::istringstream in(shell_output("readelf -sW " + q(path)));
  bool dynamic = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Symbol table '", 0) == 0) {
      dynamic = line.find("'.dynsym'") != std::string::npos;
      continue;
    }
    std::istringstream l(line);
    std::string num, value, size, type, bind, vis, ndx, name;
    if (!(l >> num >> value >> size >> type >> bind >> vis >> ndx >> name) || !std::isdigit(num[0])) continue;
    name = name.substr(0, name.find('@'));
    if (ndx == "UND") {
      if (dynamic && !name.empty()) r.imported.insert(name);
      continue;
    }
    uint64_t v = std::stoull(value, nullptr, 16);
    auto t = kTypes.find(type);
    if (v == 0 || t == kTypes.end() || name.empty()) continue;
    r.defined.emplace(dynamic, name, v, std::stoull(size, nullptr, 0), t->second);
  }
  return r;
}

// The one reader and the views on it agree with binutils on path.
void check_against_binutils(const std::string& path) {
  SCOPED_TRACE(path);
  auto img = Image::open(path);
  ASSERT_TRUE(img.ok()) << img.error().message;
  std::string bid = readelf_build_id(path);
  ASSERT_EQ(bid.size(), 40u) << "readelf -n";
  EXPECT_EQ((*img)->build_id_hex(), bid);
  EXPECT_EQ((*img)->build_id().size(), 20u);
  auto loads = readelf_loads(path);
  ASSERT_FALSE(loads.empty());
  EXPECT_EQ(rows_of((*img)->segments()), loads);

  auto f = ElfFile::open(path);
  ASSERT_TRUE(f.ok()) << f.error().message;
  EXPECT_EQ(f->build_id(), bid);
  EXPECT_EQ(rows_of(f->segments()), loads);
  ReadelfSymbols want = readelf_symbols(path);
  std::multiset<SymRow> got;
  for (const auto& s : f->symbols()) {
    got.emplace(s.dynamic, s.name, s.vaddr, s.size, s.type);
    auto off = f->vaddr_to_offset(s.vaddr);
    EXPECT_EQ(s.file_offset, off.value_or(0)) << s.name;
  }
  EXPECT_EQ(got, want.defined);
  for (const auto& n : want.imported) EXPECT_TRUE(f->imports(n)) << n;
  EXPECT_FALSE(f->imports("memtrace_no_such_symbol"));

  // The CFI tables name the file by the same build-id and segments.
  auto cfi = memtrace::unwind::build_cfi_table(path);
  ASSERT_TRUE(cfi.ok()) << cfi.error().message;
  EXPECT_EQ(cfi->build_id, bid);
  EXPECT_EQ(rows_of(cfi->segments), loads);
}

// A function's bytes as the loader reads them are the file's bytes there.
void check_code_bytes(const std::string& path, const std::string& func) {
  auto f = ElfFile::open(path);
  ASSERT_TRUE(f.ok());
  auto s = f->find_function(func);
  ASSERT_TRUE(s) << func;
  auto got = f->read_vaddr(s->vaddr, 32);
  ASSERT_EQ(got.size(), 32u);
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(s->file_offset));
  std::vector<uint8_t> want(32);
  in.read(reinterpret_cast<char*>(want.data()), 32);
  EXPECT_EQ(got, want);
}

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/elf_image_test.XXXXXX";
    path = mkdtemp(t) ? t : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST(ElfImage, LibcAsBinutilsSeesIt) {
  check_against_binutils(kLibc);
  check_code_bytes(kLibc, "malloc");
  auto f = ElfFile::open(kLibc);
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->has_symtab());
  EXPECT_EQ(f->type(), ET_DYN);
  auto m = f->find_function("malloc");
  ASSERT_TRUE(m);
  EXPECT_TRUE(m->dynamic);
  EXPECT_FALSE(f->find_object("malloc"));
  EXPECT_TRUE(f->find_object("stdout"));
}

TEST(ElfImage, StrippedBinaryAsBinutilsSeesIt) {
  check_against_binutils(kGit);
  auto img = Image::open(kGit);
  ASSERT_TRUE(img.ok());
  EXPECT_FALSE((*img)->has_symtab());
  EXPECT_FALSE((*img)->has_dwarf());
  EXPECT_TRUE((*img)->debuglink().has_value()) << "Debian's stripped binaries name their .debug file";
}

// A fixture with .symtab and DWARF, then the same stripped with only a
// .gnu_debugdata section (made as Fedora makes it): same build-id and
// segments; the static function's name comes from the embedded image.
TEST(ElfImage, FixtureAndItsMiniDebugInfo) {
  check_against_binutils(ELF_FIXTURE);
  check_code_bytes(ELF_FIXTURE, "elf_fixture_exported");
  auto full = ElfFile::open(ELF_FIXTURE);
  ASSERT_TRUE(full.ok());
  EXPECT_TRUE(full->has_symtab());
  EXPECT_TRUE(full->image().has_dwarf());
  EXPECT_TRUE(full->imports("aligned_alloc"));
  auto stat = full->find_function("elf_fixture_static");
  ASSERT_TRUE(stat);
  EXPECT_EQ(stat->bind, STB_LOCAL);
  EXPECT_TRUE(full->find_object("elf_fixture_counter"));

  TempDir d;
  ASSERT_FALSE(d.path.empty());
  std::string mini = d.path + "/mini.so";
  ASSERT_EQ(std::system((std::string(MAKE_MINIDEBUGINFO) + " " + q(ELF_FIXTURE) + " " + q(mini)).c_str()), 0);
  check_against_binutils(mini);
  auto img = Image::open(mini);
  ASSERT_TRUE(img.ok());
  EXPECT_EQ((*img)->build_id_hex(), full->build_id());
  EXPECT_EQ(rows_of((*img)->segments()), rows_of(full->segments()));
  EXPECT_FALSE((*img)->has_symtab());
  std::string xz = d.path + "/dd.xz";
  ASSERT_EQ(std::system(("objcopy --dump-section .gnu_debugdata=" + q(xz) + " " + q(mini)).c_str()), 0);
  EXPECT_EQ(std::string((*img)->gnu_debugdata()), slurp(xz));
  ASSERT_EQ(std::system(("xz -d " + q(xz)).c_str()), 0);
  auto embedded = Image::from_memory(slurp(d.path + "/dd"), "embedded");
  ASSERT_TRUE(embedded.ok()) << embedded.error().message;
  EXPECT_TRUE((*embedded)->has_symtab());
  bool named = false;
  (*embedded)->for_each_symbol(true, false, [&](const memtrace::elf::SymbolRecord& s) {
    if (s.name == "elf_fixture_static") {
      named = true;
      EXPECT_EQ(s.value, stat->vaddr);
      EXPECT_EQ(s.type, STT_FUNC);
    }
  });
  EXPECT_TRUE(named);
}

// Truncated copies of libc, read from a file and from memory: a clean error,
// or an image whose segments and bytes all lie inside what is left.
TEST(ElfImage, TruncatedCopiesAreCleanErrors) {
  TempDir d;
  ASSERT_FALSE(d.path.empty());
  std::string whole = slurp(kLibc);
  ASSERT_GT(whole.size(), 1u << 20);
  size_t opened = 0;
  for (size_t n : {size_t{0}, size_t{3}, size_t{63}, size_t{64}, size_t{1000}, size_t{4096}, size_t{300000},
                   whole.size() / 2, whole.size() - 4096, whole.size() - 1}) {
    SCOPED_TRACE(n);
    std::string path = d.path + "/libc." + std::to_string(n);
    std::ofstream(path, std::ios::binary).write(whole.data(), static_cast<std::streamsize>(n));
    for (int from_memory = 0; from_memory < 2; from_memory++) {
      auto img = from_memory ? Image::from_memory(whole.substr(0, n), path) : Image::open(path);
      if (!img) {
        EXPECT_NE(img.error().message.find(path), std::string::npos) << img.error().message;
        continue;
      }
      opened++;
      EXPECT_EQ((*img)->file_size(), n);
      for (const auto& s : (*img)->segments()) {
        EXPECT_LE(s.offset + s.filesz, n);
        EXPECT_EQ((*img)->bytes(s.offset, s.filesz).size(), s.filesz);
      }
      EXPECT_LE((*img)->bytes(0, UINT64_MAX).size(), n);
      EXPECT_TRUE((*img)->bytes(n, 16).empty());
      size_t count = 0;
      (*img)->for_each_symbol(true, true, [&](const memtrace::elf::SymbolRecord&) { count++; });
      (void)(*img)->compressed_sections_sane();
      (void)(*img)->offset_to_vaddr(0x1000);
    }
    // The loader's view and the CFI tables on the same file.
    if (auto f = ElfFile::open(path)) {
      for (const char* name : {"malloc", "free", "calloc"}) {
        if (auto s = f->find_function(name)) {
          EXPECT_LE(f->read_vaddr(s->vaddr, 64).size(), 64u);
        }
      }
      (void)f->symbols().size();
    }
    (void)memtrace::unwind::build_cfi_table(path);
  }
  EXPECT_GT(opened, 0u) << "the longer copies still have their ELF header";
  auto none = Image::open(d.path + "/libc.0");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("not an ELF file"), std::string::npos) << none.error().message;
  auto gone = Image::open(d.path + "/no-such-file");
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.error().message.find("No such file"), std::string::npos) << gone.error().message;
}

// One parser of notes: the same build-id from the file, its bytes in memory,
// the loader's view and the CFI tables.
TEST(ElfImage, OneBuildIdEverywhere) {
  auto img = Image::open(kLibc);
  ASSERT_TRUE(img.ok());
  auto mem = Image::from_memory(slurp(kLibc), "libc in memory");
  ASSERT_TRUE(mem.ok());
  EXPECT_EQ((*mem)->build_id(), (*img)->build_id());
  EXPECT_EQ(rows_of((*mem)->segments()), rows_of((*img)->segments()));
  EXPECT_EQ((*mem)->fd(), -1);
  EXPECT_EQ(memtrace::hex_bytes((*img)->build_id()), (*img)->build_id_hex());
  EXPECT_EQ(memtrace::hex_bytes(std::string("\x01\xab\xff", 3)), "01abff");
}
