#include "loader/tracer.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iostream>

#include "memtrace_bpf.skel.h"

namespace memtrace::loader {
namespace {

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

int event_cb(void* ctx, void* data, size_t len) {
  return static_cast<Tracer*>(ctx)->on_event(data, len);
}
int proc_cb(void* ctx, void* data, size_t len) {
  return static_cast<Tracer*>(ctx)->on_proc_event(data, len);
}

int libbpf_print(enum libbpf_print_level level, const char* fmt, va_list args) {
  if (level == LIBBPF_DEBUG) return 0;
  if (getenv("MEMTRACE_LIBBPF_VERBOSE")) return vfprintf(stderr, fmt, args);
  return 0;
}

const char* counter_name(int c) {
  switch (c) {
    case MT_C_RINGBUF_FULL: return "ringbuf";
    case MT_C_STACK_RINGBUF_FULL: return "stack_ringbuf";
    case MT_C_INFLIGHT_FULL: return "inflight_map_full";
    case MT_C_STACK_EMPTY: return "stack_missing";
    case MT_C_STACK_TRUNCATED: return "stack_truncated";
    case MT_C_NESTED: return "nested_calls";
    case MT_C_STALE_INFLIGHT: return "missed_returns";
    case MT_C_SIGNAL_FAIL: return "stop_failed";
    case MT_C_SYSARGS_FULL: return "sysargs_map_full";
    case MT_C_FAULTS_FILTERED: return "faults_filtered";
  }
  return "?";
}

bool counter_is_loss(int c) {
  return c != MT_C_NESTED && c != MT_C_FAULTS_FILTERED && c != MT_C_STACK_TRUNCATED;
}

}  // namespace

Tracer::Tracer(Options o)
    : o_(std::move(o)), resolver_([&] {
        symbolize::Options so;
        so.symbol_dirs = o_.symbol_dirs;
        so.dwarf = o_.dwarf;
        return so;
      }()) {
  system_wide_ = o_.pids.empty() && o_.comms.empty() && o_.command.empty();
}

Tracer::~Tracer() { teardown(); }

void Tracer::log(const std::string& s) {
  if (o_.verbose) std::cerr << "memtrace-bpf: " << s << "\n";
}

std::ostream& Tracer::out() {
  if (file_out_) return *file_out_;
  // Launch mode: the program owns stdout; reports go to stderr (like valgrind).
  return o_.command.empty() ? std::cout : std::cerr;
}

Result<void> Tracer::load() {
  libbpf_set_print(libbpf_print);
  struct rlimit rl = {RLIM_INFINITY, RLIM_INFINITY};
  setrlimit(RLIMIT_MEMLOCK, &rl);
  // One perf event fd per probe per process.
  struct rlimit nf;
  if (getrlimit(RLIMIT_NOFILE, &nf) == 0 && nf.rlim_cur < nf.rlim_max) {
    nf.rlim_cur = nf.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nf);
  }
  if (auto r = ensure_tracefs(); !r) return r;

  skel_ = memtrace_bpf__open();
  if (!skel_) return Error::sys("open BPF object");
  auto* ro = skel_->rodata;
  ro->self_pid = getpid();
  ro->capture_stacks = o_.stacks;
  ro->system_wide = system_wide_;
  ro->stop_on_exec_mappings = true;
  if (o_.comms.size() > MT_MAX_COMMS)
    return Error::msg("at most " + std::to_string(MT_MAX_COMMS) + " -c filters");
  ro->ncomms = o_.comms.size();
  for (size_t i = 0; i < o_.comms.size(); i++)
    strncpy(const_cast<char*>(ro->comms[i]), o_.comms[i].c_str(), MT_COMM_LEN - 1);
  size_t rb = 1;
  while (rb < o_.ringbuf_mb) rb <<= 1;
  bpf_map__set_max_entries(skel_->maps.events, rb << 20);
  ro->wakeup_bytes = (rb << 20) / 8;

  prepare_programs(skel_->progs.mt_alloc_enter, skel_->progs.mt_alloc_exit);
  if (int err = memtrace_bpf__load(skel_); err)
    return Error::sys("load BPF programs (is BPF available and are you root?)", -err);
  bpf_program__set_autoattach(skel_->progs.mt_alloc_enter, false);
  bpf_program__set_autoattach(skel_->progs.mt_alloc_exit, false);
  if (int err = memtrace_bpf__attach(skel_); err)
    return Error::sys("attach BPF tracepoints", -err);

