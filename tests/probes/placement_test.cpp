// Probe placement: hand-written byte sequences (each rule of the kernel's
// x86 uprobe emulation and of the entry-path walk) and the real glibc 2.36
// entry points of this machine.
#include <gtest/gtest.h>

#include <map>

#include "elf/elf_file.h"
#include "probes/allocators.h"
#include "probes/probe_placement.h"
#include "test_env.h"

using namespace memtrace::probes;
using Bytes = std::vector<uint8_t>;

namespace {

const KernelCaps k618 = KernelCaps::for_version(6, 18);
const KernelCaps k61 = KernelCaps::for_version(6, 1);
const KernelCaps k414 = KernelCaps::for_version(4, 14);

Verdict verdict(const Bytes& b, const KernelCaps& c = k618) { return kernel_verdict(b.data(), b.size(), c); }

Placement place(const Bytes& b, Needs n = Needs{}, const KernelCaps& c = k618) {
  PlaceOptions o;
  o.caps = c;
  o.whole_function = true;
  return choose_entry_offset(b, 0x1000, n, o);
}

Needs args(uint32_t mask, bool rbp = true) {
  Needs n;
  n.arg_mask = mask;
  n.reads_rbp = rbp;
  return n;
}

}  // namespace

// ---- what the kernel emulates (arch/x86/kernel/uprobes.c) ----

TEST(KernelVerdict, BranchesAreEmulated) {
  EXPECT_EQ(verdict({0xeb, 0x05}), Verdict::kEmulated);                          // jmp rel8
  EXPECT_EQ(verdict({0xe9, 1, 0, 0, 0}), Verdict::kEmulated);                    // jmp rel32
  EXPECT_EQ(verdict({0xe8, 1, 0, 0, 0}), Verdict::kEmulated);                    // call rel32
  EXPECT_EQ(verdict({0x74, 0x05}), Verdict::kEmulated);                          // je rel8
  EXPECT_EQ(verdict({0x0f, 0x84, 1, 0, 0, 0}), Verdict::kEmulated);              // je rel32
  EXPECT_EQ(verdict({0xf2, 0xe9, 1, 0, 0, 0}), Verdict::kEmulated);              // bnd jmp
  EXPECT_EQ(verdict({0x7f, 0x05}, k414), Verdict::kEmulated);
}

TEST(KernelVerdict, OperandSizePrefixOnBranchIsRefused) {
  EXPECT_EQ(verdict({0x66, 0xe9, 1, 0, 0, 0}), Verdict::kRefused);
  EXPECT_EQ(verdict({0x66, 0xe8, 1, 0, 0, 0}), Verdict::kRefused);
  EXPECT_EQ(verdict({0x66, 0x0f, 0x84, 1, 0, 0, 0}), Verdict::kRefused);
  EXPECT_EQ(verdict({0x66, 0x74, 0x05}), Verdict::kRefused);
}

TEST(KernelVerdict, BadPrefixesAndOpcodesAreRefused) {
  EXPECT_EQ(verdict({0x3e, 0xff, 0xe0}), Verdict::kRefused);  // notrack jmp *%rax (ds)
  EXPECT_EQ(verdict({0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0}), Verdict::kRefused);  // cs nopl
  EXPECT_EQ(verdict({0xf0, 0x48, 0x0f, 0xb1, 0x0f}), Verdict::kRefused);            // lock cmpxchg
  EXPECT_EQ(verdict({0xcc}), Verdict::kRefused);                                      // int3
  EXPECT_EQ(verdict({0xcd, 0x80}), Verdict::kRefused);                                // int 0x80
}

