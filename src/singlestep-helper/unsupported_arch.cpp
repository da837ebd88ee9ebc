// memtrace-singlestep on an architecture whose single-step helper is not
// written yet (aarch64: load/store decoding, PTRACE_GETREGSET registers,
// NT_ARM_HW_WATCH watchpoints; docs/arm64.md). One line, exit 2, as for any
// other thing the tool cannot do here.
#include <cstdio>

int main() {
  std::fprintf(stderr,
               "memtrace-singlestep: not supported on aarch64 yet: single-step helper (track: arm64 load/store "
               "decoding, PTRACE_GETREGSET, NT_ARM_HW_WATCH)\n");
  return 2;
}
