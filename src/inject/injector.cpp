#include "inject/injector.h"

#include <dirent.h>
#include <elf.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/auxv.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "elf/elf_file.h"
#include "inject/busy_frames.h"
#include "procfs/proc_maps.h"

namespace memtrace::inject {
namespace {

// A waitpid status of a traced thread, named (STYLE.md #6).
struct Stop {
  enum Kind { Exited, Killed, EventStop, SignalStop } kind;
  int sig = 0;  // SignalStop: the signal; EventStop: WSTOPSIG
  static Stop of(int st) {
    if (WIFEXITED(st)) return {Exited, WEXITSTATUS(st)};
    if (WIFSIGNALED(st)) return {Killed, WTERMSIG(st)};
    if ((st >> 16) == PTRACE_EVENT_STOP) return {EventStop, WSTOPSIG(st)};
    return {SignalStop, WSTOPSIG(st)};
  }
};

std::string base_name(const std::string& p) { return p.substr(p.rfind('/') + 1); }

std::vector<pid_t> task_ids(pid_t pid) {
  std::vector<pid_t> out;
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (auto* e = readdir(d))
    if (e->d_name[0] >= '0' && e->d_name[0] <= '9') out.push_back(atoi(e->d_name));
  closedir(d);
  return out;
}

// waitpid, again when a signal interrupts it (the loader's handlers have
// no SA_RESTART).
pid_t wait_retry(pid_t tid, int* st, int flags) {
  pid_t w;
  do w = waitpid(tid, st, flags);
  while (w < 0 && errno == EINTR);
  return w;
}

// Threads seized and interrupted whose stop did not come in time (a thread
// in D state): each stops when it leaves that state and is detached then
// (reap_late: at the next stop_all and at every StoppedProcess's end).
// Per thread of this process: only the thread that seized may detach.
thread_local std::set<pid_t> t_late;

void reap_late() {
  for (auto it = t_late.begin(); it != t_late.end();) {
    int st = 0;
    pid_t w = waitpid(*it, &st, __WALL | WNOHANG);
    if (w == 0 || (w < 0 && errno == EINTR)) {
      ++it;
      continue;
    }
    if (w == *it) {
      Stop s = Stop::of(st);
      if (s.kind == Stop::EventStop || s.kind == Stop::SignalStop)
        ptrace(PTRACE_DETACH, *it, nullptr, reinterpret_cast<void*>(intptr_t(s.kind == Stop::SignalStop ? s.sig : 0)));
    }
    it = t_late.erase(it);  // detached, ended, or not ours any more (ECHILD)
  }
}

std::string thread_state(pid_t tid) {
  std::ifstream f("/proc/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(f, line);
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return "?";
  return std::string(1, line[close + 2]);
}

}  // namespace

// Every thread of a process, seized and stopped; detached (with the signals
// that arrived meanwhile handed back) when it goes out of scope.
class StoppedProcess {
 public:
  explicit StoppedProcess(pid_t pid) : pid_(pid) {}
  StoppedProcess(const StoppedProcess&) = delete;
  StoppedProcess& operator=(const StoppedProcess&) = delete;
  ~StoppedProcess() {
    for (auto& [tid, sig] : threads_) ptrace(PTRACE_DETACH, tid, nullptr, reinterpret_cast<void*>(intptr_t(sig)));
    reap_late();
  }