TEST(KernelVerdict, PushRegisterOnlyWithoutOrWithRex41) {
  EXPECT_EQ(verdict({0x55}), Verdict::kEmulated);         // push %rbp
  EXPECT_EQ(verdict({0x53}), Verdict::kEmulated);         // push %rbx
  EXPECT_EQ(verdict({0x41, 0x54}), Verdict::kEmulated);   // push %r12
  EXPECT_EQ(verdict({0x41, 0x57}), Verdict::kEmulated);   // push %r15
  EXPECT_EQ(verdict({0x48, 0x55}), Verdict::kSingleStep); // rex.W push %rbp
  EXPECT_EQ(verdict({0x66, 0x55}), Verdict::kSingleStep); // push %bp
  EXPECT_EQ(verdict({0x6a, 0x00}), Verdict::kSingleStep); // push $0
  EXPECT_EQ(verdict({0xff, 0x35, 1, 0, 0, 0}), Verdict::kSingleStep);  // push mem(%rip)
  EXPECT_EQ(verdict({0x55}, k414), Verdict::kSingleStep);  // before push emulation
}

TEST(KernelVerdict, Nops) {
  EXPECT_EQ(verdict({0x90}, k414), Verdict::kEmulated);
  EXPECT_EQ(verdict({0xf3, 0x90}), Verdict::kEmulated);  // pause: "prefix* + nop"
  EXPECT_EQ(verdict({0x66, 0x90}, k61), Verdict::kRefused);  // before 6.2
  EXPECT_EQ(verdict({0x66, 0x90}), Verdict::kEmulated);
  // x86_nops[] (6.16+): exact byte patterns only.
  EXPECT_EQ(verdict({0x0f, 0x1f, 0x44, 0x00, 0x00}), Verdict::kEmulated);
  EXPECT_EQ(verdict({0x0f, 0x1f, 0x44, 0x00, 0x00}, k61), Verdict::kSingleStep);
  EXPECT_EQ(verdict({0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00}), Verdict::kEmulated);
  EXPECT_EQ(verdict({0x0f, 0x1f, 0x00}), Verdict::kEmulated);
  EXPECT_EQ(verdict({0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0}), Verdict::kEmulated);
  EXPECT_EQ(verdict({0x0f, 0x1f, 0x40, 0x08}), Verdict::kSingleStep);  // nopl 8(%rax): not in x86_nops
  EXPECT_EQ(verdict({0x66, 0x66, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0}), Verdict::kSingleStep);
}

TEST(KernelVerdict, OtherInstructionsAreSingleStepped) {
  EXPECT_EQ(verdict({0x48, 0x85, 0xff}), Verdict::kSingleStep);                       // test
  EXPECT_EQ(verdict({0x80, 0x3d, 1, 0, 0, 0, 0}), Verdict::kSingleStep);              // cmpb $0,x(%rip)
  EXPECT_EQ(verdict({0xf3, 0x0f, 0x1e, 0xfa}), Verdict::kSingleStep);                 // endbr64
  EXPECT_EQ(verdict({0xff, 0x25, 1, 0, 0, 0}), Verdict::kSingleStep);                 // jmp *x(%rip)
  EXPECT_EQ(verdict({0xc3}), Verdict::kSingleStep);                                   // ret
  EXPECT_EQ(verdict({0x48, 0x83, 0xec, 0x18}), Verdict::kSingleStep);                 // sub $0x18,%rsp
  EXPECT_FALSE(kernel_emulates(Bytes{0x48, 0x89, 0xf0}.data(), 3, k618));            // mov %rsi,%rax
}

// ---- the entry-path walk ----

TEST(Placement, EmulatedFirstInstructionStaysAtZero) {
  auto p = place({0x41, 0x54, 0x55, 0x53, 0x48, 0x89, 0xfb});  // malloc: push %r12 ...
  EXPECT_EQ(p.offset, 0u);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.rsp_adjust, 0);
  EXPECT_EQ(p.insn, "push r12");
}

TEST(Placement, FreeTestThenJe) {
  auto p = place({0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0, 0x55, 0xc3}, args(0x1));
  EXPECT_EQ(p.offset, 3u);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.rsp_adjust, 0);
  ASSERT_EQ(p.skipped.size(), 1u);
  EXPECT_EQ(p.skipped[0], "test rdi, rdi");
}

TEST(Placement, RipRelativeCompareThenJe) {
  auto p = place({0x80, 0x3d, 0x71, 0x0e, 0x14, 0x00, 0x00, 0x74, 0x07, 0xc3}, args(0x2));
  EXPECT_EQ(p.offset, 7u);
  EXPECT_TRUE(p.emulated);
}

