// Probe placement, arm64 (issue 20): the kernel's rules
// (arch/arm64/kernel/probes/decode-insn.c arm_probe_decode_insn, uprobes.c
// arch_uprobe_analyze_insn) on instruction words, and the entry-path walk on
// real arm64 code. Runs on any host: capstone decodes arm64 anywhere.
//
// The glibc bytes are Debian 12's libc6:arm64 2.36-9+deb12u14
// (/usr/lib/aarch64-linux-gnu/libc.so.6, build-id
// 6f268ff546c56d7f14e9501a55698cc2d0ab4732), taken with
//   aarch64-linux-gnu-objdump -d --start-address=ADDR --stop-address=ADDR+64 libc.so.6
// at malloc 0x92240, free 0x929c4, calloc 0x93380, reallocarray 0x945d0.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <map>

#include "elf/elf_file.h"
#include "probes/allocators.h"
#include "probes/probe_placement.h"
#include "test_env.h"

using namespace memtrace::probes;
using Words = std::vector<uint32_t>;

namespace {

const KernelCaps k61 = KernelCaps::for_version(6, 1);
const KernelCaps k612 = KernelCaps::for_version(6, 12);
const KernelCaps k510 = KernelCaps::for_version(5, 10);
const KernelCaps k613 = KernelCaps::for_version(6, 13);

Verdict verdict(uint32_t w, const KernelCaps& c = k61) { return arm64_kernel_verdict(w, c); }

std::vector<uint8_t> bytes(const Words& w) {
  std::vector<uint8_t> b(w.size() * 4);
  std::memcpy(b.data(), w.data(), b.size());
  return b;
}

Needs needs(uint32_t args, bool return_probe, bool fp = true) {
  Needs n;
  n.arg_mask = args;
  n.return_probe = return_probe;
  n.reads_rbp = fp;
  return n;
}

Placement place(const Words& w, const Needs& n, const KernelCaps& c = k61, uint64_t addr = 0x92240) {
  PlaceOptions o;
  o.caps = c;
  o.isa = Isa::kArm64;
  o.whole_function = true;
  return choose_entry_offset(bytes(w), addr, n, o);
}

// glibc 2.36 (Debian 12, arm64), first 16 instructions; see the top.
const Words kMalloc = {0xa9bc7bfd, 0x910003fd, 0xa90363f7, 0x900008b7, 0x912462e1, 0xa9025bf5,
                       0xaa0003f5, 0x39404020, 0xa90153f3, 0x34000880, 0xb7f808b5, 0x912462e1,
                       0xaa1503e0, 0x39408421, 0x35001581, 0xb0000876};
const Words kFree = {0xb4000880, 0xa9bc7bfd, 0x910003fd, 0xa9025bf5, 0x900008b5, 0x912462a1,
                     0xa90153f3, 0xd53bd054, 0xd1004013, 0x39408421, 0xf9001bf7, 0xb0000877,
                     0xf946e2f7, 0xb8776a96, 0x350006e1, 0xf9400661};
const Words kCalloc = {0xa9bb7bfd, 0x9bc17c02, 0x910003fd, 0xa90153f3, 0x9b017c13, 0xf100005f,
                       0x9a9f07e0, 0xb7f81973, 0xb5001940, 0xa9025bf5, 0xf0000895, 0x912462a0,
                       0xa90363f7, 0x39404000, 0xa9046bf9, 0x34000cc0};
const Words kReallocarray = {0x9bc27c23, 0x9b027c21, 0xb5000043, 0x17fe4b11, 0xf0000841, 0xf946e021,
                             0xd53bd042, 0x52800183, 0xd2800000, 0xb8216843, 0xd65f03c0, 0xd503201f};

constexpr uint32_t kBtiC = 0xd503245f, kPaciasp = 0xd503233f, kAutiasp = 0xd50323bf, kNop = 0xd503201f;
constexpr uint32_t kStpFpLr16 = 0xa9bf7bfd;  // stp x29, x30, [sp, #-16]!
constexpr uint32_t kMovFpSp = 0x910003fd;    // mov x29, sp

}  // namespace

// ---- what the kernel does with one instruction (arm_probe_decode_insn) ----

