#include "loader/tracer.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "loader/output_file.h"
#include "loader/recording.h"
#include "memtrace_bpf.skel.h"
#include "memtrace_bpf_compat.skel.h"
#include "inject/session.h"
#include "metrics/exporter.h"

namespace memtrace::loader {
namespace {

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }
void on_child(int) {}  // interrupts the ring-buffer poll: the exit is seen at once

int event_cb(void* ctx, void* data, size_t len) {
  return static_cast<Tracer*>(ctx)->on_event(data, len);
}
int proc_cb(void* ctx, void* data, size_t len) {
  return static_cast<Tracer*>(ctx)->on_proc_event(data, len);
}

// libbpf's warnings, kept so that a refused program can be named with the
// verifier's reason (MEMTRACE_LIBBPF_VERBOSE=1 also prints them as they come).
std::string g_libbpf_log;

int libbpf_print(enum libbpf_print_level level, const char* fmt, va_list args) {
  if (level == LIBBPF_DEBUG) return 0;
  va_list copy;
  va_copy(copy, args);
  char buf[8192];
  int n = vsnprintf(buf, sizeof buf, fmt, copy);
  va_end(copy);
  if (n > 0) {
    g_libbpf_log.append(buf, std::min<size_t>(n, sizeof buf - 1));
    if (g_libbpf_log.size() > (1u << 20)) g_libbpf_log.erase(0, g_libbpf_log.size() - (1u << 19));
  }
  if (getenv("MEMTRACE_LIBBPF_VERBOSE")) return vfprintf(stderr, fmt, args);
  return 0;
}

// "the kernel refused BPF program 'mt_alloc_enter' (Permission denied):
// combined stack size of 4 calls is 544. Too large": the program libbpf says
// failed, and the last lines of its verifier log.
std::string load_failure(int err) {
  const std::string& log = g_libbpf_log;
  std::string prog;
  size_t at = log.rfind("BPF program load failed");
  if (at != std::string::npos) {
    size_t q2 = log.rfind('\'', at), q1 = q2 == std::string::npos ? q2 : log.rfind('\'', q2 - 1);
    if (q1 != std::string::npos) prog = log.substr(q1 + 1, q2 - q1 - 1);
  }
  if (prog.empty()) {
    // libbpf's first warning says what went wrong (a map it could not
    // create, a relocation); the later ones only that the object failed.
    std::string first;
    std::istringstream is(log);
    for (std::string l; std::getline(is, l) && first.empty();)
      if (!l.empty()) first = l.rfind("libbpf: ", 0) == 0 ? l.substr(8) : l;
    return "load BPF programs: " + std::string(strerror(err)) + (first.empty() ? "" : " (libbpf: " + first + ")");
  }
  std::vector<std::string> lines;
  size_t b = log.find("-- BEGIN PROG LOAD LOG --", at), e = log.find("-- END PROG LOAD LOG --", at);
  if (b != std::string::npos && e != std::string::npos && e > b) {
    std::istringstream is(log.substr(b, e - b));
    for (std::string l; std::getline(is, l);)
      if (!l.empty() && l.rfind("--", 0) != 0 && l.rfind("processed ", 0) != 0 &&
          l.rfind("verification time", 0) != 0 && l.rfind("stack depth", 0) != 0)
        lines.push_back(l);
  }
  std::string why;
  for (size_t i = lines.size() > 3 ? lines.size() - 3 : 0; i < lines.size(); i++)
    why += (why.empty() ? "" : " | ") + lines[i];
  return "the kernel refused BPF program '" + prog + "' (" + strerror(err) + ")" + (why.empty() ? "" : ": " + why) +
         " (MEMTRACE_LIBBPF_VERBOSE=1 prints the verifier's whole log)";
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
    case MT_C_FAULT_RINGBUF_FULL: return "fault_ringbuf";
    case MT_C_FAULT_VMA_BUSY: return "fault_vma_unchecked";
  }
  return "?";
}

bool counter_is_loss(int c) {
  return c != MT_C_NESTED && c != MT_C_FAULTS_FILTERED && c != MT_C_STACK_TRUNCATED &&
         c != MT_C_FAULT_VMA_BUSY;
}

// The full object, or the compat one (kernels before 5.17) through the same
// skeleton: bpf/skeletons_agree.py checks at build time that the compat
// object has every map and program the skeleton names and the same
// read-only variables.
memtrace_bpf* open_skeleton(bool full) {
  auto* obj = static_cast<memtrace_bpf*>(calloc(1, sizeof(memtrace_bpf)));
  if (!obj) return nullptr;
  int err = memtrace_bpf__create_skeleton(obj);
  if (!err && !full) obj->skeleton->data = const_cast<void*>(memtrace_bpf_compat__elf_bytes(&obj->skeleton->data_sz));
  if (!err) err = bpf_object__open_skeleton(obj->skeleton, nullptr);
  if (err) {
    memtrace_bpf__destroy(obj);
    errno = -err;
    return nullptr;
  }
  return obj;
}

}  // namespace

