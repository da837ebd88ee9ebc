// Allocator detection on the real libraries of this machine (glibc always;
// jemalloc, tcmalloc, mimalloc when their Debian packages are installed, see
// scripts/deps.txt).
#include <gtest/gtest.h>
#include <unistd.h>

#include <set>

#include "elf/elf_file.h"
#include "probes/allocators.h"
#include "test_env.h"

using namespace memtrace::probes;
using memtrace::elf::ElfFile;

namespace {

const KernelCaps k618 = KernelCaps::for_version(6, 18);

std::optional<ElfFile> open_lib(const std::string& path) {
  if (access(path.c_str(), R_OK) != 0) return std::nullopt;
  auto e = ElfFile::open(path);
  if (!e) return std::nullopt;
  return std::move(*e);
}

DetectOptions opts(std::optional<std::string> prefix = std::nullopt) {
  DetectOptions o;
  o.symbol_prefix = std::move(prefix);
  o.caps = k618;
  return o;
}

// Every placement of an allocator is on an instruction the kernel emulates, or at 0.
void expect_sane(const Allocator& a) {
  for (const auto& s : a.symbols) {
    SCOPED_TRACE(s.symbol + " " + describe(s.placement));
    if (s.placement.offset > 0) {
      EXPECT_TRUE(s.placement.emulated);
    }
    if (s.size) {
      EXPECT_LT(s.placement.offset, s.size);
    }
  }
}

}  // namespace

TEST(Allocators, RoleNamesMatchTheBpfContract) {
  EXPECT_STREQ(role_name(Role::kMalloc), "malloc");
  EXPECT_STREQ(role_name(Role::kFree), "free");
  EXPECT_STREQ(role_name(Role::kPvalloc), "pvalloc");
  EXPECT_STREQ(role_name(Role::kAlignedNew), "aligned_new");
  EXPECT_EQ(static_cast<int>(Role::kCount), 15);
  EXPECT_FALSE(has_return_probe(Role::kFree));
  EXPECT_FALSE(has_return_probe(Role::kAlignedNew));
  EXPECT_TRUE(has_return_probe(Role::kReallocarray));
  EXPECT_EQ(needs_for(Role::kPosixMemalign).arg_mask, 0x5u);
}

TEST(Allocators, Glibc) {
  auto e = open_lib("/lib/x86_64-linux-gnu/libc.so.6");
  if (!e) MEMTRACE_SKIP_OR_FAIL("no glibc");
  EXPECT_EQ(detect_family(*e), Family::kGlibc);
  auto a = find_allocator_symbols(*e, opts());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->prefix, "");
  EXPECT_EQ(a->symbols.size(), 10u);
  ASSERT_TRUE(a->find(Role::kMemalign));
  EXPECT_EQ(a->find(Role::kMemalign)->alias_of, "aligned_alloc");
  int aliases = 0;
  for (const auto& s : a->symbols) aliases += !s.alias_of.empty();
  EXPECT_EQ(aliases, 1);
  expect_sane(*a);
  std::string text = explain(*a, "/lib/x86_64-linux-gnu/libc.so.6");
  EXPECT_NE(text.find("glibc allocator"), std::string::npos) << text;
  EXPECT_NE(text.find("memalign: alias of aligned_alloc"), std::string::npos) << text;
}

TEST(Allocators, GlibcWithAWrongPrefixFindsNothing) {
  auto e = open_lib("/lib/x86_64-linux-gnu/libc.so.6");
  if (!e) MEMTRACE_SKIP_OR_FAIL("no glibc");
  EXPECT_FALSE(find_allocator_symbols(*e, opts("je_")));
  // __libc_ prefix: glibc's own internal names (malloc, free, calloc, realloc, memalign, valloc, pvalloc).
  auto a = find_allocator_symbols(*e, opts("__libc_"));
  ASSERT_TRUE(a);
  EXPECT_EQ(a->find(Role::kMalloc)->symbol, "__libc_malloc");
}

TEST(Allocators, NotAnAllocator) {
  auto e = open_lib("/lib/x86_64-linux-gnu/libm.so.6");
  if (!e) MEMTRACE_SKIP_OR_FAIL("no libm");
  EXPECT_EQ(detect_family(*e), Family::kNone);
  EXPECT_FALSE(find_allocator_symbols(*e, opts()));
}

TEST(Allocators, Jemalloc) {
  auto e = open_lib("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
  if (!e) MEMTRACE_SKIP_OR_FAIL("libjemalloc2 not installed (scripts/deps.txt)");
  EXPECT_EQ(detect_family(*e), Family::kJemalloc);
  auto a = find_allocator_symbols(*e, opts());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->family, Family::kJemalloc);
  EXPECT_TRUE(a->find(Role::kMalloc));
  EXPECT_TRUE(a->find(Role::kFree));
  EXPECT_TRUE(a->find(Role::kCalloc));
  EXPECT_TRUE(a->find(Role::kAlignedAlloc));
  expect_sane(*a);
  // Its own aligned operator new passes the size on unchanged: no C++ probes.
  EXPECT_TRUE(e->find_function("_ZnwmSt11align_val_t"));
  EXPECT_FALSE(find_cxx_aligned_new(*e, opts()));
}