  rb_ = ring_buffer__new(bpf_map__fd(skel_->maps.proc_events), proc_cb, this, nullptr);
  if (!rb_) return Error::sys("ring buffer");
  if (ring_buffer__add(rb_, bpf_map__fd(skel_->maps.events), event_cb, this) != 0)
    return Error::sys("ring buffer");
  attacher_ = std::make_unique<Attacher>(skel_->progs.mt_alloc_enter, skel_->progs.mt_alloc_exit);
  return {};
}

void Tracer::set_target_state(pid_t pid, uint32_t state, uint32_t follow) {
  mt_target t{state, follow};
  uint32_t key = pid;
  bpf_map_update_elem(bpf_map__fd(skel_->maps.targets), &key, &t, BPF_ANY);
}

void Tracer::resume(pid_t pid) {
  if (stopped_.erase(pid)) kill(pid, SIGCONT);
}

// Find pid's allocator and attach its probes. required: a failure is an
// error for the user (-p); otherwise it is counted (a process started later).
Result<void> Tracer::attach_process(pid_t pid, bool required) {
  Proc& p = procs_[pid];
  p.pid = pid;
  if (auto c = read_comm(pid)) model_.process(pid).comm = *c;
  resolver_.capture(pid);
  if (p.attached) return {};
  auto maps = read_maps(pid);
  if (!maps) return maps.error();
  MapEntry where;
  auto obj = attacher_->find_allocator(pid, *maps, &where);
  if (!obj) return obj.error();
  if (!*obj) {
    if (required)
      return Error::msg("process " + std::to_string(pid) + " (" + model_.process(pid).comm +
                        ") has no known allocator: no object in /proc/" + std::to_string(pid) +
                        "/maps defines malloc and free");
    return {};  // not yet: a later executable mapping may bring it
  }
  if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
  auto set = attacher_->attach(**obj, pid, openable_path(pid, where));
  if (!set) return set.error();
  p.probes = std::move(*set);
  p.attached = true;
  set_target_state(pid, MT_TS_TRACED, 1);
  log("attached " + std::to_string(p.probes.size()) + " probes to pid " + std::to_string(pid) +
      " in " + where.path);
  return {};
}

void Tracer::scan_system_allocators(pid_t only) {
  std::vector<pid_t> pids = only > 0 ? std::vector<pid_t>{only} : all_pids();
  for (pid_t pid : pids) {
    if (pid == getpid()) continue;
    auto maps = read_maps(pid);
    if (!maps) continue;
    MapEntry where;
    auto obj = attacher_->find_allocator(pid, *maps, &where);
    if (!obj || !*obj) continue;
    auto key = std::make_pair((*obj)->dev, (*obj)->inode);
    if (system_probes_.count(key)) continue;
    if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
    auto set = attacher_->attach(**obj, -1, openable_path(pid, where));
    if (!set) {
      errors_.push_back(set.error().message);
      system_probes_[key] = ProbeSet();
      continue;
    }
    log("attached system-wide to " + where.path);
    system_probes_[key] = std::move(*set);
  }
}

Result<void> Tracer::setup_targets() {
  if (system_wide_) {
    scan_system_allocators();
    if (system_probes_.empty()) return Error::msg("no process on this system maps a known allocator");
    return {};
  }
  for (pid_t pid : o_.pids) {
    set_target_state(pid, MT_TS_TRACED, 1);
    if (auto r = attach_process(pid, true); !r) return r;
  }
  if (!o_.comms.empty()) {
    for (pid_t pid : all_pids()) {
      if (pid == getpid()) continue;
      auto c = read_comm(pid);
      if (!c) continue;
      for (const auto& want : o_.comms) {
        if (*c != want) continue;
        set_target_state(pid, MT_TS_TRACED, 0);
        if (auto r = attach_process(pid, false); !r) {
          errors_.push_back(r.error().message);
          attach_failures_++;
        }
      }
    }
  }
  if (!o_.command.empty()) {
    auto l = Launcher::start(o_.command);
    if (!l) return l.error();
    launcher_.emplace(std::move(*l));
    pid_t pid = launcher_->pid();
    procs_[pid].pid = pid;
    model_.process(pid).comm = o_.command[0].substr(o_.command[0].rfind('/') + 1).substr(0, 15);
    set_target_state(pid, MT_TS_PENDING, 1);
    if (auto r = launcher_->release(); !r) {
      int st = 127 << 8;
      child_status_ = st;
      return r;
    }
  }
  return {};
}