TEST(Placement, ReallocarrayWritesItsArgumentsFirst) {
  // mov %rsi,%rax; mul %rdx; mov %rax,%rsi; jo; jmp realloc@plt
  Bytes b = {0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x48, 0x89, 0xc6, 0x70, 0x05, 0xe9, 0x40, 0xb8, 0xf8, 0xff};
  auto p = place(b, args(0x7));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_FALSE(p.emulated);
  EXPECT_NE(p.reason.find("rdx"), std::string::npos) << p.reason;  // mul writes rdx
  // A program reading only ptr (rdi) could go to the jo.
  EXPECT_EQ(place(b, args(0x1)).offset, 9u);
}

TEST(Placement, PushesAndSubAccumulateRspAdjust) {
  // sub $0x18,%rsp; mov %rdi,%rbx; push %rbx  -> push at +7, 0x18 below the return address
  auto p = place({0x48, 0x83, 0xec, 0x18, 0x48, 0x89, 0xfb, 0x53});
  EXPECT_EQ(p.offset, 7u);
  EXPECT_EQ(p.rsp_adjust, 0x18);
  // push $0 (not emulated) then sub, then je
  p = place({0x6a, 0x00, 0x48, 0x83, 0xec, 0x10, 0x74, 0x02});
  EXPECT_EQ(p.offset, 6u);
  EXPECT_EQ(p.rsp_adjust, 0x18);
  // add $-0x80,%rsp is a sub
  p = place({0x48, 0x83, 0xc4, 0x80, 0x74, 0x02});
  EXPECT_EQ(p.offset, 4u);
  EXPECT_EQ(p.rsp_adjust, 0x80);
}

TEST(Placement, UnknownRspChangeStops) {
  EXPECT_EQ(place({0x5b, 0x74, 0x02}).offset, 0u);                    // pop %rbx
  EXPECT_EQ(place({0x48, 0x89, 0xfc, 0x74, 0x02}).offset, 0u);        // mov %rdi,%rsp
  EXPECT_EQ(place({0x48, 0x83, 0xc4, 0x08, 0x74, 0x02}).offset, 0u);  // add $8,%rsp
}

TEST(Placement, EndbrIsSkipped) {
  auto p = place({0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5});
  EXPECT_EQ(p.offset, 4u);
  EXPECT_EQ(p.insn, "push rbp");
}

TEST(Placement, ArgumentWritesDependOnNeeds) {
  Bytes b = {0x31, 0xf6, 0x53};  // xor %esi,%esi; push %rbx
  EXPECT_EQ(place(b, args(0x3)).offset, 0u);
  EXPECT_EQ(place(b, args(0x1)).offset, 2u);
  Bytes r8 = {0x45, 0x31, 0xc0, 0x53};  // xor %r8d,%r8d; push %rbx
  EXPECT_EQ(place(r8, args(0x10)).offset, 0u);
  EXPECT_EQ(place(r8, args(0x0f)).offset, 3u);
  Bytes cx = {0x48, 0xd3, 0xe7, 0x53};  // shl %cl,%rdi: writes rdi
  EXPECT_EQ(place(cx, args(0x1)).offset, 0u);
  EXPECT_EQ(place(cx, args(0x8)).offset, 3u);
}

TEST(Placement, RbpWritesMatterOnlyForFramePointerWalks) {
  Bytes b = {0x48, 0x89, 0xe5, 0x53};  // mov %rsp,%rbp; push %rbx
  EXPECT_EQ(place(b, args(0x1, true)).offset, 0u);
  EXPECT_EQ(place(b, args(0x1, false)).offset, 3u);
}

TEST(Placement, NonEmulatedBranchesEndTheStraightLine) {
  EXPECT_EQ(place({0x48, 0x85, 0xff, 0xff, 0xe0}).offset, 0u);              // jmp *%rax
  EXPECT_EQ(place({0x48, 0x85, 0xff, 0x66, 0x74, 0x02, 0x90}).offset, 0u);  // data16 je: refused
  EXPECT_EQ(place({0x48, 0x85, 0xff, 0xc3}).offset, 0u);                    // ret
  EXPECT_EQ(place({0x48, 0x85, 0xff, 0xe3, 0x02, 0x55}).offset, 0u);        // jrcxz
  EXPECT_EQ(place({0x48, 0x85, 0xff, 0x0f, 0x05, 0x55}).offset, 0u);        // syscall
}