TEST(Allocators, Tcmalloc) {
  auto e = open_lib("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4");
  if (!e) MEMTRACE_SKIP_OR_FAIL("libtcmalloc-minimal4 not installed (scripts/deps.txt)");
  EXPECT_EQ(detect_family(*e), Family::kTcmalloc);
  auto a = find_allocator_symbols(*e, opts());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->prefix, "");  // plain names are exported (aliases of tc_*)
  // aligned_alloc and memalign are one function in tcmalloc.
  ASSERT_TRUE(a->find(Role::kMemalign));
  EXPECT_EQ(a->find(Role::kMemalign)->alias_of, "aligned_alloc");
  expect_sane(*a);
  // -S tc_: the prefixed names.
  auto t = find_allocator_symbols(*e, opts("tc_"));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->find(Role::kMalloc)->symbol, "tc_malloc");
  EXPECT_EQ(t->find(Role::kMalloc)->vaddr, a->find(Role::kMalloc)->vaddr);
  EXPECT_FALSE(find_cxx_aligned_new(*e, opts()));
}

TEST(Allocators, Mimalloc) {
  auto e = open_lib("/usr/lib/x86_64-linux-gnu/libmimalloc.so.2");
  if (!e) MEMTRACE_SKIP_OR_FAIL("libmimalloc2.0 not installed (scripts/deps.txt)");
  EXPECT_EQ(detect_family(*e), Family::kMimalloc);
  auto a = find_allocator_symbols(*e, opts());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->symbols.size(), 10u);
  expect_sane(*a);
  auto m = find_allocator_symbols(*e, opts("mi_"));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->find(Role::kFree)->symbol, "mi_free");
  expect_sane(*m);
  EXPECT_FALSE(find_cxx_aligned_new(*e, opts()));
}

// libstdc++ is no allocator, but its aligned operator new rounds the size up
// before aligned_alloc: its four forms get entry probes, on instructions the
// kernel emulates (endbr64 is not one).
TEST(Allocators, LibstdcxxAlignedNew) {
  auto e = open_lib("/usr/lib/x86_64-linux-gnu/libstdc++.so.6");
  if (!e) MEMTRACE_SKIP_OR_FAIL("no libstdc++");
  EXPECT_FALSE(find_allocator_symbols(*e, opts()));
  EXPECT_TRUE(e->imports("aligned_alloc"));
  auto a = find_cxx_aligned_new(*e, opts());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->family, Family::kCxx);
  std::set<std::string> names;
  for (const auto& s : a->symbols) {
    EXPECT_EQ(s.role, Role::kAlignedNew);
    EXPECT_TRUE(s.alias_of.empty()) << s.symbol;
    names.insert(s.symbol);
  }
  EXPECT_EQ(names, (std::set<std::string>{"_ZnwmSt11align_val_t", "_ZnamSt11align_val_t",
                                          "_ZnwmSt11align_val_tRKSt9nothrow_t",
                                          "_ZnamSt11align_val_tRKSt9nothrow_t"}));
  expect_sane(*a);
  for (const auto& s : a->symbols) EXPECT_GT(s.placement.offset, 0u) << s.symbol << describe(s.placement);
  std::string text = explain(*a, "/usr/lib/x86_64-linux-gnu/libstdc++.so.6");
  EXPECT_NE(text.find("C++ aligned operator new"), std::string::npos) << text;
  EXPECT_NE(text.find("aligned_new  _ZnwmSt11align_val_t"), std::string::npos) << text;
  // glibc has no operator new.
  auto c = open_lib("/lib/x86_64-linux-gnu/libc.so.6");
  ASSERT_TRUE(c);
  EXPECT_FALSE(find_cxx_aligned_new(*c, opts()));
}

// LLVM 14's libc++abi (Debian 12; it defines libc++'s operator new) calls
// posix_memalign with the size unchanged: nothing to probe there.
TEST(Allocators, LibcxxabiAlignedNewDoesNotRound) {
  auto e = open_lib("/usr/lib/llvm-14/lib/libc++abi.so.1");
  if (!e) MEMTRACE_SKIP_OR_FAIL("libc++abi1-14 not installed (scripts/deps.txt)");
  ASSERT_TRUE(e->find_function("_ZnwmSt11align_val_t"));
  EXPECT_TRUE(e->imports("posix_memalign"));
  std::string why;
  EXPECT_FALSE(find_cxx_aligned_new(*e, opts(), &why));
  EXPECT_NE(why.find("aligned_alloc"), std::string::npos) << why;
}

TEST(Allocators, IncomingBranchScanFindsCallsIntoTheMiddle) {
  auto e = open_lib("/lib/x86_64-linux-gnu/libc.so.6");
  if (!e) MEMTRACE_SKIP_OR_FAIL("no glibc");
  auto m = e->find_function("malloc");
  ASSERT_TRUE(m);
  // objdump shows valloc/memalign jumping to __libc_malloc+0x320 (_mid_memalign,
  // just past malloc's 0x317 bytes).
  auto t = incoming_branch_targets(*e, m->vaddr, 0x400);
  EXPECT_NE(std::find(t.begin(), t.end(), 0x320u), t.end());
}
