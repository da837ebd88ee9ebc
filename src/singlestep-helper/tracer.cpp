#include "tracer.h"

#include <dirent.h>
#include <elf.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "allocs.h"
#include "hw_watch.h"
#include "ptrace_stop.h"

// <sys/ptrace.h> and <linux/ptrace.h> disagree on a few names; use raw numbers.
#ifndef PTRACE_GET_SYSCALL_INFO_NR
#define PTRACE_GET_SYSCALL_INFO_NR 0x420e
#endif

namespace memtrace::singlestep {

std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_deadline_passed{false};

namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kSlotSize = 256 * 1024;
constexpr int kSlots = 8;
constexpr long kOptions = PTRACE_O_TRACECLONE | PTRACE_O_TRACEEXEC | PTRACE_O_TRACESYSGOOD;

uint64_t page_of(uint64_t a) { return a & ~(kPage - 1); }

long pt(int req, pid_t tid, uint64_t addr, uint64_t data) {
  return ptrace(static_cast<__ptrace_request>(req), tid, reinterpret_cast<void*>(addr),
                reinterpret_cast<void*>(data));
}

using arch::get_regs;
using arch::set_regs;
bool get_siginfo(pid_t tid, siginfo_t& si) {
  return pt(PTRACE_GETSIGINFO, tid, 0, reinterpret_cast<uint64_t>(&si)) == 0;
}


// Linux ptrace_syscall_info (linux/ptrace.h), kept local to avoid header clashes.
struct SyscallInfo {
  uint8_t op;
  uint8_t pad[3];
  uint32_t arch;
  uint64_t instruction_pointer;
  uint64_t stack_pointer;
  union {
    struct {
      uint64_t nr;
      uint64_t args[6];
    } entry;
    struct {
      int64_t rval;
      uint8_t is_error;
    } exit;
    struct {
      uint64_t nr;
      uint64_t args[6];
      uint32_t ret_data;
    } seccomp;
  };
};

}  // namespace

namespace {
int g_guardian_fd = -1;
pid_t g_guardian_pid = 0;
}  // namespace

void guardian_note(const std::string& line) {
  if (g_guardian_fd < 0) return;
  std::string l = line + "\n";
  (void)!write(g_guardian_fd, l.data(), l.size());
}

static std::string hexs(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "%llx", (unsigned long long)v);
  return b;
}

Result<void> Tracer::start_guardian() {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return Error::sys("pipe");
  pid_t g = fork();
  if (g < 0) return Error::sys("fork guardian");
  if (g == 0) {
    close(p[1]);
    // Ctrl-C / kill of the helper's process group must not take the guardian with it.
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    setsid();
    _exit(run_guardian(pid_, p[0]));
  }
  close(p[0]);
  g_guardian_fd = p[1];
  g_guardian_pid = g;
  guardian_note("syscall " + hexs(syscall_insn_));
  guardian_note("scratch " + hexs(scratch_));
  for (const auto& [page, pg] : pages_) guardian_note("page " + hexs(page) + " " + std::to_string(pg.orig_prot));
  return {};
}

void Tracer::dismiss_guardian() {
  if (g_guardian_fd < 0) return;
  guardian_note("clear");
  close(g_guardian_fd);
  g_guardian_fd = -1;
  int st;
  while (waitpid(g_guardian_pid, &st, 0) < 0 && errno == EINTR) {
  }
}

int Tracer::run_guardian(pid_t pid, int fd) {
  const pid_t helper = getppid();
  std::map<uint64_t, int> pages;
  std::map<uint64_t, uint32_t> bps;
  uint64_t syscall_insn = 0, scratch = 0;
  std::string buf, line;
  char tmp[4096];
  bool clear = false;
  for (;;) {
    ssize_t n = read(fd, tmp, sizeof tmp);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buf.append(tmp, static_cast<size_t>(n));
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      char kind[16] = {};
      unsigned long long a = 0, b = 0;
      std::sscanf(line.c_str(), "%15s %llx %llu", kind, &a, &b);
      std::string k = kind;
      if (k == "clear") clear = true;
      else if (k == "syscall") syscall_insn = a;
      else if (k == "scratch") scratch = a;
      else if (k == "page") pages[a] = static_cast<int>(b);
      else if (k == "unpage") pages.erase(a);
      else if (k == "bp") bps[a] = static_cast<uint32_t>(b);
      else if (k == "unbp") bps.erase(a);
    }
  }
  if (clear || (pages.empty() && bps.empty())) return 0;
  // The helper died without restoring. The pipe reads EOF when the dying
  // helper closes its files, before the kernel detaches its tracees (exit_files
  // runs before exit_notify -> exit_ptrace): seizing now fails with EPERM. The
  // tracees are free once this process has been reparented (exit_notify
  // detaches them first, in forget_original_parent), so wait for that, then
  // re-attach and undo.
  for (int i = 0; i < 5000 && getppid() == helper; i++) usleep(1000);
  Options o;
  o.pid = pid;
  Tracer t(o);
  if (Result<void> at = t.attach(); !at) {
    std::fprintf(stderr, "memtrace-singlestep guardian: %s: protections of process %d not restored\n",
                 at.error().message.c_str(), pid);
    return 1;
  }
  std::string mp = "/proc/" + std::to_string(pid) + "/mem";
  t.mem_ = Fd(open(mp.c_str(), O_RDWR | O_CLOEXEC));
  t.syscall_insn_ = syscall_insn;
  for (auto [a, b] : bps) t.mem_write(a, &b, arch::kBreakpointLen);
  for (auto [a, prot] : pages) t.pages_[a] = Page{prot, PROT_NONE};
  pid_t tid = t.any_stopped();
  if (tid) {
    (void)t.protect_all(tid, false);
    if (scratch) (void)t.inject(tid, SYS_munmap, scratch, kSlotSize * kSlots, 0);
  }
  // Threads caught in the SIGSEGV of a protected page re-execute the access.
  for (auto& [id, th] : t.threads_) {
    for (int st : th.queued) {
      Stop s(st);
      if (s.kind() == Stop::kSignal && s.sig() != SIGSEGV) th.resume_sig = s.sig();
    }
    th.queued.clear();
    pt(PTRACE_DETACH, id, 0, static_cast<uint64_t>(th.resume_sig));
  }
  return 0;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

Tracer::Tracer(Options o) : opt_(std::move(o)) {}
Tracer::~Tracer() = default;

Tracer::Thread* Tracer::thread(pid_t tid) {
  auto it = threads_.find(tid);
  return it == threads_.end() ? nullptr : &it->second;
}