Tracer::Tracer(Options o)
    : o_(std::move(o)), resolver_([&] {
        symbolize::Options so;
        so.symbol_dirs = o_.symbol_dirs;
        so.dwarf = o_.dwarf;
        so.defer_debuginfod = true;  // the drain thread must not wait on a download: final report only
        return so;
      }()) {
  system_wide_ = o_.pids.empty() && o_.comms.empty() && o_.command.empty();
  if (const char* c = getenv("MEMTRACE_TEST_UNREADABLE_COMM")) o_.test_unreadable_comm = c;
  // Mappings rebuilt from the kernel's records go into a recording too.
  resolver_.on_given([this](pid_t pid, const std::vector<procfs::Mapping>& maps) {
    if (feat_) feat_->snapshot_maps(pid, &maps);
  });
  if (const char* n = getenv("MEMTRACE_DRAIN_NICE")) o_.drain_nice = atoi(n);  // benchmarks: A/B
  if (o_.faults) {
    maps_cache_ = std::make_unique<MapsCache>();
    heap::FaultObserver observer;
    if (o_.trace_faults) {
      // Like the report: the launched program owns stdout.
      fault_trace_ = std::make_unique<FaultTrace>([this]() -> std::ostream& { return out(); }, o_.format == "json",
                                                  resolver_, model_);
      observer = [this](const heap::Process& p, const mt_event& e, const heap::FaultHit& h) {
        // The launched child runs our own code until its exec: not the program's faults.
        if (launcher_ && p.pid == launcher_->pid() && !p.exec_count) return;
        fault_trace_->line(p, e, h);
      };
    }
    model_.enable_faults(
        [this](pid_t pid, uint64_t a, uint64_t ts) {
          const heap::Process* p = model_.find(pid);
          return maps_cache_->lookup(pid, a, ts, p ? p->exec_count : 0);
        },
        std::move(observer));
  }
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
  kf_ = probe_kernel();
  if (!kf_.can_run()) {
    for (const auto& l : describe(kf_))
      if (l.rfind("missing", 0) == 0) return Error::msg("memtrace-bpf cannot run here: " + l.substr(9));
    return Error::msg("memtrace-bpf cannot run here (memtrace-bpf --check says why)");
  }
  if (auto r = ensure_tracefs(); !r) return r;
  if (o_.faults && !kf_.page_fault_tp)
    return Error::msg("--faults: kernel " + kf_.release + " has no exceptions:page_fault_user tracepoint");
  full_bpf_ = choose_full_bpf(kf_);
  if (!full_bpf_) {
    if (o_.rearm_ms > 0)
      return Error::msg("--rearm needs bpf_find_vma (kernel 5.17), which kernel " + kf_.release + " does not have");
    kernel_notes_.push_back("kernel " + kf_.release + ": the BPF programs for kernels before 5.17 (it lacks " +
                            (kf_.full_bpf() ? std::string("nothing: MEMTRACE_BPF_VARIANT=compat") : kf_.full_bpf_missing()) +
                            ")");
    if (o_.stacks && o_.cfi) {
      o_.cfi = false;
      kernel_notes_.push_back("stacks: frame pointers only (the CFI unwinder needs bpf_loop, kernel 5.17)");
    }
    if (o_.faults)
      kernel_notes_.push_back("page faults: not checked against their VMA (bpf_find_vma needs kernel 5.17): "
                              "faults that end in SIGSEGV are not flagged");
    attach_mode_ = AttachMode::PerfEventPerRole;
  } else {
    attach_mode_ = kf_.uprobe_multi ? AttachMode::UprobeMulti : AttachMode::PerfEvent;
    // Benchmarks compare the two attach mechanisms on one kernel.
    if (const char* a = getenv("MEMTRACE_UPROBE_ATTACH"); a && std::string(a) == "perf")
      attach_mode_ = AttachMode::PerfEvent;
  }
  if (attach_mode_ == AttachMode::PerfEvent)
    kernel_notes_.push_back("uprobes: one perf-event uprobe per probe and process: kernel " + kf_.release +
                            " has no uprobe_multi links (6.6)");

  skel_ = open_skeleton(full_bpf_);
  if (!skel_) return Error::sys("open BPF object");
  auto* ro = skel_->rodata;
  ro->self_pid = getpid();
  ro->capture_stacks = o_.stacks;
  ro->system_wide = system_wide_;
  ro->stop_on_exec_mappings = true;
  ro->exit_has_group_dead = kf_.exit_group_dead;
  if (o_.comms.size() > MT_MAX_COMMS)
    return Error::msg("at most " + std::to_string(MT_MAX_COMMS) + " -c filters");
  ro->ncomms = o_.comms.size();
  for (size_t i = 0; i < o_.comms.size(); i++)
    strncpy(const_cast<char*>(ro->comms[i]), o_.comms[i].c_str(), MT_COMM_LEN - 1);
  // Sized to the work: a launched program or -p processes peak at a few
  // MiB of backlog (W1, 1 M events/s: 2.5 MiB), system-wide and -c take
  // whatever starts (a build: 10-28 MiB, bench/busy_host). The ring's pages
  // count in the tool's RSS.
  size_t want = o_.ringbuf_mb ? o_.ringbuf_mb : system_wide_ || !o_.comms.empty() ? 64 : 16;
  size_t rb = 1;
  while (rb < want) rb <<= 1;
  bpf_map__set_max_entries(skel_->maps.events, rb << 20);
  ro->wakeup_bytes = (rb << 20) / 8;

  bool cfi = o_.stacks && o_.cfi;
  skel_->rodata->unwind_disabled = !cfi;
  if (!cfi) bpf_map__set_max_entries(skel_->maps.unwind_shards, 1);
  {
    // The walk memo is per CPU: up to 1024 entries, within 32 MiB in all
    // (1024 on up to ~24 CPUs, 256 on 64, 16 at the least).
    size_t ncpu = std::max(1, libbpf_num_possible_cpus());
    size_t fit = (size_t(32) << 20) / (ncpu * std::max<size_t>(1, bpf_map__value_size(skel_->maps.unwind_memo)));
    uint32_t most = bpf_map__max_entries(skel_->maps.unwind_memo), n = 16;
    while (n * 2 <= fit && n * 2 <= most) n *= 2;
    if (!cfi) n = 1;
    bpf_map__set_max_entries(skel_->maps.unwind_memo, n);
    skel_->rodata->unwind_memo_mask = n - 1;
  }
  // Not even loaded without --faults: costs nothing when off.
  bpf_program__set_autoload(skel_->progs.mt_page_fault, o_.faults);
  // The mmap family and the fork child's first return: fentry/fexit where
  // the kernel has trampolines for them (no syscalls:* tracepoint attached,
  // kernel_features.h), else the tracepoints.
  bool fexit = syscall_fexit_ = full_bpf_ && choose_syscall_fexit(kf_);
  for (bpf_program* p : {skel_->progs.mt_fexit_mmap, skel_->progs.mt_fentry_munmap, skel_->progs.mt_fexit_mremap,
                         skel_->progs.mt_fexit_brk, skel_->progs.mt_fexit_schedule_tail})
    bpf_program__set_autoload(p, fexit);
  for (bpf_program* p : {skel_->progs.mt_enter_mmap, skel_->progs.mt_exit_mmap, skel_->progs.mt_enter_munmap,
                         skel_->progs.mt_enter_mremap, skel_->progs.mt_exit_mremap, skel_->progs.mt_enter_brk,
                         skel_->progs.mt_exit_brk, skel_->progs.mt_exit_clone, skel_->progs.mt_exit_clone3,
                         skel_->progs.mt_exit_fork, skel_->progs.mt_exit_vfork})
    bpf_program__set_autoload(p, !fexit);
#if defined(__aarch64__)
  // arm64 has no fork and no vfork system call (clone does both): no
  // sys_exit_fork/sys_exit_vfork tracepoints to attach to.
  bpf_program__set_autoload(skel_->progs.mt_exit_fork, false);
  bpf_program__set_autoload(skel_->progs.mt_exit_vfork, false);
#endif
  prepare_programs(skel_->progs.mt_alloc_enter, skel_->progs.mt_alloc_exit, attach_mode_);
  g_libbpf_log.clear();
  if (int err = memtrace_bpf__load(skel_); err) return Error::msg(load_failure(-err));
  // Before any program is attached: from here on, a process can be stopped.
  if (guardian_)
    if (auto r = guardian_->arm(bpf_map__fd(skel_->maps.stopped), bpf_map__fd(skel_->maps.loader_gone),
                                bpf_map__fd(skel_->maps.targets));
        !r)
      return r;
  bpf_program__set_autoattach(skel_->progs.mt_alloc_enter, false);
  bpf_program__set_autoattach(skel_->progs.mt_alloc_exit, false);
  if (int err = memtrace_bpf__attach(skel_); err)
    return Error::sys("attach BPF tracepoints", -err);

  // One ring_buffer per ring: the events ring is drained on its own from
  // inside proc-event callbacks, and each ring_buffer maps its ring (twice
  // its size: a ring mapped by two made the tool's RSS 280 MB at 64 MiB).
  rb_ = ring_buffer__new(bpf_map__fd(skel_->maps.proc_events), proc_cb, this, nullptr);
  if (!rb_) return Error::sys("ring buffer");
  rb_events_ = ring_buffer__new(bpf_map__fd(skel_->maps.events), event_cb, this, nullptr);
  if (!rb_events_) return Error::sys("ring buffer");
  {
    // The events ring's consumer and producer positions, read-only: how full
    // it gets (ringbuf_peak_kb).
    long pg = sysconf(_SC_PAGESIZE);
    int fd = bpf_map__fd(skel_->maps.events);
    for (int i = 0; i < 2; i++) {
      void* p = mmap(nullptr, pg, PROT_READ, MAP_SHARED, fd, i * pg);
      ring_pos_[i] = p == MAP_FAILED ? nullptr : static_cast<const uint64_t*>(p);
    }
  }
  epoll_ = Fd(epoll_create1(EPOLL_CLOEXEC));
  for (ring_buffer* r : {rb_, rb_events_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (!epoll_.valid() || epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, ring_buffer__epoll_fd(r), &ev) != 0)
      return Error::sys("epoll for the ring buffers");
  }
  std::vector<bpf_program*> enter = {skel_->progs.mt_alloc_enter};
  if (attach_mode_ == AttachMode::PerfEventPerRole)
    for (uint32_t r = 1; r < MT_ROLE_COUNT; r++) {
      std::string name = "mt_alloc_enter_" + std::to_string(r);
      bpf_program* p = bpf_object__find_program_by_name(skel_->obj, name.c_str());
      if (!p) return Error::msg("BPF object without " + name);
      enter.push_back(p);
    }
  attacher_ = std::make_unique<Attacher>(std::move(enter), skel_->progs.mt_alloc_exit, attach_mode_, o_.allocator);
  if (cfi) {
    auto u = unwind::UnwindMaps::create(skel_->maps.unwind_shards, skel_->maps.unwind_procs,
                                        skel_->maps.unwind_epoch, o_.unwind_mb << 20);
    if (!u) return u.error();
    unwind_ = std::move(*u);
    unwind_->set_files_map(bpf_map__fd(skel_->maps.unwind_files));
  }
  return {};
}

void Tracer::set_target_state(pid_t pid, uint32_t state, uint32_t follow) {
  if (std::find(o_.pids.begin(), o_.pids.end(), pid) != o_.pids.end()) follow |= MT_FOLLOW_NO_STOP;
  uint32_t key = pid;
  mt_target t{};
  bpf_map_lookup_elem(bpf_map__fd(skel_->maps.targets), &key, &t);  // keeps its image
  t.state = state;
  t.follow = follow;
  bpf_map_update_elem(bpf_map__fd(skel_->maps.targets), &key, &t, BPF_ANY);
}

// Unwind tables for pid's executable mappings (refreshes: also after exec,
// dlopen). Failures leave the frame-pointer fallback; they are noted once.
void Tracer::unwind_add(Snapshot& snap) {
  if (!unwind_) return;
  pid_t pid = snap.pid();
  const auto* maps = snap.maps();
  if (auto r = maps ? unwind_->add_process(pid, maps) : snap.error(); !r) {
    if (!process_exists(pid) || r.error().err == ESRCH) {
      unwind_gone_++;  // exited before its mappings were read: nothing left to unwind
      return;
    }
    if (unwind_errors_++ < 5) errors_.push_back(r.error().message);
  }
}

// The image pid is in (the BPF side counts its execs): its probes carry it.
uint32_t Tracer::image_of(pid_t pid) {
  uint32_t key = pid;
  mt_target t{};
  if (bpf_map_lookup_elem(bpf_map__fd(skel_->maps.targets), &key, &t) != 0) return 0;
  return t.image;
}

// bpf_send_signal from a tracepoint (preemption off) sends the SIGSTOP
// through irq_work, which may run after we read the record: a SIGCONT
// before it lands is undone by it and the process stays stopped for good
// (1 in ~150 launches of an exec storm on a loaded machine). Wait until
// the stop is in effect (or the process is gone), 200 ms at most.
void Tracer::wait_stop_landed(pid_t pid) {
  for (int i = 0; i < 2000; i++) {
    char st = process_state(pid);
    if (st == 'T' || st == 't' || st == 0 || st == 'Z' || st == 'X') break;
    usleep(100);
  }
}

void Tracer::resume(pid_t pid) {
  if (!stopped_.count(pid)) return;
  wait_stop_landed(pid);
  kill(pid, SIGCONT);
  forget_stopped(pid);  // after the kill: a loader killed in between leaves one more SIGCONT to the guardian
}

