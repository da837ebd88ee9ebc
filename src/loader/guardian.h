// The guardian: a small process that outlives the loader and resumes every
// process the BPF side stopped for it (exec, fork, new code mapped) if the
// loader dies without doing so itself (SIGKILL, the OOM killer, a crash).
//
// The BPF side stops a process only after it put its tgid in the `stopped`
// map (bpf/memtrace.bpf.c); the loader deletes the entry when it resumes the
// process. The guardian holds the two maps and one end of a socket whose
// other end only the loader holds. When that end closes (the kernel closes it
// whatever way the loader ends) the guardian sets `loader_gone` (no new
// stops from then on), sends SIGCONT to every tgid left in `stopped`, again
// until the loader is gone and 320 ms after, and to every traced process
// (`targets`) it finds stopped then; and exits.
//
// It also closes the BPF links the loader is done with (hand_over): the
// kernel detaches a uprobe or a tracepoint in its last close, across an RCU
// grace period (~70-100 ms each here), so that the loader writes its report
// and exits without waiting for them. The links of one hand_over are closed
// in order on a thread of their own, the hand_overs in parallel; the
// guardian exits once every one is closed.
#pragma once
#include <sys/types.h>

#include <vector>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::loader {

class Guardian {
 public:
  // Forks the guardian. Call it early: before threads and large mappings
  // (the child is a copy of the loader at this point).
  static Result<Guardian> start();
  Guardian(Guardian&&) = default;
  Guardian& operator=(Guardian&&) = default;

  // Hands it the maps, once they exist and before anything can be stopped.
  Result<void> arm(int stopped_map_fd, int loader_gone_map_fd, int targets_map_fd);
  // Sends the guardian its own references to fds (links), to close; the
  // caller closes its own (no longer the last: fast). After arm() only.
  Result<void> hand_over(const std::vector<int>& fds);
  pid_t pid() const { return pid_; }

 private:
  Guardian() = default;
  pid_t pid_ = -1;
  Fd sock_;  // closed by the kernel when the loader ends, however it ends
};

}  // namespace memtrace::loader