void Tracer::add_thread(pid_t tid, bool stopped) {
  auto [it, fresh] = threads_.try_emplace(tid);
  if (fresh) {
    it->second.stopped = stopped;
    if (hw_ && hw_watch_) {
      if (auto r = hw_watch_->add_thread(tid); !r) std::fprintf(stderr, "memtrace-singlestep: %s\n", r.error().message.c_str());
    }
  }
}

bool Tracer::mem_read(uint64_t addr, void* buf, size_t n) {
  return pread(mem_.get(), buf, n, static_cast<off_t>(addr)) == static_cast<ssize_t>(n);
}
bool Tracer::mem_write(uint64_t addr, const void* buf, size_t n) {
  return pwrite(mem_.get(), buf, n, static_cast<off_t>(addr)) == static_cast<ssize_t>(n);
}

// ---------------------------------------------------------------- start

Result<void> Tracer::start() {
  Result<void> r = opt_.command.empty() ? attach() : launch();
  if (!r) return r;
  std::string mp = "/proc/" + std::to_string(pid_) + "/mem";
  mem_ = Fd(open(mp.c_str(), O_RDWR | O_CLOEXEC));
  if (!mem_.valid()) return Error::sys("open " + mp);
  symbols_ = std::make_unique<ProcessSymbols>(pid_);
  if (auto a = arm(); !a) {
    disarm_and_detach("error");
    return a;
  }
  if (!hw_ && !getenv("MEMTRACE_SS_NO_GUARDIAN"))
    if (auto g = start_guardian(); !g)
      std::fprintf(stderr, "memtrace-singlestep: no guardian: %s\n", g.error().message.c_str());
  if (opt_.ready_fd >= 0) {
    char c = 1;
    (void)!write(opt_.ready_fd, &c, 1);
    close(opt_.ready_fd);
    opt_.ready_fd = -1;
  }
  return {};
}

Result<void> Tracer::attach() {
  pid_ = opt_.pid;
  if (kill(pid_, 0) != 0 && errno == ESRCH) return Error::msg("process " + std::to_string(pid_) + " does not exist");
  std::string task = "/proc/" + std::to_string(pid_) + "/task";
  // Seize every thread; repeat until no new thread shows up (threads start while we attach).
  for (bool found = true; found;) {
    found = false;
    DIR* d = opendir(task.c_str());
    if (!d) return Error::sys("open " + task);
    while (dirent* e = readdir(d)) {
      pid_t tid = static_cast<pid_t>(std::atoi(e->d_name));
      if (tid <= 0 || threads_.count(tid)) continue;
      if (pt(PTRACE_SEIZE, tid, 0, kOptions) != 0) {
        if (errno == ESRCH) continue;
        int err = errno;
        closedir(d);
        return Error::sys("ptrace seize thread " + std::to_string(tid) + " of process " + std::to_string(pid_), err);
      }
      pt(PTRACE_INTERRUPT, tid, 0, 0);
      threads_[tid].stopped = false;
      found = true;
    }
    closedir(d);
  }
  stop_world(0);
  if (threads_.empty()) return Error::msg("process " + std::to_string(pid_) + " exited while attaching");
  return {};
}