void Tracer::forget_stopped(pid_t pid) {
  stopped_.erase(pid);
  uint32_t key = pid;
  if (skel_) bpf_map_delete_elem(bpf_map__fd(skel_->maps.stopped), &key);
}

// System-wide: code a process mapped, as the kernel did it (the resolver
// uses it if the process is gone before its maps are read).
void Tracer::on_map_event(const mt_map_event& e) {
  KernelMapping k;
  k.exe = e.is_exe;
  k.start = e.start;
  k.end = e.end;
  if (e.is_exe) {
    k.base = e.pgoff;
    k.exec_id = exec_ids_.count(e.h.pid) ? exec_ids_[e.h.pid] : 0;
  } else {
    k.offset = e.pgoff;
  }
  k.dev = makedev(e.dev >> 20, e.dev & 0xfffff);  // the kernel's dev_t, as /proc/PID/maps prints it
  k.inode = e.ino;
  k.path.assign(e.path, strnlen(e.path, sizeof e.path));
  k.name_cut = !e.is_exe && k.path.size() == MT_MAP_NAME_LEN - 1;  // the name's first 47 bytes
  resolver_.kernel_mapped(e.h.pid, k);
}

void Tracer::process_gone(pid_t pid, int exit_code) {
  // --inject: its records in the agent's ring are all written (it exited):
  // in before its exit, which may retire it right below.
  if (!injected_.empty()) drain_injected(true);
  // The launched program stays current: its waitpid status is the report's.
  if (launcher_ && pid == launcher_->pid()) {
    model_.on_exit(pid, exit_code);
    return;
  }
  // Its records are in the events ring before the producer's position now,
  // and so is the fork that made it (system-wide, the events ring's
  // MT_EV_FORK is the only one): it exits in the model, and retires, once
  // the drain is past that position (retire_exited). Sooner, its last
  // records would land in no image, and an exit applied before its fork
  // made an image that never ended.
  uint64_t until = ring_pos_[1] ? __atomic_load_n(ring_pos_[1], __ATOMIC_ACQUIRE) : 0;
  exited_.push_back({until, pid, exit_code});
  retire_exited();
}

void Tracer::retire_exited(bool all) {
  uint64_t done = ring_pos_[0] && !all ? __atomic_load_n(ring_pos_[0], __ATOMIC_ACQUIRE) : ~uint64_t{0};
  while (!exited_.empty() && exited_.front().until <= done) {
    Exited x = exited_.front();
    exited_.pop_front();
    model_.on_exit(x.pid, x.code);
    if (!model_.retire(x.pid, !system_wide_)) continue;  // a new process has the pid
    resolver_.forget(x.pid);
    if (auto it = procs_.find(x.pid); it != procs_.end() && it->second.exited) procs_.erase(it);  // -c: one per process
  }
}

void Tracer::collect_stacks() {
  auto dropped = model_.collect_stacks();
  stacks_collected_ += dropped.size();
  stacks_gc_at_ = std::max(stacks_gc_at_, 2 * model_.stack_count());
  if (dropped.empty() || !skel_) return;
  // BPF sends a stack once (stacks_seen, and a per-CPU cache of recent ids):
  // forget these there, so that a stack seen again is sent again.
  int seen = bpf_map__fd(skel_->maps.stacks_seen);
  for (uint64_t id : dropped) bpf_map_delete_elem(seen, &id);
  int cache = bpf_map__fd(skel_->maps.stacks_sent_cache);
  int ncpu = libbpf_num_possible_cpus();
  std::vector<uint64_t> zero(ncpu > 0 ? ncpu : 1, 0);
  uint32_t n = bpf_map__max_entries(skel_->maps.stacks_sent_cache);
  for (uint32_t k = 0; k < n; k++) bpf_map_update_elem(cache, &k, zero.data(), BPF_ANY);
}

const std::vector<MapEntry>* Tracer::Snapshot::maps() {
  if (!m_) {
    m_ = read_maps(pid_);
    ++*reads_;
  }
  return *m_ ? &**m_ : nullptr;
}

Result<void> Tracer::Snapshot::error() {
  if (maps()) return {};
  return m_->error();
}

// Find pid's allocator and attach its probes. required: a failure is an
// error for the user (-p); otherwise it is counted (a process started later).
Result<void> Tracer::attach_process(pid_t pid, bool required, Snapshot* given) {
  Snapshot own(pid, &maps_reads_);
  Snapshot& snap = given ? *given : own;
  Proc& p = procs_[pid];
  p.pid = pid;
  if (auto c = read_comm(pid)) model_.process(pid).comm = *c;
  const auto* maps = snap.maps();
  resolver_.capture(pid, maps);
  if (p.attached) return {};
  if (!maps) return snap.error();
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
  // Allocator entries an earlier, killed --inject session left patched
  // (its stubs run the probed instructions past the uprobes): put back
  // before the uprobes go on (docs/inject.md).
  if (auto r = inject::restore_left_patched(pid, *maps); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message
              << ": its allocator calls through the agent's hooks pass the uprobes: its counts will be incomplete\n";
    inject_leftovers_unrestored_++;
  } else if (*r) {
    std::cerr << "memtrace-bpf: pid " << pid << ": restored " << *r
              << " allocator entries left patched by an earlier --inject session\n";
    inject_leftovers_restored_++;
  }
  if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
  auto t0 = std::chrono::steady_clock::now();
  auto set = attacher_->attach(**obj, pid, openable_path(pid, where), image_of(pid));
  if (!set) return set.error();
  uint64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  attach_us_ += us;
  attach_count_++;
  p.probes = std::move(*set);
  p.attached = true;
  // A C++ runtime whose aligned operator new rounds the size up before
  // aligned_alloc (libstdc++): entry probes there for the size the program
  // asked for. Mapped later (dlopen): attach_more_allocators.
  for (const auto& [cxx, m] : attacher_->cxx_runtimes(pid, *maps)) {
    if (o_.explain_probes) std::cerr << Attacher::explain(*cxx);
    auto more = attacher_->attach(*cxx, pid, openable_path(pid, m), image_of(pid));
    if (!more) {
      errors_.push_back(more.error().message);
      attach_failures_++;
      continue;
    }
    p.probes.absorb(std::move(*more));
  }
  // The files already mapped are settled: a later mapping of a new file may
  // bring a second allocator (attach_more_allocators).
  for (const auto& m : *maps)
    if (m.exec() && m.file()) p.objects.insert({m.dev, m.inode});
  unwind_add(snap);
  set_target_state(pid, MT_TS_TRACED, 1);
  log("attached " + std::to_string(p.probes.size()) + " probes to pid " + std::to_string(pid) + " in " + where.path +
      " (" + std::to_string(us) + " us)");
  return {};
}

// A traced process mapped new code (it is stopped): a library that is an
// allocator of another family than the one attached (mimalloc dlopen'd by a
// glibc program) gets its own probes too. glibc arriving after a preloaded
// allocator does not: the program's calls go to the preloaded one.
void Tracer::attach_more_allocators(Snapshot& snap) {
  pid_t pid = snap.pid();
  Proc& p = procs_[pid];
  const auto* maps = snap.maps();
  if (!maps) return;
  for (const auto& m : *maps) {
    if (!m.exec() || !m.file()) continue;
    auto key = std::make_pair(static_cast<uint64_t>(m.dev), m.inode);
    if (!p.objects.insert(key).second) continue;
    auto obj = attacher_->object_at(pid, m);
    if (!obj || !*obj || (*obj)->family == "glibc") continue;
    if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
    auto set = attacher_->attach(**obj, pid, openable_path(pid, m), image_of(pid));
    if (!set) {
      errors_.push_back(set.error().message);
      attach_failures_++;
      continue;
    }
    log("attached " + std::to_string(set->size()) + " more probes to pid " + std::to_string(pid) + " in " +
        m.path);
    p.probes.absorb(std::move(*set));
  }
}

// System-wide: a record of pid's at `ts` (an exec, a new executable
// mapping) asks for its mappings; a read begun after ts has them already
// (ld.so maps a program's libraries in a burst: one read for the burst).
void Tracer::read_process_once(pid_t pid, uint64_t ts, uint64_t exec_id) {
  auto it = last_read_ns_.find(pid);
  if (it != last_read_ns_.end() && it->second > ts) return;
  last_read_ns_[pid] = monotonic_ns();  // features.h: bpf_ktime_get_ns's clock
  scan_system_allocators(pid, exec_id);
}

// System-wide: an attach through a file of pid's that failed because pid
// went meanwhile (its file reached through /proc/PID: a container's) is
// not the file's fault: the next process that maps it tries again.
bool Tracer::attach_again_later(pid_t pid, const std::string& why) {
  if (process_exists(pid)) return false;
  log("pid " + std::to_string(pid) + " went during its attach (" + why + "); the next process mapping the file tries again");
  return true;
}