int Tracer::on_event(void* data, size_t len) {
  if (len >= sizeof(mt_event)) {
    const auto* e = static_cast<const mt_event*>(data);
    // dlopen of new code: capture the mappings while the process lives.
    if (e->h.kind == MT_EV_MMAP && ((e->old_size >> 32) & 0x4) && static_cast<int32_t>(e->aux) >= 0 &&
        !system_wide_)
      resolver_.capture(e->h.pid);
  }
  model_.apply(data, len);
  return 0;
}

int Tracer::on_proc_event(void* data, size_t len) {
  if (len < sizeof(mt_proc_event)) return 0;
  const auto& e = *static_cast<const mt_proc_event*>(data);
  pid_t pid = e.h.pid;
  bool stopped = e.h.flags & MT_F_STOPPED;
  if (stopped) stopped_.insert(pid);
  std::string comm(e.comm, strnlen(e.comm, sizeof e.comm));

  switch (e.h.kind) {
    case MT_EV_EXEC:
      if (system_wide_) {
        scan_system_allocators(pid);
        break;
      }
      log("exec pid " + std::to_string(pid) + " (" + comm + ")");
      model_.on_exec(pid);
      model_.process(pid).comm = comm;
      procs_[pid].probes.reset();  // the old image's probes went with its mm
      procs_[pid].attached = false;
      if (auto r = attach_process(pid, false); !r) {
        errors_.push_back(r.error().message);
        attach_failures_++;
      }
      break;
    case MT_EV_LIBMAP:
      if (!procs_[pid].attached) {
        if (auto r = attach_process(pid, false); !r) {
          errors_.push_back(r.error().message);
          attach_failures_++;
        }
      }
      break;
    case MT_EV_FORK:
      log("fork " + std::to_string(e.ppid) + " -> " + std::to_string(pid));
      // Events of the parent from before the fork are already queued: apply
      // them so that the child inherits the right live blocks.
      ring_buffer__consume(rb_);
      model_.on_fork(e.ppid, pid);
      model_.process(pid).comm = comm;
      if (e.h.flags & MT_F_VFORK) {
        procs_[pid].pid = pid;
        resolver_.capture(pid);
        break;  // runs on the parent's probes until it exec's
      }
      if (auto r = attach_process(pid, false); !r) {
        errors_.push_back(r.error().message);
        attach_failures_++;
      }
      break;
    case MT_EV_EXIT: {
      log("exit pid " + std::to_string(pid) + " status " + std::to_string(e.exit_code));
      auto it = procs_.find(pid);
      if (it != procs_.end()) {
        it->second.probes.reset();
        it->second.exited = true;
      }
      if (e.exit_code >= 0 && (it != procs_.end() || system_wide_)) model_.on_exit(pid, e.exit_code);
      stopped_.erase(pid);
      break;
    }
  }
  if (stopped) resume(pid);
  return 0;
}

report::Drops Tracer::drops() {
  report::Drops d;
  int ncpu = libbpf_num_possible_cpus();
  std::vector<uint64_t> vals(ncpu > 0 ? ncpu : 1);
  for (int c = 0; c < MT_C_COUNT; c++) {
    uint32_t key = c;
    uint64_t sum = 0;
    if (skel_ && bpf_map_lookup_elem(bpf_map__fd(skel_->maps.counters), &key, vals.data()) == 0)
      for (auto v : vals) sum += v;
    (counter_is_loss(c) ? d.dropped : d.stats)[counter_name(c)] = sum;
  }
  uint64_t unknown = 0;
  for (const auto& [pid, p] : model_.processes()) unknown += p->s.unknown_frees;
  d.dropped["unknown_free"] = unknown;
  d.dropped["stack_record_missing"] = model_.missing_stacks();
  d.dropped["malformed"] = model_.malformed_records();
  d.dropped["attach_failed"] = attach_failures_;
  d.stats["events"] = model_.event_count();
  return d;
}

