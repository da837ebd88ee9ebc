// Launch mode: start the program held before exec, let the tracer arm the
// BPF side for its pid, then release it (STYLE.md #7). The exec itself is
// then stopped by BPF until the allocator probes are attached, so even
// allocations made before main() are seen.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::loader {

class Launcher {
 public:
  // Whether prog can be exec'd as execvp would find it (PATH when it has
  // no '/'): checked before anything is loaded or traced, so that a program
  // that cannot start costs one line ("cannot execute X: ...") and exit 2.
  static Result<void> check_executable(const std::string& prog);
  // Forks; the child waits for release() and then exec's argv.
  static Result<Launcher> start(const std::vector<std::string>& argv);
  Launcher(Launcher&&) = default;
  ~Launcher();

  pid_t pid() const { return pid_; }
  // Lets the child exec. Returns an error if exec failed ("cannot execute X: ...").
  Result<void> release();
  // release() found that the exec failed: the program never ran.
  bool exec_failed() const { return exec_failed_; }
  // Non-blocking: true once the child has exited; status in wait-status form.
  bool poll_exit(int* status);
  // Exit code the tool should return for a wait status.
  static int exit_code_of(int status);

 private:
  Launcher() = default;
  pid_t pid_ = -1;
  Fd go_;    // write end: one byte releases the child
  Fd err_;   // read end: errno from a failed exec (CLOEXEC: EOF on success)
  std::string prog_;
  bool reaped_ = false;
  bool exec_failed_ = false;
};

}  // namespace memtrace::loader
