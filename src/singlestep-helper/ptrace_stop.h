// The waitpid status of a ptraced thread, named (STYLE.md #6, after rr's WaitStatus).
#pragma once
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/wait.h>

namespace memtrace::singlestep {

class Stop {
 public:
  enum Kind { kExit, kFatalSignal, kSignal, kSyscall, kEvent, kGroupStop };
  explicit Stop(int status) : s_(status) {}
  int raw() const { return s_; }
  Kind kind() const {
    if (WIFEXITED(s_)) return kExit;
    if (WIFSIGNALED(s_)) return kFatalSignal;
    int sig = WSTOPSIG(s_);
    if (sig == (SIGTRAP | 0x80)) return kSyscall;
    int ev = s_ >> 16;
    if (ev == PTRACE_EVENT_STOP) return sig == SIGTRAP ? kEvent : kGroupStop;
    if (ev) return kEvent;
    return kSignal;
  }
  bool gone() const { return kind() == kExit || kind() == kFatalSignal; }
  int exit_code() const { return WIFEXITED(s_) ? WEXITSTATUS(s_) : 128 + WTERMSIG(s_); }
  int sig() const { return WSTOPSIG(s_); }       // kSignal, kGroupStop
  int event() const { return (s_ >> 16) & 0xff; }  // kEvent: PTRACE_EVENT_*

 private:
  int s_;
};

}  // namespace memtrace::singlestep
