// The arm64 decoder of the single-step helper, on any host: fixed aarch64
// instruction words (assembled with aarch64-linux-gnu-as, bytes from
// objdump), fixed registers, the address, size and direction each must give.
#include "decoder_arm64.h"

#include <gtest/gtest.h>

#include <cstring>

namespace memtrace::singlestep {
namespace {

Arm64Regs regs() {
  Arm64Regs r;
  for (int i = 0; i < 31; i++) r.x[i] = 0x100000ull * (i + 1);
  r.x[2] = 0x1fffffffeull;  // w2 = -2: lsl, uxtw and sxtw all differ
  r.sp = 0x7ffff000ull;
  r.pc = 0x400000;
  return r;
}

struct Row {
  uint32_t word;
  const char* text;  // capstone's (or the LSE table's) text
  uint64_t ea;
  uint32_t size;
  Dir dir;
  uint8_t exclusive = 0;
};

constexpr uint64_t X(int i) { return 0x100000ull * (i + 1); }
constexpr uint64_t kSp = 0x7ffff000ull;
constexpr uint64_t kPc = 0x400000;

const Row kRows[] = {
    {0xf9400420, "ldr x0, [x1, #8]", X(1) + 8, 8, Dir::kRead},
    {0xf8408c20, "ldr x0, [x1, #8]!", X(1) + 8, 8, Dir::kRead},            // pre-index: at base + 8
    {0xf8408420, "ldr x0, [x1], #8", X(1), 8, Dir::kRead},                 // post-index: at base
    {0xf8627820, "ldr x0, [x1, x2, lsl #3]", X(1) + (0x1fffffffeull << 3), 8, Dir::kRead},
    {0xb862d820, "ldr w0, [x1, w2, sxtw #2]", X(1) - 8, 4, Dir::kRead},
    {0x38624820, "ldrb w0, [x1, w2, uxtw]", X(1) + 0xfffffffeull, 1, Dir::kRead},
    {0xf8625820, "ldr x0, [x1, w2, uxtw #3]", X(1) + (0xfffffffeull << 3), 8, Dir::kRead},
    {0x58000800, "ldr x0, #0x400100", kPc + 0x100, 8, Dir::kRead},        // literal
    {0x1c000040, "ldr s0, #0x400008", kPc + 8, 4, Dir::kRead},            // SIMD literal
    {0xa9ff07e0, "ldp x0, x1, [sp, #-0x10]!", kSp - 16, 16, Dir::kRead},
    {0xa8817bfd, "stp x29, x30, [sp], #0x10", kSp, 16, Dir::kWrite},
    {0x69400440, "ldpsw x0, x1, [x2]", 0x1fffffffeull, 8, Dir::kRead},
    {0xad400420, "ldp q0, q1, [x1]", X(1), 32, Dir::kRead},
    {0x3dc00820, "ldr q0, [x1, #0x20]", X(1) + 32, 16, Dir::kRead},
    {0xfc1f8021, "stur d1, [x1, #-8]", X(1) - 8, 8, Dir::kWrite},
    {0xf85fd020, "ldur x0, [x1, #-3]", X(1) - 3, 8, Dir::kRead},
    {0x79800420, "ldrsh x0, [x1, #2]", X(1) + 2, 2, Dir::kRead},
    {0xb9800420, "ldrsw x0, [x1, #4]", X(1) + 4, 4, Dir::kRead},
    {0x78226820, "strh w0, [x1, x2]", X(1) + 0x1fffffffeull, 2, Dir::kWrite},
    {0x39000420, "strb w0, [x1, #1]", X(1) + 1, 1, Dir::kWrite},
    {0x88dffc20, "ldar w0, [x1]", X(1), 4, Dir::kRead},
    {0x489ffc20, "stlrh w0, [x1]", X(1), 2, Dir::kWrite},
    {0xc85f7c20, "ldxr x0, [x1]", X(1), 8, Dir::kRead, 1},
    {0xc8027c20, "stxr w2, x0, [x1]", X(1), 8, Dir::kWrite, 2},             // w2 is the status, not data
    {0xc87f8440, "ldaxp x0, x1, [x2]", 0x1fffffffeull, 16, Dir::kRead, 1},
    {0xc8238440, "stlxp w3, x0, x1, [x2]", 0x1fffffffeull, 16, Dir::kWrite, 2},
    {0x4c40a000, "ld1 {v0.16b, v1.16b}, [x0]", X(0), 32, Dir::kRead},
    {0x4cdf7000, "ld1 {v0.16b}, [x0], #0x10", X(0), 16, Dir::kRead},
    {0x4c836800, "st1 {v0.4s, v1.4s, v2.4s}, [x0], x3", X(0), 48, Dir::kWrite},
    {0x0d409000, "ld1 {v0.s}[1], [x0]", X(0), 4, Dir::kRead},
    {0x4d40c400, "ld1r {v0.8h}, [x0]", X(0), 2, Dir::kRead},
    {0x0c400000, "ld4 {v0.8b, v1.8b, v2.8b, v3.8b}, [x0]", X(0), 32, Dir::kRead},
    {0xd50b7420, "dc zva, x0", X(0) & ~63ull, 64, Dir::kWrite},
    // LSE atomics (capstone 4 does not decode them).
    {0xb8200041, "ldadd w0, w1, [x2]", 0x1fffffffeull, 4, Dir::kReadWrite},
    {0x38e00041, "ldaddalb w0, w1, [x2]", 0x1fffffffeull, 1, Dir::kReadWrite},
    {0xf820005f, "stadd x0, [x2]", 0x1fffffffeull, 8, Dir::kReadWrite},
    {0xf8208041, "swp x0, x1, [x2]", 0x1fffffffeull, 8, Dir::kReadWrite},
    {0xc8a07c41, "cas x0, x1, [x2]", 0x1fffffffeull, 8, Dir::kReadWrite},
    {0x48207c82, "casp x0, x1, x2, x3, [x4]", X(4), 16, Dir::kReadWrite},
};

TEST(DecoderArm64, LoadsAndStores) {
  Arm64Decoder d;
  Arm64Regs r = regs();
  for (const Row& row : kRows) {
    uint8_t code[4];
    std::memcpy(code, &row.word, 4);
    auto in = d.decode(kPc, code, 4, r);
    ASSERT_TRUE(in) << row.text;
    EXPECT_EQ(in->text, row.text);
    EXPECT_EQ(in->len, 4u);
    ASSERT_EQ(in->ops.size(), 1u) << row.text;
    EXPECT_EQ(in->ops[0].ea, row.ea) << row.text;
    EXPECT_EQ(in->ops[0].size, row.size) << row.text;
    EXPECT_EQ(in->ops[0].dir, row.dir) << row.text;
    EXPECT_EQ(in->exclusive, row.exclusive) << row.text;
  }
}

TEST(DecoderArm64, NoMemoryAccess) {
  Arm64Decoder d;
  Arm64Regs r = regs();
  // prfm, add, b, nop, bti c, dmb ish: decoded, nothing touched.
  for (uint32_t w : {0xf9800000u, 0x91000420u, 0x14000004u, 0xd503201fu, 0xd503245fu, 0xd5033bbfu}) {
    uint8_t code[4];
    std::memcpy(code, &w, 4);
    auto in = d.decode(kPc, code, 4, r);
    ASSERT_TRUE(in) << std::hex << w;
    EXPECT_TRUE(in->ops.empty()) << in->text;
  }
}

TEST(DecoderArm64, PlainLoadsAndStoresAreEmulable) {
  Arm64Decoder d;
  Arm64Regs r = regs();
  struct E {
    uint32_t word;
    Emul emul;
    bool sign_extend;
    unsigned width;  // of the register moved
  };
  const E kRows[] = {
      {0xf9400420, Emul::kLoad, false, 8},      // ldr x0, [x1, #8]
      {0x38624820, Emul::kLoad, false, 4},      // ldrb w0, [x1, w2, uxtw]
      {0x79800420, Emul::kLoad, true, 8},       // ldrsh x0, [x1, #2]
      {0xb9800420, Emul::kLoad, true, 8},       // ldrsw x0, [x1, #4]
      {0xf85fd020, Emul::kLoad, false, 8},      // ldur x0, [x1, #-3]
      {0x78226820, Emul::kStoreReg, false, 4},  // strh w0, [x1, x2]
      {0x39000420, Emul::kStoreReg, false, 4},  // strb w0, [x1, #1]
      {0xf8408c20, Emul::kNone, false, 0},      // ldr x0, [x1, #8]!: writeback
      {0xf8408420, Emul::kNone, false, 0},      // ldr x0, [x1], #8: writeback
      {0xa9ff07e0, Emul::kNone, false, 0},      // ldp
      {0x88dffc20, Emul::kNone, false, 0},      // ldar
      {0xc85f7c20, Emul::kNone, false, 0},      // ldxr
      {0x3dc00820, Emul::kNone, false, 0},      // ldr q0
      {0x58000800, Emul::kNone, false, 0},      // ldr x0, literal
      {0xb8200041, Emul::kNone, false, 0},      // ldadd
  };
  for (const E& e : kRows) {
    uint8_t code[4];
    std::memcpy(code, &e.word, 4);
    auto in = d.decode(kPc, code, 4, r);
    ASSERT_TRUE(in) << std::hex << e.word;
    EXPECT_EQ(in->emul, e.emul) << in->text;
    if (e.emul != Emul::kNone) {
      EXPECT_EQ(in->sign_extend, e.sign_extend) << in->text;
      EXPECT_EQ(arm64_reg_width(in->reg), e.width) << in->text;
    }
  }
  // The registers the tracer executes them with: w writes zero the upper half.
  Arm64Regs w = regs();
  w.x[0] = ~0ull;
  uint32_t ldrb = 0x38624820;
  uint8_t code[4];
  std::memcpy(code, &ldrb, 4);
  auto in = d.decode(kPc, code, 4, w);
  ASSERT_TRUE(in);
  ASSERT_TRUE(reg_write(in->reg, 0x1234567890ull, w));
  EXPECT_EQ(w.x[0], 0x34567890ull);
  EXPECT_EQ(arm64_reg_width(in->reg), 4u);
  EXPECT_EQ(reg_read(in->reg, w), 0x34567890ull);
}

TEST(DecoderArm64, RecomputeFollowsTheRegisters) {
  Arm64Decoder d;
  Arm64Regs r = regs();
  uint32_t w = 0xf8408420;  // ldr x0, [x1], #8
  uint8_t code[4];
  std::memcpy(code, &w, 4);
  auto in = d.decode(kPc, code, 4, r);
  ASSERT_TRUE(in);
  r.x[1] += 8;
  ASSERT_TRUE(d.recompute(*in, code, 4, r));
  ASSERT_EQ(in->ops.size(), 1u);
  EXPECT_EQ(in->ops[0].ea, X(1) + 8);
}

TEST(DecoderArm64, DcZvaBlockFromDczid) {
  Arm64Decoder d(128);
  Arm64Regs r = regs();
  r.x[0] = 0x12345;
  uint32_t w = 0xd50b7420;
  uint8_t code[4];
  std::memcpy(code, &w, 4);
  auto in = d.decode(kPc, code, 4, r);
  ASSERT_TRUE(in);
  ASSERT_EQ(in->ops.size(), 1u);
  EXPECT_EQ(in->ops[0].ea, 0x12300u);
  EXPECT_EQ(in->ops[0].size, 128u);
}

}  // namespace
}  // namespace memtrace::singlestep