void Tracer::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
  // Detach every uprobe first (the targets run at full speed from here), then
  // the tracepoints; resume anything we stopped; then the maps go.
  for (auto& [pid, p] : procs_) p.probes.reset();
  system_probes_.clear();
  detach_wait();
  if (skel_) memtrace_bpf__detach(skel_);
  for (pid_t pid : std::set<pid_t>(stopped_)) resume(pid);
  if (rb_) {
    ring_buffer__free(rb_);
    rb_ = nullptr;
  }
  if (skel_) {
    memtrace_bpf__destroy(skel_);
    skel_ = nullptr;
  }
}

void Tracer::report_final(int exit_code) {
  // Mark the launched program's status (from waitpid: exact).
  if (launcher_ && child_status_) model_.on_exit(launcher_->pid(), *child_status_);
  report::Options ro;
  ro.top = o_.top;
  ro.at_exit = true;
  auto d = drops();
  std::ostream& os = out();
  if (o_.format == "json") {
    auto j = report::to_json(model_, resolver_.fn(), ro, d);
    j["errors"] = errors_;
    j["notes"] = attacher_ ? attacher_->notes() : std::vector<std::string>{};
    os << j.dump(2) << "\n";
  } else {
    report::write_text(os, model_, resolver_.fn(), ro, d);
    for (const auto& e : errors_) os << "error: " << e << "\n";
    if (attacher_)
      for (const auto& n : attacher_->notes()) os << "note: " << n << "\n";
  }
  os.flush();
}

int Tracer::run() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  if (!o_.output.empty()) {
    auto f = std::make_unique<std::ofstream>(o_.output);
    if (!*f) {
      std::cerr << "memtrace-bpf: cannot write " << o_.output << ": " << strerror(errno) << "\n";
      return 2;
    }
    file_out_ = std::move(f);
  }
  if (geteuid() != 0) {
    std::cerr << "memtrace-bpf: must run as root (BPF programs and uprobes need CAP_SYS_ADMIN/CAP_BPF)\n";
    return 2;
  }
  if (auto r = load(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    return 2;
  }
  if (auto r = setup_targets(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    // Whatever was captured so far is still reported.
    ring_buffer__consume(rb_);
    int code = child_status_ ? Launcher::exit_code_of(*child_status_) : 2;
    if (code == 0) code = 2;
    teardown();
    report_final(code);
    return code;
  }

  auto start = std::chrono::steady_clock::now();
  auto next_tick = start + std::chrono::duration<double>(o_.interval);
  int exit_code = 0;
  while (!g_stop) {
    int n = ring_buffer__poll(rb_, 50);
    if (n < 0 && n != -EINTR) {
      errors_.push_back(std::string("ring buffer poll: ") + strerror(-n));
      break;
    }
    auto now = std::chrono::steady_clock::now();
    if (launcher_) {
      int st;
      if (launcher_->poll_exit(&st)) {
        child_status_ = st;
        exit_code = Launcher::exit_code_of(st);
        break;
      }
    }
    if (!o_.pids.empty() && o_.command.empty() && o_.comms.empty()) {
      bool any = false;
      for (pid_t p : o_.pids) any |= process_exists(p);
      if (!any) break;
    }
    if (o_.duration > 0 && now - start >= std::chrono::duration<double>(o_.duration)) break;
    if (o_.interval > 0 && now >= next_tick) {
      next_tick += std::chrono::duration<double>(o_.interval);
      ring_buffer__consume(rb_);
      for (const auto& [pid, p] : model_.processes())
        if (p->s.allocs || p->s.in_use_blocks) report::write_summary_text(out(), *p, false);
      out().flush();
    }
  }
  if (g_stop && launcher_) {
    int st;
    exit_code = launcher_->poll_exit(&st) ? Launcher::exit_code_of(st) : 130;
    if (launcher_->poll_exit(&st)) child_status_ = st;
  }
  // Detach uprobes and tracepoints, then drain what is left.
  for (auto& [pid, p] : procs_) p.probes.reset();
  system_probes_.clear();
  detach_wait();
  if (skel_) memtrace_bpf__detach(skel_);
  for (pid_t pid : std::set<pid_t>(stopped_)) resume(pid);
  while (ring_buffer__consume(rb_) > 0) {
  }
  report_final(exit_code);
  teardown();
  return exit_code;
}

}  // namespace memtrace::loader