TEST(Arm64KernelVerdict, BranchesAndPcRelativeAreSimulated) {
  for (uint32_t w : {0x14000010u,   // b
                     0x94000010u,   // bl
                     0x54000081u,   // b.ne
                     0xb4000880u,   // cbz x0 (free's first instruction)
                     0x35001581u,   // cbnz w1
                     0x36000040u,   // tbz w0, #0
                     0xb7f808b5u,   // tbnz x21, #63
                     0x10000040u,   // adr x0
                     0x900008b7u,   // adrp x23
                     0xd61f0200u,   // br x16
                     0xd63f0200u,   // blr x16
                     0xd65f03c0u})  // ret
  {
    SCOPED_TRACE(arm64_text(w, 0x1000));
    EXPECT_EQ(verdict(w), Verdict::kEmulated);
    EXPECT_EQ(verdict(w, k510), Verdict::kEmulated);
    EXPECT_EQ(verdict(w, k612), Verdict::kEmulated);
  }
}

TEST(Arm64KernelVerdict, PrologueInstructionsAreSteppedOutOfLine) {
  for (uint32_t w : {0xa9bc7bfdu,  // stp x29, x30, [sp, #-64]!
                     kMovFpSp,      // mov x29, sp
                     0xa90363f7u,  // stp x23, x24, [sp, #48]
                     0xd10083ffu,  // sub sp, sp, #0x20
                     0x39404020u,  // ldrb w0, [x1, #16]
                     0xd53bd054u,  // mrs x20, tpidr_el0
                     0xc8dffc01u,  // ldar x1, [x0] (acquire, not exclusive)
                     kBtiC, kPaciasp, 0xd503231fu /* paciaz */, 0xd50320ffu /* xpaclri */})
  {
    SCOPED_TRACE(arm64_text(w, 0x1000));
    EXPECT_EQ(verdict(w), Verdict::kSingleStep);
    EXPECT_EQ(verdict(w, k612), Verdict::kSingleStep);
  }
}

TEST(Arm64KernelVerdict, NopIsSimulatedFrom613Only) {
  EXPECT_EQ(verdict(kNop, k510), Verdict::kSingleStep);
  EXPECT_EQ(verdict(kNop, k61), Verdict::kSingleStep);
  EXPECT_EQ(verdict(kNop, k612), Verdict::kSingleStep);
  EXPECT_EQ(verdict(kNop, k613), Verdict::kEmulated);
  EXPECT_EQ(verdict(kBtiC, k613), Verdict::kSingleStep);  // bti is not a nop to the kernel
}

TEST(Arm64KernelVerdict, ExclusivesLiteralsAndSystemAreRefused) {
  for (uint32_t w : {0xc85f7c01u,   // ldxr x1, [x0]
                     0x885ffc01u,   // ldaxr w1, [x0]
                     0xc8027c01u,   // stxr w2, x1, [x0]
                     0x8802fc01u,   // stlxr w2, w1, [x0]
                     0xc87f0801u,   // ldxp x1, x2, [x0]
                     0x58000040u,   // ldr x0, literal
                     0x98000040u,   // ldrsw x0, literal
                     0xd8000040u,   // prfm literal
                     kAutiasp,      // hint off the kernel's list
                     0xd503203fu,   // yield
                     0xd65f0bffu,   // retaa
                     0xd4000001u,   // svc #0
                     0xd4200000u,   // brk #0
                     0xd51b4220u,   // msr daif, x0
                     0xd53b4220u})  // mrs x0, daif
  {
    SCOPED_TRACE(arm64_text(w, 0x1000));
    EXPECT_EQ(verdict(w), Verdict::kRefused);
  }
}

TEST(Arm64KernelVerdict, HintsHaveTheirNames) {
  EXPECT_EQ(arm64_text(kBtiC, 0), "bti c");
  EXPECT_EQ(arm64_text(kPaciasp, 0), "paciasp");
  EXPECT_EQ(arm64_text(kAutiasp, 0), "autiasp");
  EXPECT_EQ(arm64_text(0xd65f0bff, 0), "retaa");
  EXPECT_EQ(arm64_text(0xa9bc7bfd, 0), "stp x29, x30, [sp, #-0x40]!");
}