TEST(Placement, BranchIntoTheEntryPathFallsBackToZero) {
  // 0: test %rdi,%rdi; 3: je 7; 5: jmp 3; 7: ret  -> the je would fire twice
  auto p = place({0x48, 0x85, 0xff, 0x74, 0x02, 0xeb, 0xfc, 0xc3});
  EXPECT_EQ(p.offset, 0u);
  EXPECT_NE(p.reason.find("+0x3"), std::string::npos) << p.reason;
  // A branch to the entry itself is fine (offset 0 sees it too).
  p = place({0x48, 0x85, 0xff, 0x74, 0x02, 0xeb, 0xf9, 0xc3});
  EXPECT_EQ(p.offset, 3u);
  // Branches known from elsewhere in the object count too.
  PlaceOptions o;
  o.caps = k618;
  o.incoming_targets = {3};
  EXPECT_EQ(choose_entry_offset({0x48, 0x85, 0xff, 0x74, 0x02, 0xc3}, 0, Needs{}, o).offset, 0u);
  o.incoming_targets = {4};  // after the probe: harmless
  EXPECT_EQ(choose_entry_offset({0x48, 0x85, 0xff, 0x74, 0x02, 0xc3}, 0, Needs{}, o).offset, 3u);
}

TEST(Placement, StoresOverTheReturnAddressStop) {
  EXPECT_EQ(place({0x48, 0x89, 0x3c, 0x24, 0x74, 0x02}).offset, 0u);  // mov %rdi,(%rsp)
  // sub $0x10,%rsp; mov %rdi,0x8(%rsp); je  -> slot 8..16, return address at 16
  auto p = place({0x48, 0x83, 0xec, 0x10, 0x48, 0x89, 0x7c, 0x24, 0x08, 0x74, 0x02});
  EXPECT_EQ(p.offset, 9u);
  EXPECT_EQ(p.rsp_adjust, 16);
  EXPECT_EQ(place({0x48, 0x89, 0x7d, 0x00, 0x74, 0x02}).offset, 0u);  // mov %rdi,0(%rbp)
}

TEST(Placement, NopsDependOnKernelVersion) {
  Bytes b = {0x0f, 0x1f, 0x44, 0x00, 0x00, 0x55};
  EXPECT_EQ(place(b, Needs{}, k618).offset, 0u);
  auto old = place(b, Needs{}, k61);
  EXPECT_EQ(old.offset, 5u);
  EXPECT_EQ(old.insn, "push rbp");
}

TEST(Placement, XchgR8IsNotANop) {
  // 41 90 is xchg %eax,%r8d; the kernel's "prefix* + nop" rule would skip it.
  Bytes b = {0x41, 0x90, 0x55};
  EXPECT_EQ(verdict(b), Verdict::kEmulated);
  EXPECT_EQ(place(b, args(0x1)).offset, 2u);   // stepped over as an instruction
  EXPECT_EQ(place(b, args(0x10)).offset, 0u);  // writes r8
}

TEST(Placement, TruncatedOrEmptyCode) {
  EXPECT_EQ(place({}).offset, 0u);
  EXPECT_EQ(place({0x48, 0x85}).offset, 0u);
  auto p = place({0x48, 0x85, 0xff});
  EXPECT_EQ(p.offset, 0u);
  EXPECT_FALSE(p.emulated);
}

TEST(Placement, DescribeNamesOffsetInstructionAndWhy) {
  auto p = place({0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0, 0x55, 0xc3}, args(0x1));
  std::string d = describe(p);
  EXPECT_NE(d.find("+0x3 je"), std::string::npos) << d;
  EXPECT_NE(d.find("emulated"), std::string::npos) << d;
  EXPECT_NE(d.find("test rdi, rdi"), std::string::npos) << d;
}