void Tracer::scan_system_allocators(pid_t only, uint64_t exec_id) {
  if (self_exe_.second == 0) {
    struct stat st {};
    if (stat("/proc/self/exe", &st) == 0) self_exe_ = {static_cast<uint64_t>(st.st_dev), st.st_ino};
  }
  std::vector<pid_t> pids = only > 0 ? std::vector<pid_t>{only} : all_pids();
  for (pid_t pid : pids) {
    if (pid == getpid()) continue;
    Snapshot snap(pid, &maps_reads_);
    // Tests: a process of this name is taken for gone before its maps are
    // read (what a short process system-wide often is).
    if (!o_.test_unreadable_comm.empty() && read_comm(pid).value_or("") == o_.test_unreadable_comm) {
      resolver_.unreadable(pid, exec_id);
      continue;
    }
    const auto* maps = snap.maps();
    if (!maps) {
      // Gone before this read (an exec or a new library of a short process):
      // the resolver counts it (mappings_not_captured / _incomplete).
      if (only > 0) exec_id ? resolver_.exec(pid, exec_id) : resolver_.capture(pid);
      continue;
    }
    if (only <= 0)
      if (auto c = read_comm(pid)) model_.process(pid).comm = *c;
    // Mappings for symbolization, while it lives (the read above: one per event).
    if (exec_id) resolver_.exec(pid, exec_id, maps);
    else resolver_.capture(pid, maps);
    unwind_add(snap);
    // C++ runtimes (libstdc++'s aligned operator new), once per file.
    for (const auto& [cxx, m] : attacher_->cxx_runtimes(pid, *maps)) {
      auto ckey = std::make_pair(cxx->dev, cxx->inode);
      if (system_probes_.count(ckey)) continue;
      if (o_.explain_probes) std::cerr << Attacher::explain(*cxx);
      auto set = attacher_->attach(*cxx, -1, openable_path(pid, m));
      if (!set && attach_again_later(pid, set.error().message)) continue;
      if (!set) errors_.push_back(set.error().message);
      else log("attached system-wide to " + m.path);
      system_probes_[ckey] = set ? std::move(*set) : ProbeSet();
    }
    MapEntry where;
    auto obj = attacher_->find_allocator(pid, *maps, &where);
    if (!obj || !*obj) continue;
    auto key = std::make_pair((*obj)->dev, (*obj)->inode);
    if (system_probes_.count(key)) continue;
    // Never this tool's own binary (statically linked: its malloc is in it;
    // the guardian maps it too): its own allocations would each trap into
    // the kernel, and the drain thread allocates for every event it applies
    // (a 2-job C++ build: 70% of the tool's CPU was uprobe traps, 20.6 M
    // events dropped in 110 s).
    if (key == self_exe_) continue;
    // Nor another copy of this tool (a second user, an A/B build): two
    // system-wide tracers would trace each other's every event.
    if (std::string base = where.path.substr(where.path.rfind('/') + 1); base.rfind("memtrace-bpf", 0) == 0) {
      log("not probing " + where.path + " (another memtrace-bpf)");
      system_probes_[key] = ProbeSet();
      continue;
    }
    if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
    auto set = attacher_->attach(**obj, -1, openable_path(pid, where));
    if (!set) {
      if (attach_again_later(pid, set.error().message)) continue;
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
    // A machine (a container, a small guest) where nothing running maps an
    // allocator yet: a program that starts later gets its libc's probes at
    // its libc's mmap (MT_EV_LIBMAP), from then on.
    if (system_probes_.empty())
      std::cerr << "memtrace-bpf: no running process maps a known allocator yet; the first programs that map "
                   "one are traced from when its probes are in\n";
    return {};
  }
  for (pid_t pid : o_.pids) {
    set_target_state(pid, MT_TS_TRACED, 1);
    if (auto r = o_.inject ? inject_or_attach(pid, true) : attach_process(pid, true); !r) return r;
  }
  if (!o_.comms.empty()) {
    for (pid_t pid : all_pids()) {
      if (pid == getpid()) continue;
      auto c = read_comm(pid);
      if (!c) continue;
      for (const auto& want : o_.comms) {
        if (*c != want) continue;
        set_target_state(pid, MT_TS_TRACED, 0);
        if (auto r = o_.inject ? inject_or_attach(pid, false) : attach_process(pid, false); !r) {
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
    model_.process(pid).prelude = true;  // our code until its exec (its page faults, say)
    set_target_state(pid, MT_TS_PENDING, 1);
    if (auto r = launcher_->release(); !r) {
      int st = 127 << 8;
      child_status_ = st;
      return r;
    }
  }
  return {};
}

// --inject: the agent loaded into pid (src/inject); its records come
// through the session's ring (drain_injected), BPF's targets entry keeps
// pid's mmap/brk and lifecycle records coming.
Result<void> Tracer::inject_process(pid_t pid, inject::StoppedProcess* held) {
  procs_[pid].pid = pid;
  if (auto c = read_comm(pid)) model_.process(pid).comm = *c;
  inject::SessionOptions so;
  so.held = held;
  so.agent = inject::agent_path();
  so.ring_mb = o_.inject_ring_mb;
  so.stack_mode = !o_.stacks ? MT_INJ_STACK_NONE : o_.cfi ? MT_INJ_STACK_LIBUNWIND : MT_INJ_STACK_FP;
  auto t0 = std::chrono::steady_clock::now();
  auto s = inject::Session::start(pid, so);
  if (!s) return s.error();
  uint64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  attach_us_ += us;
  attach_count_++;
  procs_[pid].attached = true;
  procs_[pid].injected = true;
  // Its mappings with the agent (and libunwind) in them, for symbolization.
  // (BPF's mmap stacks of an injected process walk frame pointers: no CFI
  // tables are loaded for it.)
  resolver_.capture(pid);
  const auto& h = (*s)->ring().hdr();
  log("injected " + so.agent + " into pid " + std::to_string(pid) + ": " + std::to_string(h.slots_hooked) +
      " GOT slots in " + std::to_string(h.objects_hooked) + " objects, stacks by " +
      (h.stack_used == MT_INJ_STACK_LIBUNWIND ? "libunwind" : h.stack_used == MT_INJ_STACK_FP ? "frame pointers" : "none") +
      "; stopped " + std::to_string((*s)->load_stats().stopped_us) + " us (" + std::to_string(us) + " us in all)");
  // Its records copied out of the ring as they come, up to 4x the ring
  // held here while the model catches up (the target waits only past it).
  (*s)->start_copier(o_.inject_ring_mb << 22);
  injected_.push_back(std::move(*s));
  return {};
}

namespace {
void say_not_injected(pid_t pid, const Error& why) {
  std::cerr << "memtrace-bpf: --inject: " << why.message << "; pid " << pid << " is traced with uprobes instead\n";
}
}  // namespace

// A process the agent cannot go into (static, seccomp, ptrace refused, a
// preloaded allocator, no agent library) is traced by uprobes: one line
// says why (issue 21).
Result<void> Tracer::inject_or_attach(pid_t pid, bool given) {
  auto r = inject_process(pid);
  if (r) return r;
  say_not_injected(pid, r.error());
  return attach_process(pid, given);
}

// --inject, a process stopped by BPF at its exec (the launched program, a
// new -c process, an injected one that exec'd): run to its entry point
// under ptrace, where its libraries are loaded and relocated, and the
// agent loaded there, before any of its code runs. Until then uprobes
// record it as on the BPF path (ld.so's allocations and the libraries'
// constructors'): attached at its exec, or at BPF's stop when it maps its
// allocator (taken here under ptrace). At the entry the process is held:
// no call of its is under way; the uprobes' records so far go to the model,
// the rest of theirs is dropped (handed_over_), and the agent records from
// the next call on: nothing counted twice or lost (issue 21, item 7). A
// static program is traced by uprobes from its exec; one the agent cannot
// go into at its entry, from there (held until they are attached).
Result<void> Tracer::inject_at_exec(pid_t pid, Snapshot& snap) {
  wait_stop_landed(pid);
  if (auto r = [&]() -> Result<void> {
        if (auto c = inject::can_inject(pid); !c) return c.error();
        if (access(inject::agent_path().c_str(), R_OK) != 0) return Error::sys("agent library " + inject::agent_path());
        return {};
      }();
      !r) {
    say_not_injected(pid, r.error());
    return attach_process(pid, false, &snap);
  }
  if (auto r = attach_process(pid, false, &snap); !r) {
    errors_.push_back(r.error().message);
    attach_failures_++;
  }
  int swallowed = 0;
  auto held = inject::hold_at_entry(pid, 10000, [&] {
    swallowed++;
    if (procs_[pid].attached) return;
    Snapshot now(pid, &maps_reads_);
    if (auto r = attach_process(pid, false, &now); !r) {
      errors_.push_back(r.error().message);
      attach_failures_++;
    }
  });
  if (swallowed) swallowed_[pid] += swallowed;
  if (!held) {
    say_not_injected(pid, held.error());
    if (procs_[pid].attached) return {};
    Snapshot now(pid, &maps_reads_);
    return attach_process(pid, false, &now);
  }
  // The handover: the uprobes' records so far into the model; theirs from
  // here on (the agent's own load, then calls the agent records) dropped.
  // No stops at the agent's own mappings (libunwind) nor at later ones:
  // its dlopen hook covers new code.
  drain_events();
  handed_over_.insert(pid);
  uint32_t key = pid;
  mt_target t{};
  bpf_map_lookup_elem(bpf_map__fd(skel_->maps.targets), &key, &t);
  bool probed = procs_[pid].attached;
  set_target_state(pid, MT_TS_TRACED, t.follow | MT_FOLLOW_NO_STOP);
  Result<void> why = inject_process(pid, held->get());
  if (why) {
    procs_[pid].probes.reset();  // closed in the background; handed_over_ until then
    return why;
  }
  // Not injected: the uprobes go on from here (the call's own records dropped).
  say_not_injected(pid, why.error());
  drain_events();
  handed_over_.erase(pid);
  set_target_state(pid, MT_TS_TRACED, t.follow);
  if (probed) return {};
  Snapshot at_entry(pid, &maps_reads_);
  return attach_process(pid, false, &at_entry);
}

// --inject: an allocator call of a process handed over to its agent at its
// entry point (inject_at_exec), recorded by its uprobes, which are closed
// in the background and still fire meanwhile: the agent has the call.
bool Tracer::handed_over_call(const void* data, size_t len) const {
  if (len < sizeof(mt_event)) return false;
  const auto* e = static_cast<const mt_event*>(data);
  uint32_t k = e->h.kind;
  return (k == MT_EV_ALLOC || k == MT_EV_FREE || k == MT_EV_ALLOC_FAIL || k == MT_EV_REALLOC_FAIL) &&
         e->role < MT_ROLE_COUNT && handed_over_.count(static_cast<pid_t>(e->h.pid));
}

size_t Tracer::drain_injected(bool flush) {
  size_t n = 0;
  for (auto& s : injected_)
    n += s->drain(
        [this](const void* d, size_t len) {
          model_.apply(d, len);
          if (feat_) feat_->on_event(d, len);
        },
        SIZE_MAX, flush);
  return n;
}

void Tracer::detach_injected() {
  for (auto& s : injected_) s->detach();
  drain_injected(true);
}

int Tracer::on_event(void* data, size_t len) {
  if (!handed_over_.empty() && handed_over_call(data, len)) return budget_ && --budget_ == 0 ? -EAGAIN : 0;
  if (system_wide_ && held_.empty() && len >= sizeof(mt_event)) {
    const auto* e = static_cast<const mt_event*>(data);
    if (e->h.kind == MT_EV_EXEC && !lifecycle_execs_.count({e->h.pid, e->addr}) &&
        (!drain_bound_ || e->h.ts > drain_bound_)) {
      held_.assign(static_cast<const char*>(data), static_cast<const char*>(data) + len);
      return -EAGAIN;  // the lifecycle ring first
    }
  }
  apply_event(data, len);
  // consume(): back to the lifecycle ring every so often (an exec or a new
  // library there is read from /proc while the process lives).
  if (budget_ && --budget_ == 0) return -EAGAIN;
  return 0;
}

bool Tracer::release_held() {
  if (held_.empty()) return false;
  if (drain_bound_ && reinterpret_cast<const mt_hdr*>(held_.data())->ts > drain_bound_) return false;
  std::vector<char> r = std::move(held_);
  held_.clear();
  apply_event(r.data(), r.size());
  return true;
}

void Tracer::apply_event(void* data, size_t len) {
  std::optional<Snapshot> snap;  // read only for new code
  const std::vector<MapEntry>* maps = nullptr;
  if (len >= sizeof(mt_event)) {
    const auto* e = static_cast<const mt_event*>(data);
    // dlopen of new code: capture the mappings while the process lives
    // (system-wide: done at once, on the lifecycle ring's MT_EV_LIBMAP).
    if (!system_wide_ && e->h.kind == MT_EV_MMAP && ((e->old_size >> 32) & 0x4) &&
        static_cast<int32_t>(e->aux) >= 0) {
      snap.emplace(e->h.pid, &maps_reads_);
      maps = snap->maps();  // the recording's too
      resolver_.capture(e->h.pid, maps);
      unwind_add(*snap);
    }
    // System-wide, a fork has no lifecycle record: its child's addresses
    // are its parent's until it execs (read then).
    if (system_wide_ && e->h.kind == MT_EV_FORK) resolver_.forked(e->h.pid, static_cast<pid_t>(e->addr), e->h.ts);
  }
  model_.apply(data, len);
  if (system_wide_ && len >= sizeof(mt_event) && static_cast<const mt_event*>(data)->h.kind == MT_EV_EXEC) {
    const auto* e = static_cast<const mt_event*>(data);
    lifecycle_execs_.erase({e->h.pid, e->addr});
    if (auto it = exec_comms_.find(e->h.pid); it != exec_comms_.end() && it->second.first == e->addr) {
      model_.process(e->h.pid).comm = std::move(it->second.second);
      exec_comms_.erase(it);
    }
  }
  if (feat_) feat_->on_event(data, len, maps);
}

int Tracer::on_proc_event(void* data, size_t len) {
  if (len >= sizeof(mt_hdr) && static_cast<const mt_hdr*>(data)->kind == MT_EV_MAPFILE) {
    // A library's record ends after its name (MT_MAP_EVENT_LIB_BYTES).
    if (len >= MT_MAP_EVENT_NAME_OFF) {
      mt_map_event e{};
      memcpy(&e, data, std::min(len, sizeof e));
      on_map_event(e);
    }
    return 0;
  }
  if (len < sizeof(mt_proc_event)) return 0;
  const auto& e = *static_cast<const mt_proc_event*>(data);
  pid_t pid = e.h.pid;
  bool stopped = e.h.flags & MT_F_STOPPED;
  if (stopped) stopped_.insert(pid);
  std::string comm(e.comm, strnlen(e.comm, sizeof e.comm));
  Snapshot snap(pid, &maps_reads_);  // its mappings, read once for all below

  switch (e.h.kind) {
    case MT_EV_EXEC:
      // System-wide: the new image's mappings first, while it lives (the
      // events ring's backlog can take long to drain: a short process was
      // gone after it).
      if (system_wide_) {
        exec_ids_[pid] = e.addr ? e.addr : e.h.ts;  // its MT_EV_MAPFILE comes next
        exec_comms_[pid] = {e.addr, comm};          // its fork in the drain below gets its name
        lifecycle_execs_.insert({pid, e.addr});     // its events-ring record may go on (on_event)
        read_process_once(pid, e.h.ts, e.addr ? e.addr : e.h.ts);
      }
      else resolver_.exec(pid, e.addr ? e.addr : e.h.ts, snap.maps());  // its own address space (the old one's stacks seal with theirs)
      // The old image's last events, then the events stream's own MT_EV_EXEC
      // (exact order); on_exec here only if that record was lost. Not past
      // a later exec (system-wide: it waits for its own lifecycle record).
      drain_bound_ = e.h.ts;
      drain_events();
      drain_bound_ = 0;
      model_.on_exec(pid, e.addr ? e.addr : e.h.ts);
      if (system_wide_) {
        model_.process(pid).comm = comm;
        exec_comms_.erase(pid);
        break;
      }
      log("exec pid " + std::to_string(pid) + " (" + comm + ")");
      model_.process(pid).comm = comm;
      // Closed in the background: until then they still fire in the new
      // image, where the BPF side ignores them (they carry the old image).
      procs_[pid].probes.reset();
      procs_[pid].objects.clear();
      procs_[pid].attached = false;
      unwind_add(snap);  // the new image (and ld.so) even before an allocator is mapped
      procs_[pid].injected = false;  // its agent went with its old image
      handed_over_.erase(pid);       // the old image's records are in (drained above)
      swallowed_.erase(pid);
      if (auto r = o_.inject ? inject_at_exec(pid, snap) : attach_process(pid, false, &snap); !r) {
        errors_.push_back(r.error().message);
        attach_failures_++;
      }
      break;
    case MT_EV_LIBMAP:
      // A stop taken and let go under ptrace (inject_at_exec): nothing to resume.
      if (auto it = swallowed_.find(pid); stopped && it != swallowed_.end()) {
        if (--it->second == 0) swallowed_.erase(it);
        forget_stopped(pid);
        stopped = false;
      }
      // System-wide (not stopped): read the new mapping now, while the
      // process lives; attach to a new allocator.
      if (system_wide_) {
        read_process_once(pid, e.h.ts, 0);
        break;
      }
      // Stopped: the new code's mapping and tables are in before it runs.
      resolver_.capture(pid, snap.maps());
      unwind_add(snap);
      if (!procs_[pid].attached) {
        if (auto r = attach_process(pid, false, &snap); !r) {
          errors_.push_back(r.error().message);
          attach_failures_++;
        }
      } else if (!procs_[pid].injected) {  // --inject: the agent's dlopen hook covers new code
        attach_more_allocators(snap);
      }
      break;
    case MT_EV_FORK:
      log("fork " + std::to_string(e.ppid) + " -> " + std::to_string(pid));
      resolver_.inherit(e.ppid, pid);  // first: before the backlog below, while it lives
      handed_over_.erase(pid);         // a pid used again: the process that had it is gone
      // Events of the parent from before the fork are already queued: apply
      // them so that the child inherits the right live blocks.
      drain_events();  // not rb_: we are inside its callback
      model_.on_fork(e.ppid, pid);
      model_.process(pid).comm = comm;
      if (e.h.flags & MT_F_VFORK) {
        procs_[pid].pid = pid;
        unwind_add(snap);
        resolver_.capture(pid, snap.maps());
        break;  // runs on the parent's probes until it exec's
      }
      if (auto r = attach_process(pid, false, &snap); !r) {
        errors_.push_back(r.error().message);
        attach_failures_++;
      }
      break;
    case MT_EV_EXIT: {
      log("exit pid " + std::to_string(pid) + " status " + std::to_string(e.exit_code));
      resolver_.exited(pid);  // code it mapped after its last read
      swallowed_.erase(pid);
      auto it = procs_.find(pid);
      if (it != procs_.end()) {
        it->second.probes.reset();
        it->second.exited = true;
      }
      if (unwind_) unwind_->remove_process(pid);
      last_read_ns_.erase(pid);
      exec_ids_.erase(pid);
      exec_comms_.erase(pid);
      lifecycle_execs_.erase(lifecycle_execs_.lower_bound({pid, 0}), lifecycle_execs_.lower_bound({pid + 1, 0}));
      if (e.exit_code >= 0 && (it != procs_.end() || system_wide_)) process_gone(pid, e.exit_code);
      forget_stopped(pid);
      break;
    }
  }
  if (feat_) feat_->on_proc_event(data, len, [&snap] { return snap.maps(); });  // before the resume: maps of a stopped process
  if (stopped) resume(pid);
  // The launched program runs traced from here (benchmarks time this part).
  if (launcher_ && pid == launcher_->pid() && procs_[pid].attached && !traced_since_)
    traced_since_ = std::chrono::steady_clock::now();
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
  for (const heap::Process* p : model_.images()) unknown += p->s.unknown_frees;
  // Frees of blocks never seen allocated: blocks from before the attach (-p),
  // or glibc's own (a thread's tcache is allocated inside malloc and
  // released through free at thread exit). Not a loss: a lost allocation
  // event is counted where it is lost (ringbuf, inflight_map_full, ...).
  d.stats["frees_of_unseen_blocks"] = unknown;
  d.stats["mappings_not_captured"] = resolver_.never_captured();  // processes, not events
  d.stats["mappings_incomplete"] = resolver_.incomplete();        // gone before a library's mapping was read
  // Of those: mappings rebuilt from the kernel's records, and records whose file was not found.
  d.stats["mappings_from_kernel"] = resolver_.kernel_given();
  d.stats["mappings_from_kernel_unresolved"] = resolver_.kernel_unresolved();
  d.stats["mappings_read_after_next_exec"] = resolver_.misread();  // dropped: the kernel's records instead
  d.dropped["stack_record_missing"] = model_.missing_stacks();
  d.dropped["malformed"] = model_.malformed_records();
  d.dropped["attach_failed"] = attach_failures_;
  if (inject_leftovers_restored_ || inject_leftovers_unrestored_) {  // processes, not events
    d.stats["inject_leftovers_restored"] = inject_leftovers_restored_;
    d.dropped["inject_leftovers_unrestored"] = inject_leftovers_unrestored_;
  }
  if (!injected_.empty()) {  // --inject: records the agent could not write (its ring full)
    uint64_t drops = 0, malformed = 0;
    for (const auto& s : injected_) {
      drops += const_cast<inject::Session&>(*s).ring().hdr().drops;
      malformed += const_cast<inject::Session&>(*s).ring().malformed();
    }
    uint64_t waits = 0;
    for (const auto& s : injected_) waits += const_cast<inject::Session&>(*s).ring().hdr().full_waits;
    d.dropped["inject_ring_full"] = drops;
    d.dropped["inject_malformed"] = malformed;
    d.stats["inject_full_waits"] = waits;  // 50 us naps of the target's threads: the drain was behind
    uint64_t peak = 0;
    for (const auto& s : injected_) peak = std::max<uint64_t>(peak, s->backlog_peak());
    d.stats["inject_backlog_peak_kb"] = peak >> 10;  // records copied out of the ring, not yet in the model
  }
  d.stats["events"] = model_.event_count();
  {  // what the heap model holds (the tool's memory on a long system-wide run)
    uint64_t images = 0, live = 0, stack_entries = 0, maps = 0;
    for (const heap::Process* p : model_.images()) {
      images++;
      live += p->live.size();
      stack_entries += p->stack_allocs.size();
      maps += p->maps.size();
    }
    d.stats["model_images"] = images;
    d.stats["model_live_blocks"] = live;
    d.stats["model_stack_entries"] = stack_entries;
    d.stats["model_mappings"] = maps;
    d.stats["model_stacks"] = model_.stack_count();
    d.stats["model_sealed_stacks"] = model_.sealed_stack_count();
    d.stats["model_merged_images"] = model_.merged_images();
    d.stats["model_stacks_collected"] = stacks_collected_;
    d.stats["resolver_processes"] = resolver_.spaces();
    const auto& ss = model_.seal_stats();  // sealing holds the drain: how long
    d.stats["model_sealed_images"] = ss.images;
    d.stats["model_seal_ms"] = ss.total_ns / 1000000;
    d.stats["model_seal_max_ms"] = ss.max_ns / 1000000;
    d.stats["model_seal_max_step_ms"] = ss.max_step_ns / 1000000;
  }
  if (o_.faults) d.stats["faults_before_exec"] = model_.faults_before_exec();
  if (traced_seconds_ >= 0) d.stats["launched_traced_us"] = static_cast<uint64_t>(traced_seconds_ * 1e6);
  if (skel_ && unwind_) {
    static const char* names[MT_UC_COUNT] = {
        "unwind_stacks",        "unwind_frames_cfi",     "unwind_frames_fp",
        "unwind_end_outermost", "unwind_end_zero",       "unwind_trunc_depth",
        "unwind_trunc_no_table", "unwind_trunc_unsupported", "unwind_trunc_read",
        "unwind_trunc_bad_frame", "unwind_memo_hits",      "unwind_rows_from_vma"};
    for (int c = 0; c < MT_UC_COUNT; c++) {
      uint32_t key = c;
      uint64_t sum = 0;
      if (bpf_map_lookup_elem(bpf_map__fd(skel_->maps.unwind_counters), &key, vals.data()) == 0)
        for (auto v : vals) sum += v;
      d.stats[names[c]] = sum;
    }
    // A build with -DMT_UNWIND_CACHE_STATS (bench A/B) has more counters
    // after these; shown by index (their meaning: bpf/unwind.bpf.h).
    for (uint32_t c = MT_UC_COUNT + 1; c < bpf_map__max_entries(skel_->maps.unwind_counters); c++) {
      uint64_t sum = 0;
      if (bpf_map_lookup_elem(bpf_map__fd(skel_->maps.unwind_counters), &c, vals.data()) == 0)
        for (auto v : vals) sum += v;
      d.stats["unwind_debug_" + std::to_string(c - MT_UC_COUNT)] = sum;
    }
    auto us = unwind_->stats();
    d.stats["unwind_table_bytes"] = us.map_bytes;
    d.stats["unwind_files"] = us.files;
    d.stats["unwind_rows"] = us.rows;
    d.stats["unwind_table_peak_bytes"] = us.peak_bytes;
    d.stats["unwind_shards"] = us.shards;
    d.stats["unwind_files_kept"] = us.files_kept;
    d.stats["unwind_table_build_ms"] = static_cast<uint64_t>(us.build_ms + 0.5);
    d.stats["unwind_table_load_ms"] = static_cast<uint64_t>(us.load_ms + 0.5);
    d.dropped["unwind_table_over_cap"] = us.over_cap;
    d.dropped["unwind_table_failed"] = us.failed;
    d.stats["unwind_process_gone"] = unwind_gone_;
  }
  // The tool's own memory: RSS counts the rings' pages (kernel memory,
  // mapped twice each by libbpf), so their size is shown on its own.
  {
    std::ifstream st("/proc/self/status");
    for (std::string line; std::getline(st, line);) {
      if (line.rfind("VmRSS:", 0) == 0) d.stats["tool_rss_kb"] = std::stoull(line.substr(6));
      if (line.rfind("RssAnon:", 0) == 0) d.stats["tool_anon_kb"] = std::stoull(line.substr(8));
      if (line.rfind("VmHWM:", 0) == 0) d.stats["tool_peak_rss_kb"] = std::stoull(line.substr(6));
    }
    if (skel_)
      d.stats["tool_rings_kb"] =
          (uint64_t(bpf_map__max_entries(skel_->maps.events)) + bpf_map__max_entries(skel_->maps.proc_events)) / 1024;
    // The most the events ring held when the loader came to drain it (what
    // --ringbuf-mb must hold; a full ring counts as "ringbuf" drops).
    d.stats["ringbuf_peak_kb"] = ring_peak_ / 1024;
  }
  // Per-process probe attach (uprobe_multi links, or one perf event per probe).
  d.stats["attach_processes"] = attach_count_;
  d.stats["maps_reads"] = maps_reads_;  // /proc/PID/maps reads by the tracer: one per event that needs them
  d.stats["attach_us"] = attach_us_;
  if (pprof_dir_) pprof_dir_->add_stats(d.stats);
  return d;
}

// Every uprobe first (the targets run at full speed from here; those that
// still fire before the tool exits), then the tracepoints; resume anything
// we stopped; then the perf events of exited processes go to the reaper,
// which holds no tracepoint.
void Tracer::detach_probes() {
  if (skel_ && skel_->bss) skel_->bss->tracing_stopped = true;
  for (auto& [pid, p] : procs_) {
    if (p.exited) p.probes.reset();
    else p.probes.reset_before_exit();
  }
  for (auto& [key, set] : system_probes_) set.reset_before_exit();
  system_probes_.clear();
  detach_wait();
  if (skel_) memtrace_bpf__detach(skel_);
  for (pid_t pid : std::set<pid_t>(stopped_)) resume(pid);
  detach_in_background();
}

// Lifecycle records first (they may drain the events ring themselves), then
// the events ring in slices of kEventSlice records (~0.1 ms), the lifecycle
// ring between slices: a 64 MiB backlog is ~800,000 records (a few hundred ms).
int Tracer::consume() {
  constexpr uint32_t kEventSlice = 512;
  int total = 0;
  // The backlog at its largest: before each slice (a drain that falls
  // behind stays in here, slice after slice).
  auto sample_backlog = [this] {
    if (ring_pos_[0] && ring_pos_[1]) {
      uint64_t queued = __atomic_load_n(ring_pos_[1], __ATOMIC_ACQUIRE) - __atomic_load_n(ring_pos_[0], __ATOMIC_ACQUIRE);
      ring_peak_ = std::max(ring_peak_, queued);
    }
  };
  // At most ~100 ms per call: the caller checks --duration, Ctrl-C and its
  // program between calls. A ring that never empties (two system-wide
  // tracers tracing each other's allocations) kept the tool here for good,
  // deaf to SIGINT.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  for (;;) {
    sample_backlog();
    int a = ring_buffer__consume(rb_);
    if (a < 0) return a;
    a += release_held();  // its lifecycle record is in now (or lost)
    budget_ = kEventSlice;
    int b = ring_buffer__consume(rb_events_);
    bool more = b == -EAGAIN;
    budget_ = 0;
    if (b < 0 && !more) return b;
    total += a + (more ? kEventSlice : b);
    if (!more || std::chrono::steady_clock::now() >= deadline) return total + static_cast<int>(drain_injected());
  }
}

// Every record the events ring holds now (from a lifecycle callback: what
// came before an exec or a fork), and no more: records written after this
// call began come after the lifecycle event anyway, and a ring that never
// empties kept this loop here for good.
void Tracer::drain_events() {
  if (!release_held() && !held_.empty()) return;  // a later exec waits for its lifecycle record
  uint32_t saved = budget_;
  const uint64_t until = ring_pos_[1] ? __atomic_load_n(ring_pos_[1], __ATOMIC_ACQUIRE) : 0;
  for (;;) {
    budget_ = 512;
    int n = ring_buffer__consume(rb_events_);
    if (!held_.empty()) break;
    if (n != -EAGAIN || !ring_pos_[0] || __atomic_load_n(ring_pos_[0], __ATOMIC_ACQUIRE) >= until) break;
  }
  budget_ = saved;
}

int Tracer::poll(int timeout_ms) {
  epoll_event evs[2];
  int n = epoll_wait(epoll_.get(), evs, 2, timeout_ms);
  if (n < 0) return -errno;
  return consume();
}

void Tracer::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
  detach_probes();  // then the maps go
  if (rb_) {
    ring_buffer__free(rb_);
    rb_ = nullptr;
  }
  if (rb_events_) {
    ring_buffer__free(rb_events_);
    rb_events_ = nullptr;
  }
  for (auto*& p : ring_pos_)
    if (p) {
      munmap(const_cast<uint64_t*>(p), sysconf(_SC_PAGESIZE));
      p = nullptr;
    }
  unwind_.reset();  // unmaps the rows array before the map goes
  if (skel_) {
    memtrace_bpf__destroy(skel_);
    skel_ = nullptr;
  }
}

// --check: what this kernel offers, then the real thing: load and verify
// every BPF program, attach the tracepoints, attach the allocator probes to
// this process and detach them.
int Tracer::check(std::ostream& os) {
  libbpf_set_print(libbpf_print);
  KernelFeatures k = probe_kernel();
  for (const auto& l : describe(k)) os << l << "\n";
  if (!k.can_run()) {
    os << "memtrace-bpf cannot run on this kernel\n";
    return 1;
  }
  o_.faults = k.page_fault_tp;
  if (auto r = load(); !r) {
    os << "missing  BPF programs: " << r.error().message << "\n";
    return 1;
  }
  size_t nprog = 0;
  bpf_program* prog;
  bpf_object__for_each_program(prog, skel_->obj) nprog += bpf_program__fd(prog) >= 0;
  os << "ok       BPF programs: " << nprog << " loaded and verified, tracepoints attached\n";
  int rc = 0;
  auto maps = read_maps(getpid());
  MapEntry where;
  auto obj = maps ? attacher_->find_allocator(getpid(), *maps, &where) : Result<const AllocatorObject*>(maps.error());
  if (!obj) {
    os << "missing  allocator probes: " << obj.error().message << "\n";
    rc = 1;
  } else if (!*obj) {
    // A memtrace-bpf stripped of its .symtab: no malloc to try the probes on.
    os << "skipped  allocator probes: this memtrace-bpf has no symbol table to find its own malloc in\n";
  } else if (auto set = attacher_->attach(**obj, getpid(), openable_path(getpid(), where)); !set) {
    os << "missing  allocator probes: " << set.error().message << "\n";
    rc = 1;
  } else {
    os << "ok       allocator probes: " << set->size() << " "
       << (attach_mode_ == AttachMode::UprobeMulti ? "uprobe_multi links" : "perf-event uprobes")
       << " on " << where.path << " (" << (*obj)->family << ") attached and detached\n";
  }
  teardown();
  for (const auto& n : kernel_notes_) os << "note     " << n << "\n";
  os << (rc ? "memtrace-bpf cannot run on this kernel\n" : "memtrace-bpf can run on this kernel\n");
  return rc;
}

std::vector<std::string> Tracer::notes() const {
  std::vector<std::string> n = kernel_notes_;
  if (attacher_) n.insert(n.end(), attacher_->notes().begin(), attacher_->notes().end());
  return n;
}

// Which mechanism each feature ran on (the kernel decides: kernel_features.h).
nlohmann::json Tracer::kernel_json() const {
  return {{"release", kf_.release},
          {"bpf", full_bpf_ ? "full" : "compat"},
          {"uprobes", attach_mode_ == AttachMode::UprobeMulti ? "uprobe_multi" : "perf_event"},
          {"stacks", !o_.stacks ? "none" : o_.cfi ? "cfi" : "frame_pointers"},
          {"inflight", full_bpf_ ? "task_storage" : "hash"},
          {"syscalls", syscall_fexit_ ? "fexit" : "tracepoint"},
          {"exit", kf_.exit_group_dead ? "group_dead" : "signal_live"},
          {"fault_vma_check", o_.faults && full_bpf_}};
}

void Tracer::log_pprof_round(const PprofDir::RoundStats& rs) {
  char b[256];
  snprintf(b, sizeof b,
           "pprof-dir: %llu files, %llu bytes in %.1f ms (profiles %.1f ms, gzip %.1f ms, write %.1f ms, "
           "draining in between %.1f ms)",
           (unsigned long long)rs.files, (unsigned long long)rs.bytes, rs.us / 1e3, rs.profile_us / 1e3,
           rs.gzip_us / 1e3, rs.write_us / 1e3, rs.between_us / 1e3);
  log(b);
}

void Tracer::report_final(int exit_code) {
  release_held();
  retire_exited(true);  // exits still queued: their last records came with the final drain
  model_.finish_seals();
  // Mark the launched program's status (from waitpid: exact).
  if (launcher_ && child_status_) model_.on_exit(launcher_->pid(), *child_status_);
  // System-wide: processes forked (not exec'd) since the start were never
  // named; those still alive are named now.
  for (const auto& [pid, p] : model_.processes())
    if (p->comm.empty())
      if (auto c = read_comm(pid)) p->comm = *c;
  report::Options ro;
  ro.top = o_.top;
  ro.at_exit = true;
  ro.include_idle = !system_wide_;
  resolver_.allow_debuginfod();  // a process the user named is reported even if quiet
  if (pprof_dir_) {  // every image's last file, from the final model (its in-use totals are the report's)
    auto rs = pprof_dir_->round(model_, resolver_.fn(), ro, true);
    if (o_.verbose) log_pprof_round(rs);
    errors_.insert(errors_.end(), pprof_dir_->errors().begin(), pprof_dir_->errors().end());
  }
  auto d = drops();
  if (feat_) feat_->finish(d, errors_);
  // Text and JSON: the primary output, then any further text/JSON file;
  // folded and pprof (report/outputs.h) from the same model.
  std::optional<nlohmann::json> j;
  auto write_report = [&](std::ostream& os, bool json) {
    if (json) {
      if (!j) {
        j = report::to_json(model_, resolver_.fn(), ro, d);
        if (feat_) feat_->add_json(*j);
        (*j)["errors"] = errors_;
        (*j)["notes"] = notes();
        (*j)["kernel"] = kernel_json();
        if (o_.rearm_ms > 0) (*j)["rearm"] = rearm_report_;
      }
      os << report::json_text(*j, 2) << "\n";
    } else {
      report::write_text(os, model_, resolver_.fn(), ro, d);
      if (feat_) feat_->write_text(os);
      for (const auto& e : errors_) os << "error: " << e << "\n";
      for (const auto& n : notes()) os << "note: " << n << "\n";
      if (o_.rearm_ms > 0 && rearm_report_.contains("rearm"))
        os << "REARM: every " << o_.rearm_ms << " ms, " << rearm_report_["rearm"]["intervals"] << " intervals, "
           << rearm_report_["rearm"]["first_accesses"] << " first accesses restored by memtrace-singlestep\n";
    }
    os.flush();
  };
  if (text_report_) write_report(out(), o_.format == "json");
  report::ProfileOptions po;
  po.folded = o_.folded_value;
  po.build_id = [](const std::string& path) { return build_id_of(path); };
  po.duration_nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started_).count();
  for (auto& [spec, file] : more_outs_) {
    std::ostream& os = file ? *file : out();
    if (spec.format == report::Format::Text || spec.format == report::Format::Json) {
      write_report(os, spec.format == report::Format::Json);
    } else if (auto w = report::write_profile(os, spec.format, model_, resolver_.fn(), ro, po); !w) {
      std::cerr << "memtrace-bpf: cannot write " << spec.path << ": " << w.error().message << "\n";
    }
  }
}

int Tracer::run() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  struct sigaction sc {};
  sc.sa_handler = on_child;
  sigemptyset(&sc.sa_mask);
  sigaction(SIGCHLD, &sc, nullptr);

  // Every -o file is created before anything is traced: one that cannot be
  // written costs the run, not its report.
  const report::OutputSpec* primary = report::primary_output(o_.outputs);
  text_report_ = o_.outputs.empty() || primary;
  for (const auto& spec : o_.outputs) {
    bool text = spec.format == report::Format::Text || spec.format == report::Format::Json;
    if (spec.path.empty()) {  // the default stream: out()
      if (!text) more_outs_.emplace_back(spec, nullptr);
      continue;
    }
    // --dump-bytes puts the program's memory in the text and JSON reports.
    auto f = open_output(spec.path, text && o_.features.dump_bytes ? Privacy::Private : Privacy::Shared,
                         text ? std::ios::out : std::ios::out | std::ios::binary);
    if (!f) {
      std::cerr << "memtrace-bpf: " << f.error().message << "\n";
      return 2;
    }
    if (&spec == primary) file_out_ = std::move(*f);
    else more_outs_.emplace_back(spec, std::move(*f));
  }
  if (!o_.metrics.empty()) {  // bound before anything is traced, like the files
    metrics::ExporterOptions mo;
    mo.exposition.max_processes = o_.metrics_max_processes;
    auto m = metrics::Exporter::listen(o_.metrics, mo);
    if (!m) {
      std::cerr << "memtrace-bpf: " << m.error().message << "\n";
      return 2;
    }
    metrics_ = std::move(*m);
  }
  if (!o_.pprof_dir.dir.empty()) {  // created and tried before anything is traced, like the files
    auto d = PprofDir::open(o_.pprof_dir);
    if (!d) {
      std::cerr << "memtrace-bpf: " << d.error().message << "\n";
      return 2;
    }
    pprof_dir_ = std::move(*d);
  }
  if (geteuid() != 0) {
    std::cerr << "memtrace-bpf: must run as root (BPF programs and uprobes need CAP_SYS_ADMIN/CAP_BPF)\n";
    return 2;
  }
  // Forked while this process is small and has one thread (guardian.h).
  if (auto g = Guardian::start(); !g) {
    std::cerr << "memtrace-bpf: " << g.error().message << "\n";
    return 2;
  } else {
    guardian_.emplace(std::move(*g));
  }
  if (auto r = load(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    return 2;
  }
  if (o_.features.any()) {  // --console --trace --live --dump-bytes --record (features.h)
    FeatureContext fc;
    fc.model = &model_;
    fc.resolve = resolver_.fn();
    fc.out = [this]() -> std::ostream& { return out(); };
    fc.drops = [this] { return drops(); };
    fc.drain = [this] {  // before a console command reads the model
      consume();
      model_.finish_seals();
    };
    fc.json = o_.format == "json";
    fc.top = o_.top;
    fc.system_wide = system_wide_;
    fc.include_idle = !system_wide_;
    fc.command = o_.command;
    fc.max_images = o_.max_images;
    std::string err;
    feat_ = Features::create(o_.features, std::move(fc), &err);
    if (!feat_) {
      std::cerr << "memtrace-bpf: " << err << "\n";
      return 2;
    }
  }
  // Images that end are sealed, and merged past --max-images (heap_model.h):
  // the model's memory follows live blocks and call paths, not processes.
  model_.set_locator(resolver_.locator(), o_.features.live || o_.features.dump_bytes);
  model_.set_image_cap(o_.max_images);
  if (auto r = setup_targets(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    // Whatever was captured so far is still reported.
    consume();
    int code = child_status_ ? Launcher::exit_code_of(*child_status_) : 2;
    if (code == 0) code = 2;
    teardown();
    report_final(code);
    return code;
  }

  if (auto r = start_rearm(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    teardown();
    return 2;
  }
  if (fault_trace_) fault_trace_->header();
  // System-wide on a busy host the drain competes with every process for
  // the CPU: it runs ahead of them (a process it lets wait is the one whose
  // events fill the ring; an exec or a new library is read from /proc while
  // the process lives). This thread only: processes started later (the
  // reaper) do not inherit it; launch mode's program is not ours to boost.
  if (system_wide_ && o_.drain_nice != 0) setpriority(PRIO_PROCESS, 0, o_.drain_nice);
  if (metrics_) {  // a scrape wakes the drain loop; the server's thread starts after the launcher's fork
    epoll_event ev{};
    ev.events = EPOLLIN;
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, metrics_->wake_fd(), &ev);
    metrics_->start();
    std::cerr << "memtrace-bpf: metrics at " << metrics_->url() << "\n";
  }
  if (o_.command.empty()) {
    std::string what = system_wide_ ? "system-wide" : "";
    if (!o_.pids.empty()) what += std::to_string(o_.pids.size()) + " process(es)";
    if (!o_.comms.empty()) what += (what.empty() ? "" : " and ") + std::string("command names");
    std::cerr << "memtrace-bpf: tracing " << what << "; Ctrl-C to stop\n";
  }
  auto start = std::chrono::steady_clock::now();
  auto next_tick = start + std::chrono::duration<double>(o_.interval);
  auto pprof_every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(o_.pprof_dir.every));
  auto next_profiles = start + pprof_every;
  int exit_code = 0;
  while (!g_stop) {
    bool behind = false;  // --inject: copied records wait for the model: no sleep
    for (const auto& s : injected_) behind = behind || s->backlog();
    int n = poll(injected_.empty() ? 50 : behind ? 0 : 2);  // --inject: the agent's ring has no wakeup; a writer waits when it is full
    if (metrics_)  // a scrape waits: the counters as drained so far (metrics/exporter.h)
      metrics_->serve([this] { return metrics::snapshot_of(model_, drops(), {o_.faults, !system_wide_}); });
    // --faults: drain at least every 50 ms, so that faults on mappings made
    // before tracing are attributed from /proc/PID/maps while they exist.
    if (o_.faults && (release_held() || held_.empty())) ring_buffer__consume(rb_events_);
    if (n < 0 && n != -EINTR) {
      errors_.push_back(std::string("ring buffer poll: ") + strerror(-n));
      break;
    }
    retire_exited();
    // Images that ended are sealed in steps between drains: 10 ms a turn,
    // more when they queue up (a build's compilers end one after another).
    if (model_.sealing()) model_.seal_some(std::chrono::milliseconds(10 * std::min<size_t>(model_.sealing(), 8)));
    if (model_.stack_count() >= stacks_gc_at_) collect_stacks();
    auto now = std::chrono::steady_clock::now();
    if (launcher_) {
      int st;
      if (launcher_->poll_exit(&st)) {
        child_status_ = st;
        if (traced_since_) traced_seconds_ = std::chrono::duration<double>(now - *traced_since_).count();
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
    if (feat_ && feat_->tick()) break;  // console 'quit' (or end of its input)
    if (o_.interval > 0 && now >= next_tick) {
      next_tick += std::chrono::duration<double>(o_.interval);
      consume();
      for (const auto& [pid, p] : model_.processes())
        if (p->s.allocs || p->s.in_use_blocks) report::write_summary_text(out(), *p, false);
      out().flush();
    }
    if (pprof_dir_ && now >= next_profiles) {  // --pprof-dir: as --interval, between two drains
      consume();
      report::Options ro;
      ro.include_idle = !system_wide_;
      model_.finish_seals();
      auto rs = pprof_dir_->round(model_, resolver_.fn(), ro, false, [this] { consume(); });
      if (o_.verbose) log_pprof_round(rs);
      // A round longer than S skips the ticks it overran (no burst of rounds).
      auto after = std::chrono::steady_clock::now();
      do next_profiles += pprof_every;
      while (next_profiles <= after);
    }
  }
  if (g_stop && launcher_) {
    int st;
    exit_code = launcher_->poll_exit(&st) ? Launcher::exit_code_of(st) : 130;
    if (launcher_->poll_exit(&st)) child_status_ = st;
  }
  if (metrics_) metrics_->stop();
  stop_rearm();  // protections restored before the probes go
  // Detach uprobes and tracepoints, then drain what is left (--inject: the
  // hooks call straight through from here on).
  detach_injected();
  detach_probes();
  while (consume() > 0) {
  }
  report_final(exit_code);
  teardown();
  return exit_code;
}

}  // namespace memtrace::loader