// ---- the entry path, glibc 2.36 ----

TEST(Arm64Placement, GlibcFreeStartsWithCbz) {
  auto p = place(kFree, needs(0x1, false), k61, 0x929c4);
  EXPECT_EQ(p.offset, 0u);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.insn, "cbz x0, #0x92ad4");
  EXPECT_EQ(p.rsp_adjust, 0);
  EXPECT_EQ(return_probe_offset(p), 0u);
  EXPECT_NE(describe(p).find("+0x0 cbz x0, #0x92ad4: emulated; return address in x30"), std::string::npos)
      << describe(p);
}

TEST(Arm64Placement, GlibcMallocStaysAtTheEntryForItsReturnProbe) {
  // The first simulated instruction is adrp at +0xc, past stp x29, x30: a
  // return probe there would be lost, and one at the entry beside it would
  // add a trap; so both stay at the entry (stp, stepped out of line).
  auto p = place(kMalloc, needs(0x1, true));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_FALSE(p.emulated);
  EXPECT_EQ(p.insn, "stp x29, x30, [sp, #-0x40]!");
  EXPECT_NE(p.reason.find("return probe must stay at the entry"), std::string::npos) << p.reason;
  EXPECT_NE(p.reason.find("adrp x23"), std::string::npos) << p.reason;
}

TEST(Arm64Placement, WithoutAReturnProbeTheEntryProbeGoesPastTheFrameRecord) {
  auto p = place(kMalloc, needs(0x1, false));
  EXPECT_EQ(p.offset, 0xcu) << describe(p);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.insn.rfind("adrp x23", 0), 0u) << p.insn;
  EXPECT_EQ(p.rsp_adjust, 64);  // the caller's sp
  EXPECT_TRUE(p.lr_saved);
  EXPECT_EQ(return_probe_offset(p), 0u);
  ASSERT_EQ(p.skipped.size(), 3u);
  EXPECT_EQ(p.skipped[0], "stp x29, x30, [sp, #-0x40]!");
  EXPECT_EQ(p.skipped[1], "mov x29, sp");
  EXPECT_NE(describe(p).find("return address in x30, caller's sp at [sp+64]"), std::string::npos) << describe(p);
}

TEST(Arm64Placement, CallocAndReallocarrayWriteTheirArgumentsFirst) {
  // calloc: cset x0 at +0x18 comes before tbnz at +0x1c.
  auto c = place(kCalloc, needs(0x3, false), k61, 0x93380);
  EXPECT_EQ(c.offset, 0u);
  EXPECT_NE(c.reason.find("cset x0, ne at +0x18 writes x0"), std::string::npos) << c.reason;
  // reallocarray: mul x1, x1, x2 at +0x4 before cbnz.
  auto r = place(kReallocarray, needs(0x7, true), k61, 0x945d0);
  EXPECT_EQ(r.offset, 0u);
  EXPECT_NE(r.reason.find("writes x1"), std::string::npos) << r.reason;
  // Only x2 (the third argument) read: umulh x3 and mul x1 are harmless, cbnz at +0x8.
  auto r2 = place(kReallocarray, needs(0x4, true), k61, 0x945d0);
  EXPECT_EQ(r2.offset, 8u) << describe(r2);
  EXPECT_EQ(return_probe_offset(r2), 8u);  // sp and x30 untouched: one trap for both
}

