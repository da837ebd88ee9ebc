// --track-allocs-from on an architecture whose allocator breakpoints are not
// written yet (aarch64: allocs.cpp plants x86's int3 and reads the System V
// x86-64 argument registers). One line, as for anything else the tool cannot
// do there (docs/arm64.md).
#include "allocs.h"

namespace memtrace::singlestep {

Result<void> Tracer::arm_alloc_tracking() {
  return Error::msg(std::string("not supported on ") + arch::kName + " yet: --track-allocs-from");
}
void Tracer::alloc_breakpoint(pid_t, Regs&) {}
void Tracer::disarm_alloc_tracking(pid_t) {}

}  // namespace memtrace::singlestep