  // Seize and interrupt threads until a listing finds none new (threads
  // started during the attach are caught by the next round). An error, and
  // every thread stopped here let go, when a thread does not stop within
  // lim.timeout_ms (it is detached when it stops: reap_late) or the last
  // of lim.rounds listings still found new ones.
  Result<void> stop_all(const StopLimits& lim = {}) {
    reap_late();
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(lim.timeout_ms);
    std::set<pid_t> before;
    for (const auto& [tid, sig] : threads_) before.insert(tid);
    std::string who = "pid " + std::to_string(pid_);
    auto fail = [&](Error e) -> Result<void> {
      for (auto it = threads_.begin(); it != threads_.end();) {
        if (before.count(it->first)) {
          ++it;
          continue;
        }
        ptrace(PTRACE_DETACH, it->first, nullptr, reinterpret_cast<void*>(intptr_t(it->second)));
        it = threads_.erase(it);
      }
      if (!threads_.count(first_)) first_ = 0;
      return e;
    };
    bool settled = false;
    for (int round = 0; round < lim.rounds && !settled; round++) {
      std::vector<pid_t> pending;
      for (pid_t tid : task_ids(pid_)) {
        if (threads_.count(tid) || gone_.count(tid)) continue;
        if (t_late.count(tid)) {  // seized and interrupted by an earlier call: its stop may come now
          t_late.erase(tid);
          pending.push_back(tid);
          continue;
        }
        if (ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
          if (errno == ESRCH) {
            gone_.insert(tid);
            continue;
          }
          Error e = Error::sys("ptrace(PTRACE_SEIZE) thread " + std::to_string(tid) + " of " + who);
          return fail(e);
        }
        if (ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0) {
          gone_.insert(tid);  // ending: reaped (a traced thread's exit waits for its tracer)
          t_late.insert(tid);
          continue;
        }
        pending.push_back(tid);
      }
      settled = pending.empty();
      while (!pending.empty()) {
        for (auto it = pending.begin(); it != pending.end();) {
          int st = 0;
          pid_t w = waitpid(*it, &st, __WALL | WNOHANG);
          if (w == 0 || (w < 0 && errno == EINTR)) {
            ++it;
            continue;
          }
          pid_t tid = *it;
          it = pending.erase(it);
          if (w < 0) {  // not ours any more
            gone_.insert(tid);
            continue;
          }
          Stop s = Stop::of(st);
          if (s.kind == Stop::Exited || s.kind == Stop::Killed) {
            gone_.insert(tid);
            continue;
          }
          // A signal that stopped it before the interrupt goes back at detach.
          threads_[tid] = s.kind == Stop::SignalStop ? s.sig : 0;
          if (!first_) first_ = tid;
        }
        if (pending.empty()) break;
        if (std::chrono::steady_clock::now() > deadline) {
          for (pid_t tid : pending) t_late.insert(tid);
          pid_t t = pending.front();
          return fail(Error::msg(who + ": thread " + std::to_string(t) + " did not stop within " +
                                 std::to_string(lim.timeout_ms) + " ms (state " + thread_state(t) +
                                 "); every thread let go (that one when it stops)"));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    if (!settled)
      return fail(Error::msg(who + ": new threads still started after " + std::to_string(lim.rounds) +
                             " listings of its threads; every thread let go"));
    if (!threads_.count(pid_)) return fail(Error::msg(who + ": its main thread could not be stopped"));
    return {};
  }
  // Only tid (the thread that will make the call): the others run on
  // (load_library: while they run, no lock they hold can block the call).
  Result<void> stop_one(pid_t tid) {
    if (ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0)
      return Error::sys("ptrace(PTRACE_SEIZE) thread " + std::to_string(tid) + " of pid " + std::to_string(pid_));
    threads_[tid] = 0;
    first_ = tid;
    if (ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0) return Error::sys("ptrace(PTRACE_INTERRUPT)");
    return wait_interrupted(tid);
  }
  // tid (stopped) runs for about us microseconds and is stopped again;
  // signals that arrive meanwhile are delivered to it as they come.
  Result<void> run_briefly(pid_t tid, int us) {
    if (ptrace(PTRACE_CONT, tid, nullptr, nullptr) != 0) return Error::sys("ptrace(PTRACE_CONT)");
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    if (ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0) return Error::sys("ptrace(PTRACE_INTERRUPT)");
    return wait_interrupted(tid);
  }
  // tid let go (detached, its pending signal handed back).
  void release(pid_t tid) {
    auto it = threads_.find(tid);
    if (it == threads_.end()) return;
    ptrace(PTRACE_DETACH, tid, nullptr, reinterpret_cast<void*>(intptr_t(it->second)));
    threads_.erase(it);
  }
  size_t count() const { return threads_.size(); }
  // Every thread but the first one stopped (the caller) let go.
  void release_others() {
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (it->first == first_) {
        ++it;
        continue;
      }
      ptrace(PTRACE_DETACH, it->first, nullptr, reinterpret_cast<void*>(intptr_t(it->second)));
      it = threads_.erase(it);
    }
  }
  std::vector<pid_t> tids() const {
    std::vector<pid_t> out;
    for (const auto& [tid, sig] : threads_) out.push_back(tid);
    return out;
  }
  // A signal for tid that arrived during the call: handed back at detach.
  void keep_signal(pid_t tid, int sig) {
    auto& s = threads_[tid];
    if (!s) s = sig;
    else extra_.push_back({tid, sig});
  }
  // Until tid's interrupt stop; signal stops on the way are delivered (the
  // interrupt stays pending).
  Result<void> wait_interrupted(pid_t tid) {
    for (;;) {
      int st = 0;
      if (wait_retry(tid, &st, __WALL) != tid) return Error::sys("waitpid");
      Stop s = Stop::of(st);
      if (s.kind == Stop::Exited || s.kind == Stop::Killed) {
        threads_.erase(tid);
        return Error::msg("thread " + std::to_string(tid) + " ended");
      }
      if (s.kind == Stop::EventStop) return {};
      if (ptrace(PTRACE_CONT, tid, nullptr, reinterpret_cast<void*>(intptr_t(s.sig))) != 0)
        return Error::sys("ptrace(PTRACE_CONT)");
    }
  }
  void resend_extra() {
    for (auto& [tid, sig] : extra_) syscall(SYS_tgkill, pid_, tid, sig);
  }

 private:
  pid_t pid_;
  pid_t first_ = 0;               // the thread stopped first (the caller): release_others keeps it
  std::map<pid_t, int> threads_;  // tid -> signal to deliver at detach
  std::set<pid_t> gone_;
  std::vector<std::pair<pid_t, int>> extra_;
};

void HeldDeleter::operator()(StoppedProcess* p) const { delete p; }

void release_others(StoppedProcess& sp) { sp.release_others(); }

void release_late_threads() { reap_late(); }

Result<void> with_threads_stopped(pid_t pid, StoppedProcess* held,
                                  const std::function<Result<void>(const std::vector<pid_t>&)>& fn,
                                  const StopLimits& lim) {
  if (held) {
    // The others too (load_library stops only its caller).
    if (auto r = held->stop_all(lim); !r) return r.error();
    return fn(held->tids());
  }
  StoppedProcess sp(pid);
  if (auto r = sp.stop_all(lim); !r) return r.error();
  auto out = fn(sp.tids());
  sp.resend_extra();
  return out;
}

namespace {

Result<void> mem_io(int fd, uint64_t addr, void* buf, size_t len, bool write) {
  ssize_t n = write ? pwrite(fd, buf, len, static_cast<off_t>(addr)) : pread(fd, buf, len, static_cast<off_t>(addr));
  if (n != static_cast<ssize_t>(len)) return Error::sys(std::string(write ? "write" : "read") + " target memory");
  return {};
}

// Calls fn(arg0, arg1) on thread tid (stopped) and returns its rax. Memory
// [rsp - 256 - len(str) - 24, rsp) and every register are put back.
// str, when given, is copied below the red zone and passed as arg0.
#if !defined(__x86_64__)
Result<uint64_t> remote_call(StoppedProcess&, pid_t, int, uint64_t, const std::string*, uint64_t, uint64_t, int) {
  return Error::msg("not supported on this architecture yet: --inject (the remote call is x86-64 only)");
}
#else
Result<uint64_t> remote_call(StoppedProcess& sp, pid_t tid, int mem, uint64_t fn, const std::string* str,
                             uint64_t arg0, uint64_t arg1, int timeout_ms) {
  user_regs_struct saved{};
  if (ptrace(PTRACE_GETREGS, tid, nullptr, &saved) != 0) return Error::sys("ptrace(PTRACE_GETREGS)");
  uint64_t top = saved.rsp - 256;  // the red zone is 128 bytes: more room is free
  uint64_t str_at = top;
  if (str) {
    str_at = (top - str->size() - 1) & ~uint64_t{15};
    arg0 = str_at;
  } else {
    str_at &= ~uint64_t{15};
  }
  uint64_t rsp = str_at - 8;  // the return address; rsp + 8 is 16-aligned at the entry, as the ABI wants
  std::vector<char> old(saved.rsp - rsp);
  if (auto r = mem_io(mem, rsp, old.data(), old.size(), false); !r) return r.error();
  std::vector<char> frame(old.size(), 0);  // return address 0: the return faults at rip 0
  if (str) memcpy(frame.data() + (str_at - rsp), str->c_str(), str->size() + 1);
  if (auto r = mem_io(mem, rsp, frame.data(), frame.size(), true); !r) return r.error();

  user_regs_struct regs = saved;
  regs.rip = fn;
  regs.rdi = arg0;
  regs.rsi = arg1;
  regs.rax = 0;
  regs.rsp = rsp;
  // Not inside a syscall any more: no restart logic may move rip back by
  // 2 on the way out (the saved registers, put back below, keep theirs).
  regs.orig_rax = static_cast<unsigned long long>(-1);
  auto put_back = [&] {
    (void)mem_io(mem, rsp, old.data(), old.size(), true);
    ptrace(PTRACE_SETREGS, tid, nullptr, &saved);
  };
  if (ptrace(PTRACE_SETREGS, tid, nullptr, &regs) != 0) {
    put_back();
    return Error::sys("ptrace(PTRACE_SETREGS)");
  }
  if (ptrace(PTRACE_CONT, tid, nullptr, nullptr) != 0) {
    put_back();
    return Error::sys("ptrace(PTRACE_CONT)");
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int st = 0;
    pid_t w = waitpid(tid, &st, __WALL | WNOHANG);
    if (w == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr);
        wait_retry(tid, &st, __WALL);
        put_back();
        return Error::msg("the call did not return within " + std::to_string(timeout_ms) +
                          " ms (a lock held by another thread?); abandoned, the target's loader lock may stay taken");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return Error::sys("waitpid");
    Stop s = Stop::of(st);
    if (s.kind == Stop::Exited || s.kind == Stop::Killed)
      return Error::msg("the process ended during the call (" +
                        std::string(s.kind == Stop::Exited ? "exit " + std::to_string(s.sig)
                                                           : std::string("signal ") + strsignal(s.sig)) +
                        ")");
    if (s.kind == Stop::EventStop) {  // an interrupt or group stop: go on
      ptrace(PTRACE_CONT, tid, nullptr, nullptr);
      continue;
    }
    if (s.sig == SIGSEGV) {
      user_regs_struct now{};
      ptrace(PTRACE_GETREGS, tid, nullptr, &now);
      put_back();
      if (now.rip != 0) return Error::msg("the call crashed (SIGSEGV at " + std::to_string(now.rip) + ")");
      return uint64_t{now.rax};
    }
    sp.keep_signal(tid, s.sig);  // not for us: delivered at detach
    ptrace(PTRACE_CONT, tid, nullptr, nullptr);
  }
}
#endif

uint64_t micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

// The main thread: runs of 0.2 ms, 0.25, ... 2.15 ms between its stops
// (~50 ms in all); then each other thread, in up to 40 rounds 0.5-10 ms
// apart (~0.2 s).
constexpr int kMainTries = 40;
constexpr int kOtherRounds = 40;

}  // namespace

namespace {

// Address in pid of function `name` of the file mapped as `path` (or of the
// first mapping whose file name matches is_it): the file's symbol placed in
// the mapping that holds its file offset.
Result<uint64_t> function_in(pid_t pid, const std::function<bool(const procfs::Mapping&)>& is_it,
                             const std::string& what, const std::string& name,
                             const std::vector<procfs::Mapping>* given = nullptr) {
  Result<std::vector<procfs::Mapping>> read = std::vector<procfs::Mapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return read.error();
  }
  const std::vector<procfs::Mapping>* maps = given ? given : &*read;
  const procfs::Mapping* obj = nullptr;
  for (const auto& m : *maps)
    if (m.file() && is_it(m)) {
      obj = &m;
      break;
    }
  if (!obj) return Error::msg("pid " + std::to_string(pid) + " maps no " + what);
  auto elf = elf::ElfFile::open(procfs::openable_path(pid, *obj));
  if (!elf) return elf.error();
  auto sym = elf->find_function(name);
  if (!sym) return Error::msg(obj->path + " defines no " + name);
  for (const auto& m : *maps)
    if (m.dev == obj->dev && m.inode == obj->inode && sym->file_offset >= m.offset &&
        sym->file_offset < m.offset + (m.end - m.start))
      return m.start + (sym->file_offset - m.offset);
  return Error::msg(name + " of " + obj->path + " lies in no mapping of pid " + std::to_string(pid));
}

Result<uint64_t> mapped_function(pid_t pid, const std::string& path, const std::string& name,
                                 const std::vector<procfs::Mapping>* maps) {
  return function_in(pid, [&](const procfs::Mapping& m) { return m.path == path; }, path, name, maps);
}

}  // namespace

Result<ProcessView> ProcessView::read(pid_t pid) {
  auto maps = procfs::read_maps(pid);
  if (!maps) return maps.error();
  ProcessView v;
  v.maps = std::move(*maps);
  return v;
}

Result<uint64_t> libc_function(pid_t pid, const std::string& name, const std::vector<procfs::Mapping>* maps) {
  auto r = function_in(
      pid,
      [](const procfs::Mapping& m) {
        std::string b = base_name(m.path);
        return b.rfind("libc.so", 0) == 0 || b.rfind("libc-2", 0) == 0;
      },
      "libc (a static program?): nothing to call dlopen in", name, maps);
  if (!r && r.error().message.find(" defines no ") != std::string::npos)
    return Error::msg(r.error().message + " (glibc before 2.34 has it in libdl)");
  return r;
}

Result<void> can_inject(pid_t pid) {
  std::string who = "pid " + std::to_string(pid);
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  if (!status) return Error::sys("read /proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Seccomp:", 0) == 0 && atoi(line.c_str() + 8) != 0)
      return Error::msg(who + " runs under seccomp (mode " + std::to_string(atoi(line.c_str() + 8)) +
                        "): the agent's syscalls could be refused or kill it");
  if (auto r = agent_root(pid); !r) return r.error();
  std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  if (yama >> scope && scope >= 3) return Error::msg("ptrace is disabled on this system (Yama ptrace_scope 3)");
  return {};
}

Result<std::string> agent_root(pid_t pid) {
  std::string proc = "/proc/" + std::to_string(pid), who = "pid " + std::to_string(pid);
  struct stat theirs {}, ours {};
  if (stat((proc + "/root").c_str(), &theirs) != 0 || stat("/proc/self/root", &ours) != 0 ||
      (theirs.st_dev == ours.st_dev && theirs.st_ino == ours.st_ino))
    return std::string();
  if (stat((proc + "/ns/pid").c_str(), &theirs) == 0 && stat("/proc/self/ns/pid", &ours) == 0 &&
      (theirs.st_dev != ours.st_dev || theirs.st_ino != ours.st_ino))
    return Error::msg(who + " runs in another PID namespace (a container's): the agent is not placed there yet");
  struct stat shm {};
  if (stat((proc + "/root/dev/shm").c_str(), &shm) != 0 || !S_ISDIR(shm.st_mode))
    return Error::msg(who + " runs in another root (a chroot's) that has no /dev/shm for the agent's ring");
  // The agent finishes with libunwind the stacks the loader's rows do not
  // (its first calls, code mapped later): without it there, those would be cut.
  bool unwinder = false;
  for (const char* dir : {"/usr/lib/x86_64-linux-gnu/", "/lib/x86_64-linux-gnu/", "/usr/lib/", "/lib/"})
    unwinder |= access((proc + "/root" + dir + "libunwind.so.8").c_str(), R_OK) == 0;
  if (!unwinder)
    return Error::msg(who + " runs in another root (a chroot's) without libunwind.so.8, which the agent's stacks need");
  return proc + "/root";
}

Result<Held> hold_at_entry(pid_t pid, int timeout_ms, const std::function<void()>& on_stop) {
  std::string who = "pid " + std::to_string(pid);
  uint64_t entry = 0, base = 0;
  {
    std::ifstream aux("/proc/" + std::to_string(pid) + "/auxv", std::ios::binary);
    uint64_t kv[2];
    while (aux.read(reinterpret_cast<char*>(kv), sizeof kv) && kv[0] != AT_NULL) {
      if (kv[0] == AT_ENTRY) entry = kv[1];
      if (kv[0] == AT_BASE) base = kv[1];
    }
  }
  if (!entry) return Error::msg(who + ": no entry point in /proc/" + std::to_string(pid) + "/auxv (gone?)");
  if (!base) return Error::msg("a static program (no dynamic loader): nothing to call dlopen in");
#if !defined(__x86_64__)
  (void)timeout_ms;
  (void)on_stop;
  return Error::msg("not supported on this architecture yet: --inject at exec (x86-64 only)");
#else
  Held held(new StoppedProcess(pid));
  if (auto r = held->stop_all(); !r) return r.error();
  if (held->count() != 1) return Error::msg(who + ": threads before its entry point (" + std::to_string(held->count()) + ")");
  Fd mem(open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC));
  if (!mem.valid()) return Error::sys("open /proc/" + std::to_string(pid) + "/mem");
  uint8_t orig = 0, trap = 0xcc;
  if (auto r = mem_io(mem.get(), entry, &orig, 1, false); !r) return r.error();
  if (auto r = mem_io(mem.get(), entry, &trap, 1, true); !r) return r.error();
  auto put_back = [&] { (void)mem_io(mem.get(), entry, &orig, 1, true); };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int sig = 0;
  for (;;) {
    if (ptrace(PTRACE_CONT, pid, nullptr, reinterpret_cast<void*>(intptr_t(sig))) != 0) {
      put_back();
      return Error::sys(who + ": ptrace(PTRACE_CONT) to its entry point");
    }
    sig = 0;
    // Peeked first: an exit (ld.so could not load a library) is left for
    // its parent's waitpid, not reaped here.
    siginfo_t si{};
    for (;;) {
      si.si_pid = 0;
      if (waitid(P_PID, pid, &si, WEXITED | WSTOPPED | WNOHANG | WNOWAIT | __WALL) != 0) {
        if (errno == EINTR) continue;
        return Error::sys(who + ": waitid");
      }
      if (si.si_pid == pid) break;
      if (std::chrono::steady_clock::now() > deadline) {
        ptrace(PTRACE_INTERRUPT, pid, nullptr, nullptr);
        int st = 0;
        wait_retry(pid, &st, __WALL);
        put_back();
        return Error::msg(who + ": did not reach its entry point within " + std::to_string(timeout_ms) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (si.si_code == CLD_EXITED || si.si_code == CLD_KILLED || si.si_code == CLD_DUMPED) {
      return Error::msg(who + " ended before its entry point (" +
                        (si.si_code == CLD_EXITED ? "exit " + std::to_string(si.si_status)
                                                  : std::string("signal ") + strsignal(si.si_status)) +
                        ")");
    }
    int st = 0;
    wait_retry(pid, &st, __WALL);
    Stop s = Stop::of(st);
    if (s.kind == Stop::EventStop) continue;  // a group stop, or our interrupt: on
    if (s.kind != Stop::SignalStop) continue;
    if (s.sig == SIGTRAP) {
      user_regs_struct regs{};
      ptrace(PTRACE_GETREGS, pid, nullptr, &regs);
      if (regs.rip == entry + 1) {
        put_back();
        regs.rip = entry;
        if (ptrace(PTRACE_SETREGS, pid, nullptr, &regs) != 0) return Error::sys(who + ": ptrace(PTRACE_SETREGS)");
        return held;
      }
    }
    // SIGSTOP: BPF's stop at a new executable mapping (its allocator):
    // on_stop does what the tracer does at that stop, and the process
    // goes on; any other signal is its own.
    if (s.sig == SIGSTOP) {
      if (on_stop) on_stop();
    } else {
      sig = s.sig;
    }
  }
#endif
}

namespace {

// fn(str, or arg0 if none, arg1) called on a thread of pid that holds no
// lock it could need, or on held's (stopped by hold_at_entry); post(process,
// the thread, /proc/PID/mem, rax) makes the result. where: what the errors
// say it was.
Result<uint64_t> call_on_main(pid_t pid, const std::string& where, uint64_t fn, const std::string* str, uint64_t arg1,
                              LoadStats* stats, int timeout_ms, StoppedProcess* held,
                              const std::function<Result<uint64_t>(StoppedProcess&, pid_t, int, uint64_t)>& post,
                              const AfterCall& after, const ProcessView* view) {
  auto t0 = std::chrono::steady_clock::now();
  Result<uint64_t> out = uint64_t{0};
  {
    Fd mem(open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC));
    if (!mem.valid()) return Error::sys(where + ": open /proc/" + std::to_string(pid) + "/mem");
    std::optional<StoppedProcess> own;
    pid_t caller = pid;
    if (!held) {
      // Only the calling thread is stopped: it makes the call while the
      // others run on, so a lock one of them holds (the loader's, an
      // arena's) is released as it would be. The caller itself must hold
      // none: while the main thread's pc or the return address of one of
      // its live frames (unwound with CFI: busy_frames.h) is in code that
      // takes them, it runs a little more and is stopped again; then each
      // other thread is tried in turn, stopped alone (issue 21, item 8).
      own.emplace(pid);
      if (auto r = own->stop_one(pid); !r) return Error{where + ": " + r.error().message, r.error().err};
#if defined(__x86_64__)
      auto busy = BusyFrames::open(pid, view);
      if (!busy) return Error{where + ": " + busy.error().message, busy.error().err};
      std::string why;
      int tries = 0;
      for (; tries < kMainTries; tries++) {
        why = (*busy)->reason(pid, mem.get());
        if (why.empty()) break;
        if (auto r = own->run_briefly(pid, 200 + 50 * tries); !r) return Error{where + ": " + r.error().message, r.error().err};
      }
      if (!why.empty()) {
        own->release(pid);  // it may hold the lock: it runs while another thread calls
        caller = 0;
        for (int round = 0; round < kOtherRounds && !caller; round++) {
          (*busy)->refresh_maps();  // threads started since: their stacks
          for (pid_t tid : task_ids(pid)) {
            if (tid == pid) continue;
            if (!own->stop_one(tid)) {
              own->release(tid);
              continue;
            }
            tries++;
            why = (*busy)->reason(tid, mem.get());
            if (why.empty()) {
              caller = tid;
              break;
            }
            own->release(tid);
          }
          if (!caller) std::this_thread::sleep_for(std::chrono::microseconds(500 + 250 * round));
        }
      }
      if (stats) stats->busy_retries = static_cast<uint64_t>(tries);
      if (stats) stats->stack_scans = (*busy)->scans();
      if (!caller)
        return Error::msg(where + ": its threads were inside the dynamic loader or the allocator at each of " +
                          std::to_string(tries) + " stops over " + std::to_string(micros_since(t0) / 1000) +
                          " ms (last: " + why + "): a lock the call needs could be held, not injected");
#endif
    }
    StoppedProcess& sp = held ? *held : *own;
    if (stats) stats->threads = sp.count();
    if (stats) stats->caller = caller;
    auto t1 = std::chrono::steady_clock::now();
    auto h = remote_call(sp, caller, mem.get(), fn, str, 0, arg1, timeout_ms);
    if (stats) stats->call_us = micros_since(t1);
    if (!h) out = Error{where + ": " + h.error().message, h.error().err};
    else out = post(sp, caller, mem.get(), *h);
    // The caller still stopped: what must be done before it runs on.
    if (out && after) after(sp);
    sp.resend_extra();
  }
  if (stats) stats->stopped_us = micros_since(t0);
  return out;
}

}  // namespace

Result<uint64_t> load_library(pid_t pid, const std::string& path, LoadStats* stats, int timeout_ms,
                              StoppedProcess* held, const AfterCall& after, const ProcessView* view) {
  std::string where = "dlopen(" + path + ") in pid " + std::to_string(pid);
  std::optional<ProcessView> own;
  if (!view) {
    auto v = ProcessView::read(pid);
    if (!v) return Error{where + ": " + v.error().message, v.error().err};
    own.emplace(std::move(*v));
    view = &*own;
  }
  auto dl = libc_function(pid, "dlopen", &view->maps);
  if (!dl) return Error{where + ": " + dl.error().message, dl.error().err};
  auto dlerr = libc_function(pid, "dlerror", &view->maps);
  return call_on_main(pid, where, *dl, &path, RTLD_NOW, stats, timeout_ms, held,
                      [&](StoppedProcess& sp, pid_t tid, int mem, uint64_t h) -> Result<uint64_t> {
                        if (h) return h;
                        std::string why = "dlopen returned NULL";
                        if (dlerr) {
                          auto msg = remote_call(sp, tid, mem, *dlerr, nullptr, 0, 0, timeout_ms);
                          if (msg && *msg) {
                            char buf[512] = {0};
                            if (pread(mem, buf, sizeof buf - 1, static_cast<off_t>(*msg)) > 0) why = buf;
                          }
                        }
                        return Error::msg(where + ": " + why);
                      },
                      after, view);
}

std::optional<std::string> agent_mapped(const std::vector<procfs::Mapping>& maps) {
  for (const auto& m : maps)
    if (m.file() && base_name(m.path).rfind("libmemtrace_agent", 0) == 0) return m.path;
  return std::nullopt;
}

std::optional<std::string> agent_mapped(pid_t pid) {
  auto maps = procfs::read_maps(pid);
  if (!maps) return std::nullopt;
  return agent_mapped(*maps);
}

Result<uint64_t> attach_agent(pid_t pid, const std::string& mapped, LoadStats* stats, int timeout_ms,
                              StoppedProcess* held, const AfterCall& after, const ProcessView* view) {
  std::string where = "memtrace_agent_attach of " + mapped + " in pid " + std::to_string(pid);
  auto fn = mapped_function(pid, mapped, "memtrace_agent_attach", view ? &view->maps : nullptr);
  if (!fn)
    return Error::msg("pid " + std::to_string(pid) + " has " + mapped +
                      " loaded by an earlier --inject, without memtrace_agent_attach (an older build): " +
                      fn.error().message);
  return call_on_main(pid, where, *fn, nullptr, 0, stats, timeout_ms, held,
                      [](StoppedProcess&, pid_t, int, uint64_t r) -> Result<uint64_t> { return r & 0xffffffff; },
                      after, view);
}

}  // namespace memtrace::inject