Result<void> Tracer::launch() {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return Error::sys("pipe");
  pid_t child = fork();
  if (child < 0) return Error::sys("fork");
  if (child == 0) {
    close(pipefd[0]);
    raise(SIGSTOP);
    execvp(opt_.command[0].c_str(), [&] {
      static std::vector<char*> argv;
      for (auto& s : opt_.command) argv.push_back(s.data());
      argv.push_back(nullptr);
      return argv.data();
    }());
    int err = errno;
    (void)!write(pipefd[1], &err, sizeof err);
    _exit(127);
  }
  close(pipefd[1]);
  pid_ = child;
  launched_ = true;
  int st = 0;
  if (waitpid(child, &st, WUNTRACED) != child || !WIFSTOPPED(st)) return Error::msg("cannot start " + opt_.command[0]);
  if (pt(PTRACE_SEIZE, child, 0, kOptions | PTRACE_O_EXITKILL) != 0) return Error::sys("ptrace seize child");
  kill(child, SIGCONT);
  threads_[child].stopped = false;
  for (;;) {
    pid_t w = waitpid(child, &st, __WALL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return Error::sys("waitpid");
    Stop s(st);
    if (s.gone()) {
      int err = 0;
      threads_.clear();
      child_reaped_ = true;
      child_exit_ = s.exit_code();
      if (read(pipefd[0], &err, sizeof err) == sizeof err) {
        close(pipefd[0]);
        return Error::msg("cannot start program " + opt_.command[0] + ": " + std::strerror(err));
      }
      close(pipefd[0]);
      return Error::msg("program " + opt_.command[0] + " exited before exec");
    }
    if (s.kind() == Stop::kEvent && s.event() == PTRACE_EVENT_EXEC) break;
    int sig = (s.kind() == Stop::kSignal && s.sig() != SIGSTOP) ? s.sig() : 0;
    pt(PTRACE_CONT, child, 0, static_cast<uint64_t>(sig));
  }
  close(pipefd[0]);
  threads_[child].stopped = true;
  // Launched children survive the helper: drop EXITKILL now that exec succeeded.
  pt(PTRACE_SETOPTIONS, child, 0, kOptions);
  return {};
}

Result<void> Tracer::resolve_regions() {
  for (auto [a, n] : opt_.ranges) {
    if (n == 0) return Error::msg("region length must be > 0");
    report_.regions.push_back({a, n, ""});
  }
  for (const auto& name : opt_.symbols) {
    auto s = symbols_->find_object(name);
    if (!s) return s.error();
    if (s->size == 0) return Error::msg("symbol " + name + " has size 0 (give --addr/--len instead)");
    report_.regions.push_back({s->start, s->size, name});
  }
  if (report_.regions.empty() && opt_.track_allocs_from.empty())
    return Error::msg("no region: give --addr ADDR --len LEN, --symbol NAME or --track-allocs-from FUNCTION");
  return {};
}

pid_t Tracer::any_stopped() const {
  if (auto it = threads_.find(pid_); it != threads_.end() && it->second.stopped) return pid_;
  for (const auto& [tid, t] : threads_)
    if (t.stopped) return tid;
  return 0;
}

Result<void> Tracer::arm() {
  if (auto r = resolve_regions(); !r) return r;
  auto maps = read_maps(pid_);
  if (!maps) return maps.error();
  for (const auto& reg : report_.regions) {
    for (uint64_t p = page_of(reg.addr); p < reg.addr + reg.len; p += kPage) {
      auto m = std::find_if(maps->begin(), maps->end(), [&](const Mapping& mm) { return p >= mm.start && p < mm.end; });
      char buf[96];
      std::snprintf(buf, sizeof buf, "region 0x%llx+%llu", (unsigned long long)reg.addr, (unsigned long long)reg.len);
      if (m == maps->end())
        return Error::msg(std::string(buf) + " is not mapped in process " + std::to_string(pid_));
      if (!(m->readable()))
        return Error::msg(std::string(buf) + " is not readable in process " + std::to_string(pid_) + " (" +
                          (m->path.empty() ? "anonymous" : m->path) + ")");
      pages_[p] = Page{m->prot(), m->prot()};
    }
  }
  if (opt_.rearm_ms <= 0 && (opt_.mode == "hw" || (opt_.mode == "auto" && HwWatch::eligible(report_.regions) && opt_.track_allocs_from.empty()))) {
    if (!HwWatch::eligible(report_.regions))
      return Error::msg("--mode hw needs at most four aligned 1/2/4/8-byte words");
    hw_ = true;
    report_.mode = "hw-watchpoint";
    hw_watch_ = std::make_unique<HwWatch>(report_.regions);
    for (auto& [tid, t] : threads_)
      if (auto r = hw_watch_->add_thread(tid); !r) return r;
    armed_ = true;
    return {};
  }
  report_.mode = opt_.rearm_ms > 0 ? "page-rearm" : "single-step";
  report_.rearm_ms = opt_.rearm_ms;
  // A syscall instruction to run injected system calls: the vDSO has one.
  for (const auto& m : *maps) {
    if (!m.exec()) continue;
    if (m.path != "[vdso]" && syscall_insn_) continue;
    std::vector<uint8_t> code(m.end - m.start);
    if (!mem_read(m.start, code.data(), code.size())) continue;
    if (size_t i = arch::find_syscall_insn(code.data(), code.size()); i < code.size()) syscall_insn_ = m.start + i;
    if (syscall_insn_ && m.path == "[vdso]") break;
  }
  if (!syscall_insn_) return Error::msg("no syscall instruction found in process " + std::to_string(pid_));
  pid_t tid = any_stopped();
  if (!tid) return Error::msg("no stopped thread to arm from");
  auto s = inject(tid, SYS_mmap, 0, kSlotSize * kSlots, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                  static_cast<uint64_t>(-1), 0);
  if (!s) return s.error();
  if (*s < 0 && *s > -4096) return Error::msg(std::string("mmap scratch area in the tracee: ") + std::strerror(static_cast<int>(-*s)));
  scratch_ = static_cast<uint64_t>(*s);
  if (getenv("MEMTRACE_SS_DEBUG")) fprintf(stderr, "scratch %llx syscall insn %llx\n", (unsigned long long)scratch_, (unsigned long long)syscall_insn_);
  slot_busy_.assign(kSlots, false);
  if (!opt_.track_allocs_from.empty())
    if (auto r = arm_alloc_tracking(); !r) return r;
  if (auto r = protect_all(tid, true); !r) return r;
  armed_ = true;
  if (opt_.rearm_ms > 0) {
    report_.rearm_intervals = 1;
    next_rearm_ns_ = now_ns() + static_cast<uint64_t>(opt_.rearm_ms * 1e6);
  }
  return {};
}

// ---------------------------------------------------------------- injection

Result<long> Tracer::inject(pid_t tid, long nr, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5,
                            uint64_t a6) {
  Regs saved, r;
  if (!get_regs(tid, saved)) return Error::sys("ptrace getregs " + std::to_string(tid));
  r = saved;
  const uint64_t args[6] = {a1, a2, a3, a4, a5, a6};
  arch::load_injected_syscall(r, syscall_insn_, nr, args);
  const Regs want = r;
  Thread* t = thread(tid);
  bool done = false;
  // From a syscall or exec stop the first step only finishes the interrupted system
  // call (rip does not move): set the registers again and step once more.
  for (int tries = 0; tries < 10 && !done; tries++) {
    if (!set_regs(tid, want)) return Error::sys("ptrace setregs " + std::to_string(tid));
    if (pt(PTRACE_SINGLESTEP, tid, 0, 0) != 0) return Error::sys("ptrace singlestep " + std::to_string(tid));
    Stop s(wait_for(tid));
    if (s.gone()) return Error::msg("thread " + std::to_string(tid) + " exited during an injected system call");
    if (s.kind() == Stop::kSignal && s.sig() != SIGTRAP && t && !t->resume_sig) t->resume_sig = s.sig();
    get_regs(tid, r);
    done = arch::pc(r) == syscall_insn_ + arch::kSyscallInsnLen;
  }
  if (!done) return Error::msg("injected system call did not run in thread " + std::to_string(tid));
  long ret = arch::syscall_result(r);
  set_regs(tid, saved);
  return ret;
}

Result<void> Tracer::set_prot(pid_t tid, uint64_t page, uint64_t npages, int prot) {
  auto r = inject(tid, SYS_mprotect, page, npages * kPage, static_cast<uint64_t>(prot));
  if (!r) return r.error();
  if (*r != 0) {
    char b[64];
    std::snprintf(b, sizeof b, "mprotect 0x%llx+%llu in the tracee", (unsigned long long)page,
                  (unsigned long long)(npages * kPage));
    return Error::sys(b, static_cast<int>(-*r));
  }
  for (uint64_t i = 0; i < npages; i++) pages_[page + i * kPage].cur_prot = prot;
  return {};
}

Result<void> Tracer::protect_all(pid_t tid, bool armed) {
  // Contiguous runs with the same target protection, one mprotect each.
  auto it = pages_.begin();
  while (it != pages_.end()) {
    int want = armed ? PROT_NONE : it->second.orig_prot;
    uint64_t start = it->first, n = 0;
    auto jt = it;
    while (jt != pages_.end() && jt->first == start + n * kPage &&
           (armed ? PROT_NONE : jt->second.orig_prot) == want) {
      ++n;
      ++jt;
    }
    bool need = false;
    for (auto k = it; k != jt; ++k) need |= k->second.cur_prot != want;
    if (need)
      if (auto r = set_prot(tid, start, n, want); !r) return r;
    it = jt;
  }
  return {};
}

bool Tracer::page_armed(uint64_t page) const {
  auto it = pages_.find(page);
  return it != pages_.end() && it->second.cur_prot != it->second.orig_prot;
}

// ---------------------------------------------------------------- thread control

int Tracer::wait_for(pid_t tid) {
  for (;;) {
    int st = 0;
    pid_t w = waitpid(-1, &st, __WALL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return 0;  // ECHILD: nothing left
    }
    if (w == tid) return st;
    // Another thread's event: queue it (it is stopped now, or gone).
    Thread* o = thread(w);
    if (!o) {
      add_thread(w, true);
      o = thread(w);
    }
    o->stopped = true;
    o->queued.push_back(st);
  }
}

void Tracer::stop_world(pid_t except) {
  std::set<pid_t> waiting;
  for (auto& [tid, t] : threads_) {
    if (tid == except || t.stopped) continue;
    pt(PTRACE_INTERRUPT, tid, 0, 0);
    waiting.insert(tid);
  }
  while (!waiting.empty()) {
    int st = 0;
    pid_t w = waitpid(-1, &st, __WALL);
    if (w < 0) {
      if (errno == EINTR) continue;
      break;
    }
    Thread* t = thread(w);
    if (!t) {
      add_thread(w, true);
      t = thread(w);
    }
    t->stopped = true;
    waiting.erase(w);
    Stop s(st);
    if (s.kind() == Stop::kEvent && s.event() == PTRACE_EVENT_STOP) continue;  // our interrupt
    t->queued.push_back(st);
  }
}

void Tracer::resume(pid_t tid) {
  Thread* t = thread(tid);
  if (!t || !t->stopped || !t->queued.empty()) return;
  int req = t->group_stop ? PTRACE_LISTEN : (armed_ && !hw_ ? PTRACE_SYSCALL : PTRACE_CONT);
  int sig = t->group_stop ? 0 : t->resume_sig;
  if (pt(req, tid, 0, static_cast<uint64_t>(sig)) == 0 || errno == ESRCH) {
    t->stopped = false;
    t->resume_sig = 0;
    t->group_stop = false;
  }
}

void Tracer::resume_all() {
  for (auto& [tid, t] : threads_)
    if (t.stopped && t.queued.empty()) resume(tid);
}

// ---------------------------------------------------------------- main loop

void Tracer::run() {
  if (threads_.empty()) return;
  while (!threads_.empty()) {
    if (armed_ && stop_reason_.empty()) {
      if (g_stop_signal) stop_reason_ = "signal";
      else if (g_deadline_passed) stop_reason_ = "duration";
      else if (max_reached()) stop_reason_ = "max";
    }
    if (hw_ && hw_watch_) {
      hw_watch_->drain(report_, *symbols_, opt_.max);
      if (max_reached() && stop_reason_.empty()) stop_reason_ = "max";
    }
    if (!stop_reason_.empty() && armed_) {
      disarm_and_detach(stop_reason_);
      return;
    }
    if (opt_.rearm_ms > 0 && armed_ && now_ns() >= next_rearm_ns_) rearm_now();
    // Queued events first (gathered while the world was stopped).
    pid_t next = 0;
    for (auto& [tid, t] : threads_)
      if (!t.queued.empty()) {
        next = tid;
        break;
      }
    if (next) {
      int st = threads_[next].queued.front();
      threads_[next].queued.pop_front();
      handle(next, st);
      continue;
    }
    resume_all();
    int st = 0;
    pid_t w = waitpid(-1, &st, __WALL);
    if (w < 0) {
      if (errno == EINTR) continue;
      break;
    }
    handle(w, st);
  }
  if (report_.stop_reason.empty()) report_.stop_reason = "exit";
  dismiss_guardian();
  if (hw_ && hw_watch_) hw_watch_->drain(report_, *symbols_, opt_.max, true);
}

void Tracer::handle(pid_t tid, int status) {
  Stop s(status);
  if (!thread(tid)) add_thread(tid, true);
  Thread& t = threads_[tid];
  if (!(s.kind() == Stop::kSignal && s.sig() == SIGSEGV)) t.stale_ip = t.stale_addr = 0;
  t.retry_page = 0;  // it ran since (a page it had restored was accessed)
  if (s.gone()) {
    if (tid == pid_) {
      report_.exit_code = s.exit_code();
      if (launched_) {
        child_reaped_ = true;
        child_exit_ = s.exit_code();
      }
    }
    if (hw_watch_) hw_watch_->remove_thread(tid);
    threads_.erase(tid);
    return;
  }
  t.stopped = true;
  switch (s.kind()) {
    case Stop::kGroupStop:
      t.group_stop = true;
      return;
    case Stop::kEvent:
      if (s.event() == PTRACE_EVENT_CLONE) {
        unsigned long nt = 0;
        pt(PTRACE_GETEVENTMSG, tid, 0, reinterpret_cast<uint64_t>(&nt));
        if (!thread(static_cast<pid_t>(nt))) add_thread(static_cast<pid_t>(nt), false);
      } else if (s.event() == PTRACE_EVENT_EXEC) {
        // A new program image: the regions are gone with the old one.
        pages_.clear();
        armed_ = false;
        for (auto it = threads_.begin(); it != threads_.end();)
          it = (it->first != tid && it->first != pid_) ? threads_.erase(it) : std::next(it);
        if (stop_reason_.empty()) stop_reason_ = "exec";
        disarm_and_detach("exec");
      }
      return;
    case Stop::kSyscall:
      handle_syscall(tid);
      return;
    case Stop::kSignal: {
      int sig = s.sig();
      if (sig == SIGSEGV && armed_ && !hw_) {
        siginfo_t si;
        if (get_siginfo(tid, si) && si.si_code > 0) {
          uint64_t a = reinterpret_cast<uint64_t>(si.si_addr);
          if (page_armed(page_of(a))) {
            if (opt_.rearm_ms > 0) handle_page_access(tid, a);
            else handle_fault(tid, a);
            return;
          }
          // A tracked page that is open right now (a system call window, or the fault
          // was queued while another thread stepped): the access will succeed, retry it.
          if (auto it = pages_.find(page_of(a)); it != pages_.end()) {
            Regs rr;
            get_regs(tid, rr);
            if (t.stale_ip != arch::pc(rr) || t.stale_addr != a) {
              t.stale_ip = arch::pc(rr);
              t.stale_addr = a;
              return;
            }
          }
          if (getenv("MEMTRACE_SS_DEBUG")) {
            Regs rr;
            get_regs(tid, rr);
            auto it = pages_.find(page_of(a));
            std::fprintf(stderr, "genuine SIGSEGV tid %d addr %llx ip %llx code %d page known %d cur %d orig %d\n", tid,
                         (unsigned long long)a, (unsigned long long)arch::pc(rr), si.si_code, it != pages_.end(),
                         it != pages_.end() ? it->second.cur_prot : -1, it != pages_.end() ? it->second.orig_prot : -1);
          }
        }
      }
      if (sig == SIGTRAP && !opt_.track_allocs_from.empty() && armed_) {
        Regs regs;
        if (get_regs(tid, regs)) {
          alloc_breakpoint(tid, regs);
          return;
        }
      }
      t.resume_sig = sig;
      return;
    }
    default:
      return;
  }
}

// ---------------------------------------------------------------- faults

void Tracer::record_raw(pid_t tid, uint64_t ip, uint64_t addr, uint64_t size, Access a, uint64_t now,
                        const std::string& insn_text) {
  bool in = false;
  for (const auto& r : report_.regions) in |= r.overlaps(addr, size ? size : 1);
  for (auto& b : report_.blocks) {
    if (b.free_time_ns || addr >= b.addr + b.size || b.addr >= addr + (size ? size : 1)) continue;
    in = true;
    if (a != Access::kWrite) b.reads++, b.bytes_read += size;
    if (a != Access::kRead) b.writes++, b.bytes_written += size;
  }
  if (!in) {
    report_.unrecorded_same_page++;
    return;
  }
  if (max_reached()) {
    report_.dropped++;
    return;
  }
  Record rec;
  rec.time_ns = now;
  rec.tid = tid;
  rec.ip = ip;
  rec.address = addr;
  rec.size = static_cast<uint32_t>(size);
  rec.access = a;
  rec.function = symbols_->function_of(ip);
  rec.insn = insn_text;
  report_.records.push_back(std::move(rec));
}

void Tracer::record(pid_t tid, const Insn& insn, const MemOp& op, Access a, uint64_t now) {
  record_raw(tid, insn.ip, op.ea, op.size, a, now, insn.text);
}

bool Tracer::emulate(pid_t tid, Regs& regs, const Insn& insn, uint64_t now) {
  if (insn.ops.size() != 1 || insn.ops[0].size > 8) return false;
  const MemOp& op = insn.ops[0];
  uint64_t v = 0;
  switch (insn.emul) {
    case Emul::kLoad: {
      if (!mem_read(op.ea, &v, op.size)) return false;
      unsigned w = reg_width(insn.reg);
      if (insn.sign_extend && op.size < 8) {
        unsigned sh = 64 - op.size * 8;
        v = static_cast<uint64_t>(static_cast<int64_t>(v << sh) >> sh);
      }
      if (w < 8 && w > op.size && !insn.sign_extend) v &= (1ull << (op.size * 8)) - 1;
      if (!reg_write(insn.reg, v, regs)) return false;
      break;
    }
    case Emul::kStoreReg: {
      auto r = reg_read(insn.reg, regs);
      if (!r) return false;
      v = *r;
      if (!mem_write(op.ea, &v, op.size)) return false;
      break;
    }
    case Emul::kStoreImm:
      v = static_cast<uint64_t>(insn.imm);
      if (!mem_write(op.ea, &v, op.size)) return false;
      break;
    default:
      return false;
  }
  arch::set_pc(regs, insn.ip + insn.len);
  if (!set_regs(tid, regs)) return false;
  record(tid, insn, op, insn.emul == Emul::kLoad ? Access::kRead : Access::kWrite, now);
  report_.emulated++;
  return true;
}

// A store-exclusive on a tracked page, performed by the helper the way the
// exclusive monitor decides it (and as QEMU emulates it): stored if the
// memory still holds what the thread's load-exclusive read there, else the
// status register says failed and the program's loop retries. The helper is
// the only one to touch the page meanwhile (every access faults into this
// loop, one at a time), so the compare and the store are one step.
bool Tracer::store_exclusive(pid_t tid, Regs& regs, const IpInfo& info, uint64_t now) {
  const Insn& insn = info.insn;
  Thread* t = thread(tid);
  uint8_t data[16], cur[16];
  uint32_t size = 0;
  if (!t || insn.ops.size() != 1 || !arch::store_exclusive_data(info.bytes, info.n, regs, data, &size) ||
      size != insn.ops[0].size)
    return false;
  const uint64_t ea = insn.ops[0].ea;
  bool stored = t->excl_size == size && t->excl_addr == ea && mem_read(ea, cur, size) &&
                std::memcmp(cur, t->excl_bytes, size) == 0 && mem_write(ea, data, size);
  t->excl_size = 0;
  arch::complete_store_exclusive(regs, info.bytes, stored);
  if (!set_regs(tid, regs)) return false;
  if (stored) record(tid, insn, insn.ops[0], Access::kWrite, now);
  report_.emulated++;
  return true;
}

void Tracer::handle_fault(pid_t tid, uint64_t fault_addr) {
  uint64_t now = now_ns();
  Regs regs;
  if (!get_regs(tid, regs)) return;
  const uint64_t ip = arch::pc(regs);
  uint8_t code[16];
  size_t n = 16;
  while (n > 0 && !mem_read(ip, code, n)) n--;
  IpInfo& info = ips_[ip];
  if (info.n != n || std::memcmp(info.bytes, code, n) != 0 || info.insn.len == 0) {
    info = IpInfo{};
    std::memcpy(info.bytes, code, n);
    info.n = n;
    if (auto d = decoder_.decode(ip, code, n, regs)) info.insn = *d;
    else info.insn.ip = ip, info.insn.len = 0, info.insn.text = "(undecodable)";
  } else {
    decoder_.recompute(info.insn, code, n, regs);
  }
  Insn& insn = info.insn;
  // aarch64: a store-exclusive would fail once stepped (every step, and the
  // system calls that open the page, clear the exclusive monitor): the
  // helper performs it against the value of the thread's load-exclusive.
  if (insn.exclusive == 2 && store_exclusive(tid, regs, info, now)) return;
  // Emulate plain moves: the page stays protected, other threads run on.
  if (opt_.emulate && insn.emul != Emul::kNone && emulate(tid, regs, insn, now)) return;
  if (threads_.size() > 1) stop_world(tid);
  bool stepped = step_over(tid, regs, info, fault_addr, now);
  report_.stepped++;
  if (stepped && insn.exclusive == 1) finish_exclusive(tid, now);
}

// aarch64: after a load-exclusive on a tracked page, step the thread on (the
// world still stopped) to its store-exclusive and perform that: the monitor
// the load set is gone after the step, and a store-exclusive that fails its
// monitor check need not fault (QEMU's does not), so it would never reach
// the helper and the program's loop would retry for ever. A short bounded
// walk: an LL/SC loop is a few instructions; anything else (another memory
// access to a tracked page, a signal) ends it and takes the usual path.
void Tracer::finish_exclusive(pid_t tid, uint64_t now) {
  Thread* t = thread(tid);
  for (int i = 0; i < 32 && t && t->excl_size; i++) {
    Regs r;
    if (!get_regs(tid, r)) return;
    IpInfo info;
    info.n = sizeof info.bytes;
    while (info.n > 0 && !mem_read(arch::pc(r), info.bytes, info.n)) info.n--;
    auto d = decoder_.decode(arch::pc(r), info.bytes, info.n, r);
    if (!d) return;
    info.insn = *d;
    if (d->exclusive == 2 && d->ops.size() == 1 && d->ops[0].ea == t->excl_addr) {
      store_exclusive(tid, r, info, now);
      return;
    }
    for (const MemOp& op : d->ops)
      for (uint64_t p = page_of(op.ea); p < op.ea + std::max<uint32_t>(op.size, 1); p += kPage)
        if (page_armed(p)) return;  // its fault comes next
    pt(PTRACE_SINGLESTEP, tid, 0, 0);
    Stop s(wait_for(tid));
    if (!(s.kind() == Stop::kSignal && s.sig() == SIGTRAP)) {
      t->queued.push_back(s.raw());  // the main loop handles it
      return;
    }
  }
}

// --rearm: the first access to an armed page in this interval. Give the page
// its protection back from the faulting thread itself and let the access run
// again (the SIGSEGV is not delivered). The kernel's page_fault_user
// tracepoint has already seen this fault (memtrace-bpf flags it as an access
// error); nothing is single-stepped.
void Tracer::handle_page_access(pid_t tid, uint64_t fault_addr) {
  uint64_t page = page_of(fault_addr);
  auto it = pages_.find(page);
  if (it == pages_.end()) return;
  if (auto r = set_prot(tid, page, 1, it->second.orig_prot); !r) {
    std::fprintf(stderr, "memtrace-singlestep: %s\n", r.error().message.c_str());
    return;
  }
  report_.page_first_accesses++;
  report_.page_accesses[page]++;
  Regs regs;
  if (Thread* t = thread(tid); t && get_regs(tid, regs)) {
    t->retry_page = page;
    t->retry_ip = arch::pc(regs);
  }
}

// --rearm: a thread whose page was just restored but that has not re-run the
// access yet would fault again on the re-armed page (two first accesses in one
// interval): step it over the access first.
void Tracer::finish_retries() {
  for (auto& [tid, t] : threads_) {
    for (int i = 0; i < 4 && t.retry_page && t.stopped && t.queued.empty(); i++) {
      Regs r;
      if (!get_regs(tid, r) || arch::pc(r) != t.retry_ip) break;
      pt(PTRACE_SINGLESTEP, tid, 0, 0);
      Stop s(wait_for(tid));
      if (s.gone()) {
        t.queued.push_back(s.raw());
        break;
      }
      siginfo_t si;
      if (s.kind() == Stop::kSignal && s.sig() == SIGSEGV && get_siginfo(tid, si) && si.si_code > 0 &&
          page_armed(page_of(reinterpret_cast<uint64_t>(si.si_addr)))) {
        handle_page_access(tid, reinterpret_cast<uint64_t>(si.si_addr));  // another armed page: same interval
        continue;
      }
      if (s.kind() == Stop::kSignal && s.sig() != SIGTRAP) t.resume_sig = s.sig();
      else if (s.kind() != Stop::kSignal) t.queued.push_back(s.raw());
      break;
    }
    t.retry_page = 0;
  }
}

// --rearm: a new interval. Stop every thread (so that none is between a fault
// and its restore), make every opened page inaccessible again, resume.
void Tracer::rearm_now() {
  stop_world(0);
  finish_retries();
  // Inject from a thread stopped by our interrupt (nothing queued to finish).
  pid_t tid = 0;
  for (const auto& [id, t] : threads_)
    if (t.stopped && t.queued.empty() && t.open == Thread::Open::kNone && t.redirect_slot < 0) {
      tid = id;
      break;
    }
  if (tid) {
    // A thread stopped inside a system call whose pages we opened: leave this
    // round to it (the pages are closed again when its call returns).
    bool busy = false;
    for (const auto& [id, t] : threads_) busy |= t.open != Thread::Open::kNone || t.redirect_slot >= 0;
    if (!busy) {
      if (auto r = protect_all(tid, true); !r)
        std::fprintf(stderr, "memtrace-singlestep: rearm: %s\n", r.error().message.c_str());
      else
        report_.rearm_intervals++;
    }
  }
  if (!tid) {
    // Every thread stopped with an event to handle first: stopping a thread
    // in a blocking system call under PTRACE_SYSCALL reports its
    // syscall-exit before our interrupt. Handle those, then re-arm on the
    // next pass of the loop (the deadline stays where it is). Skipping this
    // round instead lost a whole sweep's first accesses: one thread
    // sleeping between sweeps is exactly this case.
    for (const auto& [id, t] : threads_)
      if (!t.queued.empty()) return;
  }
  uint64_t step = static_cast<uint64_t>(opt_.rearm_ms * 1e6);
  uint64_t now = now_ns();
  next_rearm_ns_ += step;
  if (next_rearm_ns_ <= now) next_rearm_ns_ = now + step;  // late: skip, do not catch up
}

// Unprotect the pages the instruction touches, single-step it, record, re-protect.
// Read vs write comes from the fault: a page is first opened read-only unless this
// ip is known to write it; a second fault on the read-only page means a write.
bool Tracer::step_over(pid_t tid, Regs& regs, IpInfo& info, uint64_t fault_addr, uint64_t now) {
  Insn& insn = info.insn;
  Thread* t = thread(tid);
  std::map<uint64_t, int> opened;  // page -> protection we set
  auto op_written = [&](size_t i) {
    return insn.ops[i].dir == Dir::kWrite || insn.ops[i].dir == Dir::kReadWrite ||
           (insn.ops[i].dir == Dir::kUnknown && (info.written_ops >> i) & 1);
  };
  auto want_pages = [&](std::map<uint64_t, int>& want) {
    for (size_t i = 0; i < insn.ops.size(); i++) {
      const MemOp& op = insn.ops[i];
      for (uint64_t p = page_of(op.ea); p < op.ea + std::max<uint32_t>(op.size, 1); p += kPage) {
        auto it = pages_.find(p);
        if (it == pages_.end()) continue;
        int prot = op_written(i) ? it->second.orig_prot : (it->second.orig_prot & ~PROT_WRITE);
        want[p] |= prot;
      }
    }
  };
  std::map<uint64_t, int> want;
  want_pages(want);
  if (want.empty() || !want.count(page_of(fault_addr))) {
    auto it = pages_.find(page_of(fault_addr));
    want[page_of(fault_addr)] |= it->second.orig_prot & ~PROT_WRITE;
  }
  bool undecoded = insn.len == 0 || insn.ops.empty();
  bool ok = false;
  bool fault_written = false;
  Regs after = regs;
  for (int attempt = 0; attempt < 8; attempt++) {
    for (auto [p, prot] : want) {
      if (opened.count(p) && opened[p] == prot) continue;
      if (!set_prot(tid, p, 1, prot)) return false;
      opened[p] = prot;
    }
    set_regs(tid, regs);
    pt(PTRACE_SINGLESTEP, tid, 0, 0);
    Stop s(wait_for(tid));
    if (s.gone()) {
      handle(tid, s.raw());
      return false;
    }
    if (s.kind() == Stop::kSignal && s.sig() == SIGTRAP) {
      ok = true;
      break;
    }
    if (s.kind() == Stop::kSignal && s.sig() == SIGSEGV) {
      siginfo_t si;
      get_siginfo(tid, si);
      uint64_t a = reinterpret_cast<uint64_t>(si.si_addr);
      uint64_t p = page_of(a);
      auto it = pages_.find(p);
      if (it != pages_.end() && opened.count(p) && opened[p] != it->second.orig_prot) {
        // Faulted on a page we opened read-only: the instruction writes there.
        want[p] = it->second.orig_prot;
        for (size_t i = 0; i < insn.ops.size(); i++)
          if (a >= page_of(insn.ops[i].ea) && a < insn.ops[i].ea + insn.ops[i].size + kPage) info.written_ops |= 1u << i;
        fault_written = true;
        continue;
      }
      if (it != pages_.end() && !opened.count(p)) {
        want[p] = it->second.orig_prot & ~PROT_WRITE;  // an operand we did not model
        undecoded = true;
        continue;
      }
      t->resume_sig = SIGSEGV;  // a genuine fault of the program: deliver it
      break;
    }
    if (s.kind() == Stop::kSignal) {
      if (!t->resume_sig) t->resume_sig = s.sig();  // asynchronous signal: deliver after the step
      continue;
    }
    if (s.kind() == Stop::kGroupStop) t->group_stop = true;
    // Another stop (event): treat as not stepped yet and retry.
  }
  if (ok) {
    get_regs(tid, after);
    if (insn.exclusive == 1 && insn.ops.size() == 1 && insn.ops[0].size <= sizeof t->excl_bytes &&
        mem_read(insn.ops[0].ea, t->excl_bytes, insn.ops[0].size)) {
      t->excl_addr = insn.ops[0].ea;  // what the load-exclusive read: the world is stopped
      t->excl_size = insn.ops[0].size;
    }
    if (undecoded) {
      Access a = fault_written ? Access::kReadWrite : Access::kRead;
      record_raw(tid, arch::pc(regs), fault_addr, 1, a, now, insn.text);
    } else {
      for (size_t i = 0; i < insn.ops.size(); i++) {
        const MemOp& op = insn.ops[i];
        Access a = op.dir == Dir::kRead        ? Access::kRead
                   : op.dir == Dir::kWrite     ? Access::kWrite
                   : op.dir == Dir::kReadWrite ? Access::kReadWrite  // arm64 atomics
                   : op_written(i)         ? (insn.rmw_if_written ? Access::kReadWrite : Access::kWrite)
                                           : Access::kRead;
        record(tid, insn, op, a, now);
      }
    }
    // rep string: one element per step while the pages stay open.
    while (insn.rep_string && arch::pc(after) == insn.ip && !max_reached()) {
      if (!decoder_.recompute(insn, info.bytes, info.n, after) || insn.ops.empty()) break;
      bool open_enough = true;
      for (size_t i = 0; i < insn.ops.size(); i++)
        for (uint64_t p = page_of(insn.ops[i].ea); p < insn.ops[i].ea + insn.ops[i].size; p += kPage) {
          auto it = pages_.find(p);
          if (it == pages_.end()) continue;
          auto o = opened.find(p);
          if (o == opened.end() || (op_written(i) && o->second != it->second.orig_prot)) open_enough = false;
        }
      if (!open_enough) break;
      uint64_t tnow = now_ns();
      pt(PTRACE_SINGLESTEP, tid, 0, 0);
      Stop s(wait_for(tid));
      if (s.gone()) {
        handle(tid, s.raw());
        return false;
      }
      Regs before = after;
      get_regs(tid, after);
      if (!(s.kind() == Stop::kSignal && s.sig() == SIGTRAP)) {
        if (s.kind() == Stop::kSignal && !t->resume_sig && s.sig() != SIGSEGV) t->resume_sig = s.sig();
        after = before;
        break;
      }
      for (size_t i = 0; i < insn.ops.size(); i++)
        record(tid, insn, insn.ops[i], insn.ops[i].dir == Dir::kWrite ? Access::kWrite : Access::kRead, tnow);
      report_.stepped++;
    }
  }
  // Re-protect what we opened.
  for (auto [p, prot] : opened) (void)set_prot(tid, p, 1, PROT_NONE);
  set_regs(tid, ok ? after : regs);
  return ok;
}

// ---------------------------------------------------------------- system calls

// A system call whose buffer lies on a protected page would fail with EFAULT.
// read/pread64/recvfrom and write/pwrite64/sendto get their buffer redirected to
// a scratch slot in the tracee (pages stay protected, other threads keep running);
// any other system call with a pointer into a protected page runs with the
// pages opened (counted in stats.syscalls_unprotected).
void Tracer::handle_syscall(pid_t tid) {
  Thread& t = threads_[tid];
  SyscallInfo si{};
  if (pt(PTRACE_GET_SYSCALL_INFO_NR, tid, sizeof si, reinterpret_cast<uint64_t>(&si)) <= 0) return;
  using Open = Thread::Open;
  if (t.open != Open::kNone) {
    Regs r;
    get_regs(tid, r);
    if (si.op == 2 && t.open == Open::kOpening) {  // our mprotect(open) returned: run the real call
      for (uint64_t p = t.open_lo; p < t.open_lo + t.open_len; p += kPage)
        if (pages_.count(p)) pages_[p].cur_prot = pages_[p].orig_prot;
      Regs e = t.entry_regs;
      arch::rerun_from_entry(e);
      set_regs(tid, e);
      t.open = Open::kRunning;
      report_.unprotected_syscalls++;
    } else if (si.op == 2 && t.open == Open::kRunning) {  // the real call returned: close again
      t.result_regs = r;
      Regs c = r;
      arch::rerun_as(c, SYS_mprotect, t.open_lo, t.open_len, PROT_NONE);
      set_regs(tid, c);
      t.open = Open::kClosing;
    } else if (si.op == 2 && t.open == Open::kClosing) {
      for (uint64_t p = t.open_lo; p < t.open_lo + t.open_len; p += kPage)
        if (pages_.count(p)) pages_[p].cur_prot = PROT_NONE;
      Regs res = t.result_regs;
      long rv = arch::syscall_result(res);
      if (rv <= -512 && rv >= -516)  // interrupted: restart it after the signal (as SA_RESTART would)
        arch::restart_interrupted(res, t.entry_regs);
      set_regs(tid, res);
      t.open = Open::kNone;
    }
    return;
  }
  if (si.op == 1 /* PTRACE_SYSCALL_INFO_ENTRY */) {
    uint64_t nr = si.entry.nr;
    const uint64_t* a = si.entry.args;
    bool in = nr == SYS_read || nr == SYS_pread64 || nr == SYS_recvfrom;
    bool out = nr == SYS_write || nr == SYS_pwrite64 || nr == SYS_sendto;
    if (in || out) {
      uint64_t buf = a[1], len = a[2];
      bool hits = false;
      for (uint64_t p = page_of(buf); len && p < buf + len; p += kPage) hits |= page_armed(p);
      if (!hits) return;
      int slot = -1;
      for (int i = 0; i < kSlots; i++)
        if (!slot_busy_[static_cast<size_t>(i)]) {
          slot = i;
          break;
        }
      if (slot < 0) return;  // all slots busy: leave it (very unlikely)
      uint64_t n = std::min<uint64_t>(len, kSlotSize);
      uint64_t dst = scratch_ + static_cast<uint64_t>(slot) * kSlotSize;
      if (out) {
        std::vector<uint8_t> tmp(n);
        if (!mem_read(buf, tmp.data(), n) || !mem_write(dst, tmp.data(), n)) return;
      }
      Regs r;
      get_regs(tid, r);
      arch::set_syscall_arg(r, 1, dst);
      arch::set_syscall_arg(r, 2, n);
      set_regs(tid, r);
      slot_busy_[static_cast<size_t>(slot)] = true;
      t.redirect_slot = slot;
      t.redirect_in = in;
      t.redirect_buf = buf;
      t.redirect_len = len;
      report_.syscalls_redirected++;
      return;
    }
    if (nr == SYS_mprotect || nr == SYS_munmap || nr == SYS_mmap || nr == SYS_mremap || nr == SYS_madvise) return;
    // Another system call with an argument pointing into a protected page. Only
    // the arguments the call has: the other registers hold leftovers.
    int nargs = arch::syscall_nargs(nr);
    for (int i = 0; i < nargs; i++) {
      uint64_t p = page_of(a[i]);
      if (!page_armed(p)) continue;
      // The run of contiguous tracked pages around it.
      uint64_t lo = p, hi = p + kPage;
      while (pages_.count(lo - kPage)) lo -= kPage;
      while (pages_.count(hi)) hi += kPage;
      int prot = pages_[p].orig_prot;
      get_regs(tid, t.entry_regs);
      Regs m = t.entry_regs;
      // the kernel runs mprotect(open) instead; the real call follows
      arch::replace_syscall_at_entry(m, SYS_mprotect, lo, hi - lo, static_cast<uint64_t>(prot));
      set_regs(tid, m);
      t.open_lo = lo;
      t.open_len = hi - lo;
      t.open = Open::kOpening;
      if (getenv("MEMTRACE_SS_DEBUG"))
        std::fprintf(stderr, "open pages for syscall %llu arg%d %llx tid %d\n", (unsigned long long)nr, i,
                     (unsigned long long)a[i], tid);
      return;
    }
    return;
  }
  if (si.op == 2 /* EXIT */ && t.redirect_slot >= 0) {
    uint64_t now = now_ns();
    uint64_t src = scratch_ + static_cast<uint64_t>(t.redirect_slot) * kSlotSize;
    int64_t ret = si.exit.rval;
    if (ret > 0) {
      if (t.redirect_in) {
        std::vector<uint8_t> tmp(static_cast<size_t>(ret));
        if (mem_read(src, tmp.data(), tmp.size())) mem_write(t.redirect_buf, tmp.data(), tmp.size());
      }
      record_raw(tid, si.instruction_pointer - arch::kSyscallInsnLen, t.redirect_buf, static_cast<uint64_t>(ret),
                 t.redirect_in ? Access::kWrite : Access::kRead, now, t.redirect_in ? "syscall (kernel writes)" : "syscall (kernel reads)");
    }
    Regs r;
    get_regs(tid, r);
    arch::set_syscall_arg(r, 1, t.redirect_buf);
    arch::set_syscall_arg(r, 2, t.redirect_len);
    set_regs(tid, r);
    slot_busy_[static_cast<size_t>(t.redirect_slot)] = false;
    t.redirect_slot = -1;
  }
}

// ---------------------------------------------------------------- shutdown

void Tracer::disarm_and_detach(const std::string& reason) {
  if (report_.stop_reason.empty()) report_.stop_reason = reason;
  stop_world(0);
  // Finish what the queued stops started.
  for (auto& [tid, t] : threads_) {
    while (!t.queued.empty()) {
      Stop s(t.queued.front());
      t.queued.pop_front();
      if (s.gone()) continue;
      if (s.kind() == Stop::kSyscall) {
        handle_syscall(tid);
      } else if (s.kind() == Stop::kSignal && s.sig() == SIGSEGV && !hw_) {
        siginfo_t si;
        if (get_siginfo(tid, si) && si.si_code > 0 && pages_.count(page_of(reinterpret_cast<uint64_t>(si.si_addr))))
          continue;  // retried after the pages are restored
        t.resume_sig = SIGSEGV;
      } else if (s.kind() == Stop::kSignal) {
        t.resume_sig = s.sig();
      } else if (s.kind() == Stop::kGroupStop) {
        t.group_stop = true;
      }
    }
    // Interrupted inside a redirected system call: it restarts with the real buffer.
    if (t.redirect_slot >= 0) {
      Regs r;
      if (get_regs(tid, r)) {
        arch::set_syscall_arg(r, 1, t.redirect_buf);
        arch::set_syscall_arg(r, 2, t.redirect_len);
        set_regs(tid, r);
      }
      t.redirect_slot = -1;
    }
  }
  for (auto it = threads_.begin(); it != threads_.end();) {
    if (!it->second.stopped) it = threads_.erase(it);  // exited meanwhile
    else ++it;
  }
  pid_t tid = any_stopped();
  if (tid && !opt_.track_allocs_from.empty()) disarm_alloc_tracking(tid);
  if (tid && armed_ && !hw_) {
    if (auto r = protect_all(tid, false); !r)
      std::fprintf(stderr, "memtrace-singlestep: restoring protections: %s\n", r.error().message.c_str());
  }
  if (tid && scratch_ && reason != "exec") (void)inject(tid, SYS_munmap, scratch_, kSlotSize * kSlots, 0);
  scratch_ = 0;
  if (hw_watch_) {
    hw_watch_->drain(report_, *symbols_, opt_.max, true);
    hw_watch_.reset();
  }
  armed_ = false;
  for (auto& [t_id, t] : threads_) pt(PTRACE_DETACH, t_id, 0, static_cast<uint64_t>(t.group_stop ? 0 : t.resume_sig));
  threads_.clear();
  dismiss_guardian();
}

int Tracer::wait_child_exit() {
  if (!launched_) return report_.exit_code >= 0 ? report_.exit_code : 0;
  if (!child_reaped_) {
    int st = 0;
    while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    child_reaped_ = true;
    child_exit_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  return child_exit_;
}

}  // namespace memtrace::singlestep
