// Is an address a return address? A stack walk that went wrong (a frame-
// pointer step through code that keeps no frame pointer) reads words that
// are not; the bytes before a real one are a call instruction. Used to cut
// such a stack at its first untrustworthy frame (resolver.cpp).
#pragma once
#include <cstdint>
#include <string_view>

namespace memtrace::symbolize {

// before: the up to 8 bytes that end at the address (fewer at a file's
// start); at: the up to 12 bytes from it. machine: EM_X86_64 or EM_AARCH64.
// true when before ends with a call (x86-64: call rel32, call r/m64 in any
// of its ModRM forms, with prefixes; aarch64: bl, blr, blraa/blrab and
// their zero-modifier forms), or at is a signal return trampoline (the
// kernel pushes its address as a handler's return address: x86-64
// `mov $15,%rax; syscall`, aarch64 `mov x8,#139; svc #0`); also true for
// any other machine (nothing is known there).
bool follows_call(std::string_view before, std::string_view at, uint16_t machine);

}  // namespace memtrace::symbolize
