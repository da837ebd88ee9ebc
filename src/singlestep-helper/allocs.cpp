// --track-allocs-from FUNCTION: placeholder until implemented.
#include "allocs.h"

#include <signal.h>

namespace memtrace::singlestep {

// AllocState: allocs.h

Result<void> Tracer::arm_alloc_tracking() { return Error::msg("--track-allocs-from is not implemented yet"); }
void Tracer::alloc_breakpoint(pid_t tid, user_regs_struct& regs) { threads_[tid].resume_sig = SIGTRAP; }
void Tracer::disarm_alloc_tracking(pid_t tid) {}

}  // namespace memtrace::singlestep