// ---- this machine's glibc ----

namespace {
const char* kLibc = "/lib/x86_64-linux-gnu/libc.so.6";
const char* kDebianLibc236 = "93ac61ec5a8eb1396f9fbd350e3169a558528a40";
}  // namespace

TEST(RealLibc, EveryRoleLandsOnAnEmulatedBoundary) {
  auto elf = memtrace::elf::ElfFile::open(kLibc);
  if (!elf) MEMTRACE_SKIP_OR_FAIL(std::string("no ") + kLibc);
  auto a = find_allocator_symbols(*elf, DetectOptions{std::nullopt, k618, true});
  ASSERT_TRUE(a);
  for (const auto& s : a->symbols) {
    SCOPED_TRACE(s.symbol);
    const auto& p = s.placement;
    auto code = elf->read_vaddr(s.vaddr + p.offset, 16);
    if (p.offset > 0) {
      EXPECT_TRUE(p.emulated);
      EXPECT_EQ(kernel_verdict(code.data(), code.size(), k618), Verdict::kEmulated);
    }
    EXPECT_GE(p.rsp_adjust, 0);
    EXPECT_LT(p.offset, s.size);
  }
}

TEST(RealLibc, Glibc236Choices) {
  auto elf = memtrace::elf::ElfFile::open(kLibc);
  if (!elf) MEMTRACE_SKIP_OR_FAIL(std::string("no ") + kLibc);
  if (elf->build_id() != kDebianLibc236)
    MEMTRACE_SKIP_OR_FAIL("expectations are for Debian 12's glibc 2.36 build; this libc is " + elf->build_id());
  auto a = find_allocator_symbols(*elf, DetectOptions{std::nullopt, k618, true});
  ASSERT_TRUE(a);
  struct Want {
    uint64_t off;
    const char* insn;
    int32_t rsp;
    bool emulated;
  };
  std::map<Role, Want> want = {
      {Role::kMalloc, {0, "push r12", 0, true}},
      {Role::kFree, {3, "je 0x98fb8", 0, true}},
      {Role::kCalloc, {0, "push r13", 0, true}},
      {Role::kRealloc, {0, "push r15", 0, true}},
      {Role::kReallocarray, {0, "mov rax, rsi", 0, false}},
      {Role::kPosixMemalign, {7, "push r12", 0, true}},
      {Role::kAlignedAlloc, {7, "je 0x99620", 0, true}},
      {Role::kMemalign, {7, "je 0x99620", 0, true}},
      {Role::kValloc, {7, "push rbx", 0, true}},
      {Role::kPvalloc, {7, "push rbx", 0, true}},
  };
  ASSERT_EQ(a->symbols.size(), want.size());
  for (const auto& s : a->symbols) {
    SCOPED_TRACE(s.symbol + ": " + describe(s.placement));
    const Want& w = want.at(s.role);
    EXPECT_EQ(s.placement.offset, w.off);
    EXPECT_EQ(s.placement.insn, w.insn);
    EXPECT_EQ(s.placement.rsp_adjust, w.rsp);
    EXPECT_EQ(s.placement.emulated, w.emulated);
  }
  EXPECT_EQ(a->find(Role::kMemalign)->alias_of, "aligned_alloc");
  EXPECT_EQ(a->find(Role::kAlignedAlloc)->alias_of, "");
}

TEST(RealLibc, FirstSixtyFourBytesGiveTheSameAnswerAsTheLoaderAsks) {
  // The loader's call: 64 bytes, default options, running kernel.
  auto elf = memtrace::elf::ElfFile::open(kLibc);
  if (!elf) MEMTRACE_SKIP_OR_FAIL(std::string("no ") + kLibc);
  auto f = elf->find_function("free");
  ASSERT_TRUE(f);
  auto p = choose_entry_offset(elf->read_vaddr(f->vaddr, 64), f->vaddr, needs_for(Role::kFree));
  if (elf->build_id() == kDebianLibc236) {
    EXPECT_EQ(p.offset, 3u) << describe(p);
  }
}
