// Where to put an entry uprobe so that the kernel emulates the probed
// instruction instead of single-stepping it out of line (DESIGN.md: 0.7 us vs
// 14-17 us per hit). CONTRACT with the loader (keep these names; add freely).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace memtrace::probes {

// What the BPF program at the probe must know to read its inputs correctly.
struct Placement {
  uint64_t offset = 0;        // bytes from function start
  std::string insn;           // "je 0x98fb8" (the instruction at offset)
  std::string reason;         // one line, for --explain-probes
  int32_t rsp_adjust = 0;     // bytes pushed/subtracted before offset: return address is at [rsp + rsp_adjust]
  bool emulated = false;      // the kernel emulates the instruction at offset
};

// Which argument registers the BPF program reads (the chosen instruction must
// come before anything that writes them). Bit i = argument i (rdi, rsi, rdx, rcx, r8, r9).
// reads_rsp: the program reads the return address at [rsp].
struct Needs {
  uint32_t arg_mask = 0x1;
  bool reads_rsp = true;
  bool reads_rbp = true;  // frame-pointer stack walk starts at rbp
};

// code: bytes of the function starting at its entry (at least 64 if available),
// addr: runtime/ELF address of code[0] (for printing branch targets).
Placement choose_entry_offset(const std::vector<uint8_t>& code, uint64_t addr, const Needs& needs);

// True if the running kernel emulates this instruction for uprobes (x86-64).
bool kernel_emulates(const uint8_t* insn, size_t len);

}  // namespace memtrace::probes