TEST(Arm64Placement, CxxAlignedNewMovesToItsBne) {
  // libstdc++ 12 (Debian 12's libstdc++6-arm64-cross, /usr/aarch64-linux-gnu/lib/libstdc++.so.6)
  // operator new(size_t, align_val_t) at 0xa2cf0, first 10 instructions. No return
  // probe, no stack taken, only x0 read: the entry probe goes to b.ne at +0x24.
  const Words w = {0xa9be7bfd, 0x910003fd, 0xfd000fe8, 0x9e670028, 0xf9000bf3,
                   0x0e205900, 0x0e31b800, 0x9e660001, 0x7100043f, 0x54000281};
  auto p = place(w, needs_for(Role::kAlignedNew), k61, 0xa2cf0);
  EXPECT_EQ(p.offset, 0x24u) << describe(p);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.insn, "b.ne #0xa2d64");
  EXPECT_EQ(p.rsp_adjust, 32);
  EXPECT_TRUE(p.lr_saved);
  // str d8, [sp, #24] stores 8 bytes: inside the 32-byte frame.
  EXPECT_EQ(p.skipped[2], "str d8, [sp, #0x18]");
  // A 16-byte store there would reach into the caller's frame.
  auto q = place({0xa9be7bfd, 0x910003fd, 0x3d8007e8 /* str q8, [sp, #16] */, 0x54000281},
                 needs_for(Role::kAlignedNew), k61, 0xa2cf0);
  EXPECT_EQ(q.offset, 0xcu) << describe(q);
  // A store over the frame record just made (x29 points at it) stops a walk that reads x29.
  auto f = place({0xa9be7bfd, 0x910003fd, 0xf90003e1 /* str x1, [sp] */, 0x54000281}, needs(0x1, false));
  EXPECT_EQ(f.offset, 0u);
  EXPECT_NE(f.reason.find("frame record"), std::string::npos) << f.reason;
  auto r = place({0xa9be7bfd, 0xad0087e0 /* stp q0, q1, [sp, #16] */, 0x54000281}, needs_for(Role::kAlignedNew),
                 k61, 0xa2cf0);
  EXPECT_EQ(r.offset, 0u);
  EXPECT_NE(r.reason.find("outside the new frame"), std::string::npos) << r.reason;
}

// ---- bti / paciasp at the entry ----

TEST(Arm64Placement, BtiThenSimulatedMovesOneInstruction) {
  // bti c; cbz x0, ...: bti has no effect on the registers, x30 and sp are untouched:
  // the entry and the return probe both go to the cbz.
  auto p = place({kBtiC, 0xb4000080, kStpFpLr16, kMovFpSp, 0xd65f03c0}, needs(0x1, true));
  EXPECT_EQ(p.offset, 4u) << describe(p);
  EXPECT_TRUE(p.emulated);
  EXPECT_EQ(p.rsp_adjust, 0);
  EXPECT_FALSE(p.lr_saved);
  EXPECT_EQ(return_probe_offset(p), 4u);
  EXPECT_EQ(p.skipped, std::vector<std::string>{"bti c"});
}

TEST(Arm64Placement, PaciaspSignsX30AndEndsTheWalk) {
  // bti c; paciasp; stp; mov; adrp: past paciasp x30 holds a signed pointer.
  auto p = place({kBtiC, kPaciasp, kStpFpLr16, kMovFpSp, 0x900008b7, 0xd65f03c0}, needs(0x1, false));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_EQ(p.insn, "bti c");
  EXPECT_FALSE(p.emulated);
  EXPECT_NE(p.reason.find("paciasp at +0x4 changes x30"), std::string::npos) << p.reason;
  auto q = place({kPaciasp, 0xb4000080}, needs(0x1, false));
  EXPECT_EQ(q.offset, 0u);
  EXPECT_EQ(q.insn, "paciasp");
}

// ---- what ends the walk ----

TEST(Arm64Placement, ExclusiveLoadNearTheEntryStops) {
  // mov x2, x0; ldaxr w1, [x2]; cbnz w1: a probe on the cbnz would sit between
  // the exclusive load and its store: the trap clears the monitor.
  auto p = place({0xaa0003e2, 0x885ffc41, 0x35000041, 0x88037c41, 0xd65f03c0}, needs(0x1, false));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_NE(p.reason.find("exclusive"), std::string::npos) << p.reason;
  // At the entry itself the kernel refuses it.
  auto q = place({0x885ffc01, 0x35000041}, needs(0x1, false));
  EXPECT_EQ(q.offset, 0u);
  EXPECT_NE(q.reason.find("refused by the kernel (exclusive load/store)"), std::string::npos) << q.reason;
}

