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

#include "tracer_internal.h"

namespace memtrace::singlestep {

std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_deadline_passed{false};

using namespace internal;  // NOLINT(google-build-using-namespace): this file's own internals

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
  // A call of the program this stop interrupted (a read() blocked when we
  // stopped it) is issued again from its instruction: the kernel's own
  // restart would rely on this stop being one it restarts from, and a
  // blocked read() was seen failing with EINTR instead.
  arch::restart_by_hand(saved);
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
