#include "symbolize/call_site.h"

#include <elf.h>

#include <cstring>

namespace memtrace::symbolize {
namespace {

uint8_t byte(std::string_view s, size_t i) { return static_cast<uint8_t>(s[i]); }

// The length of an FF /2 call's ModRM, SIB and displacement (x86-64 has no
// 16-bit addressing in 64-bit code without 0x67, which changes nothing
// here); 0 when the ModRM byte is not /2.
size_t ff2_operand_len(std::string_view s, size_t modrm_at) {
  uint8_t m = byte(s, modrm_at);
  if (((m >> 3) & 7) != 2) return 0;
  uint8_t mod = m >> 6, rm = m & 7;
  if (mod == 3) return 1;
  size_t n = 1;
  if (rm == 4) {  // SIB
    if (modrm_at + 1 >= s.size()) return 0;
    n++;
    if (mod == 0 && (byte(s, modrm_at + 1) & 7) == 5) n += 4;  // no base: disp32
  } else if (mod == 0 && rm == 5) {
    n += 4;  // RIP-relative disp32
  }
  if (mod == 1) n += 1;
  if (mod == 2) n += 4;
  return n;
}

bool x86_64_call_before(std::string_view b) {
  size_t n = b.size();
  if (n >= 5 && byte(b, n - 5) == 0xe8) return true;  // call rel32
  // call r/m64: FF, then ModRM (+ SIB + displacement) ending exactly at the
  // address. Prefixes (REX, notrack, segment) sit before FF and do not count.
  for (size_t len = 2; len <= 8 && len <= n; len++) {
    size_t ff = n - len;
    if (byte(b, ff) == 0xff && ff2_operand_len(b, ff + 1) == len - 1) return true;
  }
  return false;
}

bool x86_64_sigreturn(std::string_view a) {
  static const uint8_t k[] = {0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05};  // mov $15,%rax; syscall
  return a.size() >= sizeof k && std::memcmp(a.data(), k, sizeof k) == 0;
}

uint32_t word(std::string_view s, size_t i) {
  uint32_t w;
  std::memcpy(&w, s.data() + i, 4);
  return w;  // little-endian host and file
}

bool aarch64_call_before(std::string_view b) {
  if (b.size() < 4) return false;
  uint32_t i = word(b, b.size() - 4);
  return (i & 0xfc000000u) == 0x94000000u     // bl
         || (i & 0xfffffc1fu) == 0xd63f0000u  // blr
         || (i & 0xfefff800u) == 0xd63f0800u;  // blraa, blrab, blraaz, blrabz
}

bool aarch64_sigreturn(std::string_view a) {
  return a.size() >= 8 && word(a, 0) == 0xd2801168u && word(a, 4) == 0xd4000001u;  // mov x8,#139; svc #0
}

}  // namespace

bool follows_call(std::string_view before, std::string_view at, uint16_t machine) {
  switch (machine) {
    case EM_X86_64: return x86_64_call_before(before) || x86_64_sigreturn(at);
    case EM_AARCH64: return aarch64_call_before(before) || aarch64_sigreturn(at);
    default: return true;
  }
}

}  // namespace memtrace::symbolize