TEST(Arm64Placement, BranchIntoTheEntryPathFallsBack) {
  // stp; mov x29, sp; adrp; b.ne back to +4 (mov): the adrp is not reached on every path.
  auto p = place({kStpFpLr16, kMovFpSp, 0x900008b7, 0x54ffffc1, 0xd65f03c0}, needs(0x1, false), k61, 0x1000);
  EXPECT_EQ(p.offset, 0u);
  EXPECT_NE(p.reason.find("a branch targets +0x4"), std::string::npos) << p.reason;
  // The same from outside the function (incoming_targets).
  PlaceOptions o;
  o.caps = k61;
  o.isa = Isa::kArm64;
  o.incoming_targets = {8};
  auto q = choose_entry_offset(bytes({kStpFpLr16, kMovFpSp, 0x900008b7, 0xd65f03c0}), 0x1000, needs(0x1, false), o);
  EXPECT_EQ(q.offset, 0u);
}

TEST(Arm64Placement, FramePointerAndStackRules) {
  // x29 set to something else than the frame record: stop (the BPF walk starts at x29).
  auto p = place({kStpFpLr16, 0x910043fd /* add x29, sp, #16 */, 0x900008b7}, needs(0x1, false));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_NE(p.reason.find("writes x29"), std::string::npos) << p.reason;
  // ... unless no stack is taken (aligned operator new).
  auto q = place({kStpFpLr16, 0x910043fd, 0x900008b7}, needs(0x1, false, false));
  EXPECT_EQ(q.offset, 8u) << describe(q);
  // sub sp; stp x29, x30, [sp, #16]; add x29, sp, #16: a frame record at sp+16.
  auto r = place({0xd100c3ff /* sub sp, sp, #0x30 */, 0xa9017bfd /* stp x29, x30, [sp, #16] */, 0x910043fd,
                  0x900008b7},
                 needs(0x1, false));
  EXPECT_EQ(r.offset, 12u) << describe(r);
  EXPECT_EQ(r.rsp_adjust, 48);
  // A store above the new frame (the caller's) stops.
  auto s = place({kStpFpLr16, 0xf9000be1 /* str x1, [sp, #16] */, 0x900008b7}, needs(0x1, false));
  EXPECT_EQ(s.offset, 0u);
  EXPECT_NE(s.reason.find("outside the new frame"), std::string::npos) << s.reason;
  // x30 loaded: stop.
  auto t = place({0xf940001e /* ldr x30, [x0] */, 0x900008b7}, needs(0x2, false));
  EXPECT_EQ(t.offset, 0u);
  EXPECT_NE(t.reason.find("writes x30"), std::string::npos) << t.reason;
}

TEST(Arm64Placement, NopBeforeSimulatedOn613) {
  // nop; stp; ...: from 6.13 the nop itself is simulated: the entry.
  auto p = place({kNop, kStpFpLr16, kMovFpSp}, needs(0x1, true), k613);
  EXPECT_EQ(p.offset, 0u);
  EXPECT_TRUE(p.emulated);
  auto q = place({kNop, kStpFpLr16, kMovFpSp}, needs(0x1, true), k61);
  EXPECT_EQ(q.offset, 0u);
  EXPECT_FALSE(q.emulated);
}

TEST(Arm64Placement, TruncatedOrEmpty) {
  auto p = place({}, needs(0x1, true));
  EXPECT_EQ(p.offset, 0u);
  EXPECT_TRUE(p.arm64);
  std::vector<uint8_t> three = {0x80, 0x08, 0x00};
  PlaceOptions o;
  o.isa = Isa::kArm64;
  EXPECT_EQ(choose_entry_offset(three, 0, needs(0x1, true), o).offset, 0u);
}

// ---- the arm64 libc of this machine (multiarch), if installed ----

namespace {
const char* kArm64Libc = "/usr/lib/aarch64-linux-gnu/libc.so.6";
const char* kDebianArm64Libc236 = "6f268ff546c56d7f14e9501a55698cc2d0ab4732";
}  // namespace

