// Make a running process load a shared library, from outside, without gdb:
// every thread is stopped (PTRACE_SEIZE + PTRACE_INTERRUPT), the main thread
// is made to call dlopen(path, RTLD_NOW) (found in the process's libc through
// src/elf and src/procfs) with the path written on its stack below the red
// zone and a return address of 0 (the return traps: SIGSEGV at rip 0); its
// registers and the stack bytes are put back and every thread is detached.
//
//   auto h = inject::load_library(pid, "/usr/lib/libmemtrace_agent.so");
//   if (!h) ... h.error().message  ("dlopen in pid 123: ...: cannot open shared object file")
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"

namespace memtrace::inject {

// A process held stopped under ptrace by the calling thread (every thread
// seized); let go (detached, its pending signals handed back) when it goes.
class StoppedProcess;
struct HeldDeleter {
  void operator()(StoppedProcess* p) const;
};
using Held = std::unique_ptr<StoppedProcess, HeldDeleter>;

struct LoadStats {
  uint64_t threads = 0;     // threads stopped
  uint64_t stopped_us = 0;  // how long the process was stopped
  uint64_t call_us = 0;     // the dlopen call itself (the agent's constructor in it)
  uint64_t busy_retries = 0;  // stops of the main thread found inside the loader or the allocator
  uint64_t stack_scans = 0;   // of the checks, those whose unwind stopped early: the rest of the stack scanned (busy_frames.h)
  bool reattached = false;    // the agent was there already: memtrace_agent_attach, not dlopen
  pid_t caller = 0;           // the thread that made the call (the main thread unless it stayed busy)
};

// How long stopping every thread of a process may take (a thread in D
// state does not stop), and how many listings of its threads it may make
// (threads started meanwhile are stopped by the next; the last must find
// none new: no thread runs while the entries are written).
struct StopLimits {
  int timeout_ms = 2000;
  int rounds = 100;
};

// fn(the ids of pid's threads) while every one of them is stopped (seized
// and interrupted here, let go after; or held's: those not stopped yet are
// added to it); no thread runs code of the process meanwhile. An error
// naming the thread, nothing run and every thread stopped here let go,
// when one did not stop within lim.timeout_ms (it is detached when it
// stops, at the next call or StoppedProcess's end) or new threads kept
// starting for lim.rounds listings.
Result<void> with_threads_stopped(pid_t pid, StoppedProcess* held,
                                  const std::function<Result<void>(const std::vector<pid_t>&)>& fn,
                                  const StopLimits& lim = {});
// Threads a failed stop left seized (they did not stop in time) and that
// have stopped since, let go; call it now and then from the thread that
// stops processes (only it may detach them): else they stay stopped until
// its next stop or its end. Cheap when there are none.
void release_late_threads();
// held's threads let go but the one it stopped first (load_library's
// caller, hold_at_entry's main thread).
void release_others(StoppedProcess& held);

// What the attach knows of the process already, handed to every step of
// it (the agent's load, the deadlock-window check, the entry trampolines)
// instead of each reading /proc/PID/maps again: one snapshot, taken by the
// caller before anything is done to the process.
struct ProcessView {
  std::vector<procfs::Mapping> maps;  // /proc/PID/maps (procfs::read_maps)
  // Code besides glibc's whose locks the agent's dlopen may need: a
  // non-glibc allocator's (jemalloc, tcmalloc, mimalloc: a thread inside
  // one may hold an arena's lock, and dlopen allocates). [lo, hi).
  std::vector<std::pair<uint64_t, uint64_t>> busy_extra;
  static Result<ProcessView> read(pid_t pid);
};

// Called after a successful call, while its caller is still stopped
// (load_library, attach_agent).
using AfterCall = std::function<void(StoppedProcess&)>;

// Why pid cannot take the agent, checked before any ptrace (nothing of
// the process is touched): it runs under seccomp (the agent's open and
// mmap, dlopen's, may be refused or kill it), or ptrace is disabled
// (Yama ptrace_scope 3). Success: no reason known.
Result<void> can_inject(pid_t pid);

// Where the agent's files go for pid: "" when it shares our root, else
// "/proc/PID/root" (a chroot's process: the ring and a copy of the agent
// are made in its /dev/shm, seen there as /dev/shm/...). An error for a
// process in another PID namespace (a container's: its getpid() names
// another ring), a root without /dev/shm, or without libunwind.so.8.
Result<std::string> agent_root(pid_t pid);

// A process just exec'd and stopped (SIGSTOP: BPF's stop at exec), run
// under ptrace to its entry point (AT_ENTRY: ld.so has loaded, relocated
// and initialized its libraries, so dlopen works; none of the program's
// own code has run) and held there. A static program (no ld.so: AT_BASE
// 0) is refused before anything is done to it. The process stops again
// when it is let go (its group stop stays in effect): SIGCONT runs it.
// on_stop: called at each SIGSTOP on the way (BPF's stop at a new
// executable mapping: the tracer attaches uprobes to the allocator there),
// which is then not delivered.
Result<Held> hold_at_entry(pid_t pid, int timeout_ms = 10000, const std::function<void()>& on_stop = {});

// The handle dlopen returned in the target (non-zero), or why not.
// timeout_ms: how long the call may take; past it the attempt is abandoned
// (the thread is interrupted, its registers restored: a dlopen stopped half
// way may leave the target's loader lock taken; said in the error).
// held: the process is already stopped by hold_at_entry (else every
// thread is seized here and let go at the end).
// view: the process's maps as the caller read them (nullptr: read here).
Result<uint64_t> load_library(pid_t pid, const std::string& path, LoadStats* stats = nullptr,
                              int timeout_ms = 10000, StoppedProcess* held = nullptr, const AfterCall& after = {},
                              const ProcessView* view = nullptr);

// The path of libmemtrace_agent.so as pid maps it (an earlier --inject
// loaded it), or none.
std::optional<std::string> agent_mapped(pid_t pid);
std::optional<std::string> agent_mapped(const std::vector<procfs::Mapping>& maps);

// A later --inject into a process that has the agent (agent_mapped): its
// exported memtrace_agent_attach is called on the main thread, as dlopen
// would be (the constructor does not run again); what it returned (0:
// hooked, 1: no ring for the process, 2: refused, the ring says why).
Result<uint64_t> attach_agent(pid_t pid, const std::string& mapped, LoadStats* stats = nullptr,
                              int timeout_ms = 10000, StoppedProcess* held = nullptr, const AfterCall& after = {},
                              const ProcessView* view = nullptr);

// Address of a function of the target's libc (dlopen, dlerror) in pid:
// the file's symbol placed in the mapping that holds its file offset.
Result<uint64_t> libc_function(pid_t pid, const std::string& name, const std::vector<procfs::Mapping>* maps = nullptr);

}  // namespace memtrace::inject
