// Where to put an entry uprobe so that the kernel emulates the probed
// instruction instead of single-stepping it out of line (DESIGN.md: 0.7 us vs
// 14-17 us per hit). CONTRACT with the loader (keep these names; add freely).
//
// What the x86 kernel emulates (arch/x86/kernel/uprobes.c, arch_uprobe_analyze_insn):
//   branch_setup_xol_ops (since 3.15): jmp rel8/rel32 (eb, e9), call rel32 (e8),
//     jcc rel8/rel32 (70-7f, 0f 80-8f); any 0x66 prefix on these: -ENOTSUPP
//     (the probe is refused, not single-stepped).
//   nop 0x90 with any prefixes ("prefix* + nop", goto setup): since 6.2; before
//     6.2 a 0x66 prefix on it was refused like a branch's.
//   the kernel's own nops x86_nops[len] (66 90, 0f 1f 00, 0f 1f 40 00,
//     0f 1f 44 00 00, 66 0f 1f 44 00 00, 0f 1f 80 .., 0f 1f 84 ..): since 6.16
//     (610f6e14c29d "Add support to emulate NOP instructions"). 6.18 also
//     optimizes a probed 5-byte nop into a call to a trampoline.
//   push_setup_xol_ops: push %reg (50-57; 41 50-57 for r8-r15, no other prefix):
//     since e7ed9d9bd037 (not in 4.14).
//   Everything else that uprobe_init_insn accepts is single-stepped out of line
//   (rip-relative operands rewritten through a scratch register); es/cs/ss/ds and
//   lock prefixes, and opcodes outside good_insns_64/good_2byte_insns, are refused.
//
// What the arm64 kernel simulates (arch/arm64/kernel/probes/uprobes.c
// arch_uprobe_analyze_insn -> decode-insn.c arm_probe_decode_insn; measured
// on 6.1 and 6.12): probe_placement_arm64.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace memtrace::probes {

// The instruction set of the code analysed: the host's unless a test says
// otherwise (capstone decodes either anywhere).
enum class Isa { kX86_64, kArm64 };
#if defined(__aarch64__)
inline constexpr Isa kHostIsa = Isa::kArm64;
#else
inline constexpr Isa kHostIsa = Isa::kX86_64;
#endif

// What the BPF program at the probe must know to read its inputs correctly.
struct Placement {
  uint64_t offset = 0;        // bytes from function start
  std::string insn;           // "je 0x98fb8" (the instruction at offset)
  std::string reason;         // one line, for --explain-probes
  int32_t rsp_adjust = 0;     // bytes pushed/subtracted before offset: return address is at [rsp + rsp_adjust]
  bool emulated = false;      // the kernel emulates the instruction at offset
  // Added: the instructions executed before offset (Intel syntax), for --explain-probes.
  std::vector<std::string> skipped;
  // Added: bytes of the function that were checked for branches into [1, offset].
  uint64_t checked_bytes = 0;
  // arm64: rsp_adjust is how far sp moved down before offset (the BPF
  // program takes the return address from x30 and the caller's sp as
  // sp + rsp_adjust); lr_saved: x30 was stored before offset, so a return
  // probe there would be lost (the epilogue reloads x30 from the stack).
  bool arm64 = false;
  bool lr_saved = false;
};

// Which argument registers the BPF program reads (the chosen instruction must
// come before anything that writes them). Bit i = argument i (rdi, rsi, rdx, rcx, r8, r9).
// reads_rsp: the program reads the return address at [rsp].
struct Needs {
  uint32_t arg_mask = 0x1;
  bool reads_rsp = true;
  bool reads_rbp = true;  // frame-pointer stack walk starts at rbp
  // The function also gets a return probe, which must sit where the return
  // address has not moved (arm64: x30 not saved, sp not moved). Where it
  // cannot share the entry probe's instruction, both go to the entry (one
  // trap there serves both; a second trap further on would only add).
  bool return_probe = true;
};

// Emulation rules of one kernel version (see the table at the top).
struct KernelCaps {
  int major = 0, minor = 0;
  bool push = true;            // push %reg emulated
  bool nop_prefixed = true;    // prefix* + 0x90 emulated (6.2+); false: 66 90 is refused
  bool nop_x86_nops = true;    // multi-byte x86_nops[] emulated (6.16+)
  bool arm64_nop = false;      // arm64 nop simulated (6.13+); before, stepped out of line
  static KernelCaps for_version(int major, int minor);
  static const KernelCaps& running();  // uname(2), read once
};

enum class Verdict {
  kEmulated,    // probe hit costs a trap + emulation
  kSingleStep,  // accepted, executed out of line (slow)
  kRefused,     // arch_uprobe_analyze_insn fails: the probe cannot be installed there
  kUndecodable,
};
const char* verdict_name(Verdict v);
// What the kernel does with the instruction at insn[0..len). *insn_len gets its length.
Verdict kernel_verdict(const uint8_t* insn, size_t len, const KernelCaps& caps, size_t* insn_len = nullptr);

struct PlaceOptions {
  KernelCaps caps = KernelCaps::running();
  // code holds the whole function (symbol size): every direct branch in it is
  // checked for a target inside the entry path. Otherwise only the bytes given.
  bool whole_function = false;
  // Offsets from the entry that other code is known to branch to (e.g. found by
  // scanning the object, see incoming_branch_targets in allocators.h).
  std::vector<uint64_t> incoming_targets;
  Isa isa = kHostIsa;
};

// code: bytes of the function starting at its entry (at least 64 if available),
// addr: runtime/ELF address of code[0] (for printing branch targets).
Placement choose_entry_offset(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs);
Placement choose_entry_offset(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs,
                              const PlaceOptions& opts);

// Where the uretprobe of the same function goes. A return probe hijacks the
// return address at [rsp] when its breakpoint is hit, so it must sit where
// rsp_adjust == 0; at the entry probe's own offset when possible, so that one
// trap (emulated) serves both consumers. Otherwise at the function entry.
// arm64: the kernel replaces x30 when the return probe is hit, so x30 must
// not have been saved before it either.
inline uint64_t return_probe_offset(const Placement& p) {
  return p.rsp_adjust == 0 && !p.lr_saved ? p.offset : 0;
}

// True if the running kernel emulates this instruction for uprobes (x86-64).
bool kernel_emulates(const uint8_t* insn, size_t len);
bool kernel_emulates(const uint8_t* insn, size_t len, const KernelCaps& caps);

// arm64 (probe_placement_arm64.cpp): what arm_probe_decode_insn does with one
// instruction word; *why gets the kernel's class of it ("cbz/cbnz",
// "exclusive load/store", ...). The text of it (hints by name: bti c, paciasp).
Verdict arm64_kernel_verdict(uint32_t insn, const KernelCaps& caps, std::string* why = nullptr);
std::string arm64_text(uint32_t insn, uint64_t addr);
// Addresses in [lo, hi) that a direct branch (b, bl, b.cond, cbz/cbnz,
// tbz/tbnz) in code (at code_addr) targets.
std::vector<uint64_t> arm64_branch_targets(const std::vector<uint8_t>& code, uint64_t code_addr, uint64_t lo,
                                           uint64_t hi);
Placement choose_entry_offset_arm64(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs,
                                    const PlaceOptions& opts);

// One line for --explain-probes: "+0x3 je 0x98fb8: emulated (jcc); return
// address at [rsp+0]; skips test rdi, rdi; <reason>".
std::string describe(const Placement& p);

}  // namespace memtrace::probes