TEST(RealArm64Libc, Glibc236Choices) {
  auto elf = memtrace::elf::ElfFile::open(kArm64Libc);
  if (!elf) MEMTRACE_SKIP_OR_FAIL(std::string("no ") + kArm64Libc + " (scripts/deps-arm64.txt installs it)");
  DetectOptions d;
  d.caps = k61;
  d.isa = Isa::kArm64;
  auto a = find_allocator_symbols(*elf, d);
  ASSERT_TRUE(a);
  for (const auto& s : a->symbols) {
    SCOPED_TRACE(s.symbol + ": " + describe(s.placement));
    const auto& p = s.placement;
    EXPECT_TRUE(p.arm64);
    EXPECT_EQ(p.offset % 4, 0u);
    auto code = elf->read_vaddr(s.vaddr + p.offset, 4);
    ASSERT_EQ(code.size(), 4u);
    uint32_t w;
    std::memcpy(&w, code.data(), 4);
    if (p.offset > 0) {
      EXPECT_EQ(arm64_kernel_verdict(w, k61), Verdict::kEmulated);
    }
    EXPECT_NE(arm64_kernel_verdict(w, k61), Verdict::kRefused);
    if (has_return_probe(s.role)) {
      EXPECT_EQ(return_probe_offset(p), p.offset) << "one trap for both";
    }
    std::printf("  %s %s\n", s.symbol.c_str(), describe(p).c_str());
  }
  if (elf->build_id() != kDebianArm64Libc236) return;
  // Debian 12's 2.36-9+deb12u14: free on its cbz; reallocarray writes x1
  // (mul) before its cbnz; the rest start with stp x29, x30 and have a
  // return probe: at the entry, stepped out of line.
  std::map<Role, std::pair<uint64_t, bool>> want = {
      {Role::kMalloc, {0, false}},        {Role::kFree, {0, true}},         {Role::kCalloc, {0, false}},
      {Role::kRealloc, {0, false}},       {Role::kReallocarray, {0, false}}, {Role::kPosixMemalign, {0, false}},
      {Role::kAlignedAlloc, {0, false}},  {Role::kMemalign, {0, false}},    {Role::kValloc, {0, false}},
      {Role::kPvalloc, {0, false}},
  };
  for (const auto& s : a->symbols) {
    SCOPED_TRACE(s.symbol + ": " + describe(s.placement));
    auto it = want.find(s.role);
    ASSERT_NE(it, want.end());
    EXPECT_EQ(s.placement.offset, it->second.first);
    EXPECT_EQ(s.placement.emulated, it->second.second);
  }
}

TEST(RealArm64Libc, CxxAlignedNewOfLibstdcxx12) {
  // Debian 12's libstdc++6-arm64-cross 12.2.0-14cross1 (build-id 848b2571...):
  // operator new(size_t, align_val_t) takes no return probe and no stack, so
  // its probe may go past stp x29, x30 to the first simulated instruction,
  // unless something in the object branches into the skipped ones.
  const char* path = "/usr/aarch64-linux-gnu/lib/libstdc++.so.6";
  auto elf = memtrace::elf::ElfFile::open(path);
  if (!elf) MEMTRACE_SKIP_OR_FAIL(std::string("no ") + path + " (libstdc++6-arm64-cross)");
  DetectOptions d;
  d.caps = k61;
  d.isa = Isa::kArm64;
  auto a = find_cxx_aligned_new(*elf, d);
  ASSERT_TRUE(a);
  for (const auto& s : a->symbols) {
    if (!s.alias_of.empty()) continue;
    SCOPED_TRACE(s.symbol + ": " + describe(s.placement));
    std::printf("  %s %s\n", s.symbol.c_str(), describe(s.placement).c_str());
    const auto& p = s.placement;
    auto code = elf->read_vaddr(s.vaddr + p.offset, 4);
    ASSERT_EQ(code.size(), 4u);
    uint32_t w;
    std::memcpy(&w, code.data(), 4);
    if (p.offset > 0) {
      EXPECT_EQ(arm64_kernel_verdict(w, k61), Verdict::kEmulated);
    }
    if (s.symbol == "_ZnwmSt11align_val_t" && elf->build_id() == "848b25713b3759cc5c5ed020cbe0abdae7fa42ec") {
      EXPECT_EQ(p.offset, 0x24u);
      EXPECT_EQ(p.rsp_adjust, 32);
    }
  }
}
