#include "loader/tracer.h"

#include "loader/shared_uprobes.h"

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
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/phase_log.h"
#include "loader/bpf_object.h"
#include "loader/output_file.h"
#include "loader/recording.h"
#include "memtrace_bpf.skel.h"
#include "memtrace_bpf_compat.skel.h"
#include "inject/injector.h"
#include "inject/session.h"
#include "metrics/exporter.h"

namespace memtrace::loader {

namespace {

// The sampler's distances (bpf/alloc.bpf.h): MT_SAMPLE_GAPS quantiles of an
// exponential distribution of mean n, at the middles of equal-probability
// slices, scaled so that their mean is n exactly (the weights the model
// gives sampled blocks assume that mean).
Result<void> fill_sample_gaps(int fd, uint64_t n) {
  std::vector<double> g(MT_SAMPLE_GAPS);
  double sum = 0;
  for (size_t i = 0; i < g.size(); i++) sum += g[i] = -std::log((double(i) + 0.5) / double(g.size()));
  for (uint32_t i = 0; i < g.size(); i++) {
    double v = g[i] * double(n) * double(g.size()) / sum;
    uint32_t gap = static_cast<uint32_t>(std::clamp(v, 1.0, 4294967295.0));
    if (bpf_map_update_elem(fd, &i, &gap, BPF_ANY)) return Error::sys("sample_gaps map update");
  }
  return {};
}

}  // namespace
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

}  // namespace

Tracer::Tracer(Options o)
    : o_(std::move(o)), resolver_([&] {
        symbolize::Options so;
        so.symbol_dirs = o_.symbol_dirs;
        so.dwarf = o_.dwarf;
        so.defer_debuginfod = true;  // the drain thread must not wait on a download: final report only
        return so;
      }()) {
  system_wide_ = o_.pids.empty() && o_.comms.empty() && o_.command.empty() && !o_.cgroup;
  resolver_.set_python(&py_frames_);
  py_frames_.on_new = [this](uint32_t id, const python::PyFrame& f) {
    if (feat_) feat_->python_frame(id, f.function, f.file, f.line);
  };
  if (const char* c = getenv("MEMTRACE_TEST_UNREADABLE_COMM")) o_.test_unreadable_comm = c;
  // Mappings rebuilt from the kernel's records go into a recording too.
  resolver_.on_given([this](pid_t pid, const std::vector<procfs::Mapping>& maps) {
    if (feat_) feat_->snapshot_maps(pid, &maps);
  });
  if (const char* n = getenv("MEMTRACE_DRAIN_NICE")) o_.drain_nice = atoi(n);  // benchmarks: A/B
  // Tests: the raw stacks' collection without its 30 s wait.
  if (const char* g = getenv("MEMTRACE_STACKS_GC_MS")) {
    stacks_gc_every_ = std::chrono::milliseconds(atoi(g));
    stacks_gc_growth_ = 1;
  }
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
  install_libbpf_print();
  struct rlimit rl = {RLIM_INFINITY, RLIM_INFINITY};
  setrlimit(RLIMIT_MEMLOCK, &rl);
  // One perf event fd per probe per process.
  struct rlimit nf;
  if (getrlimit(RLIMIT_NOFILE, &nf) == 0 && nf.rlim_cur < nf.rlim_max) {
    nf.rlim_cur = nf.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nf);
  }
  kf_ = probe_kernel();
  phase("load: kernel probed");
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
#if defined(__x86_64__)
    // The CFI walk's frame loop is a chain of tail calls there (bpf/unwind_chain.bpf.h).
    if (o_.stacks && o_.cfi) {
      cfi_chain_ = true;
      kernel_notes_.push_back("stacks: CFI through a chain of tail calls (kernel " + kf_.release + " has no bpf_loop)");
    }
#else
    if (o_.stacks && o_.cfi) {
      o_.cfi = false;
      kernel_notes_.push_back("stacks: frame pointers only (the CFI unwinder needs bpf_loop, kernel 5.17)");
    }
#endif
    if (o_.faults)
      kernel_notes_.push_back("page faults: not checked against their VMA (bpf_find_vma needs kernel 5.17): "
                              "faults that end in SIGSEGV are not flagged");
    attach_mode_ = AttachMode::PerfEventPerRole;
  } else {
    attach_mode_ = kf_.uprobe_multi ? AttachMode::UprobeMulti : AttachMode::PerfEvent;
    // Benchmarks compare the two attach mechanisms on one kernel.
    // perf: as before 6.6; perf-pmu: each process's own perf events (the
    // uprobe PMU's), as before the shared events (shared_uprobes.h).
    if (const char* a = getenv("MEMTRACE_UPROBE_ATTACH"); a && (std::string(a) == "perf" || std::string(a) == "perf-pmu"))
      attach_mode_ = AttachMode::PerfEvent;
  }
  shared_uprobes_ = attach_mode_ != AttachMode::UprobeMulti && shared_uprobes::available();
  if (attach_mode_ == AttachMode::PerfEvent)
    kernel_notes_.push_back(std::string("uprobes: ") +
                            (shared_uprobes_ ? "perf-event uprobes shared by every traced process (one per probe, "
                                               "each process in its filter)"
                                             : "one perf-event uprobe per probe and process") +
                            ": kernel " + kf_.release + " has no uprobe_multi links (6.6)");

  skel_ = open_skeleton(full_bpf_);
  if (!skel_) return Error::sys("open BPF object");
  phase("load: BPF object opened");
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
  if (o_.cgroup) {
    ro->cgroup_id = o_.cgroup->id;
    ro->cgroup_level = o_.cgroup->level;
  }
  // Sized to the work: a launched program or -p processes peak at a few
  // MiB of backlog (W1, 1 M events/s: 2.5 MiB), system-wide and -c take
  // whatever starts (a build: 10-28 MiB, bench/busy_host). The ring's pages
  // count in the tool's RSS.
  size_t want = o_.ringbuf_mb ? o_.ringbuf_mb : system_wide_ || !o_.comms.empty() ? 64 : 16;
  size_t rb = 1;
  while (rb < want) rb <<= 1;
  bpf_map__set_max_entries(skel_->maps.events, rb << 20);
  ro->wakeup_bytes = (rb << 20) / 8;

  // --sample-bytes on the BPF path (bpf/alloc.bpf.h's sampler): a bucket
  // table for the sampled blocks' frees, 4 MiB, only when sampling.
  if (o_.sample_bytes && !o_.inject) {
    ro->sample_bytes = o_.sample_bytes;
    bpf_map__set_max_entries(skel_->maps.sample_buckets, 1u << 20);
    ro->sample_bucket_mask = (1u << 20) - 1;
  }
  bool cfi = o_.stacks && o_.cfi;
  skel_->rodata->unwind_disabled = !cfi;
#if defined(__x86_64__)
  // (--inject too: a process the agent cannot be loaded in is traced by
  // uprobes, its Python frames walked here; the agent walks its own.)
  skel_->rodata->python_frames = o_.stacks && o_.python_frames != python::Mode::Off;
#endif
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
  // The compat object's CFI chain (fill_cfi_chain): its walkers only when it runs.
  for (const char* n : {"mt_unwind_chain", "mt_unwind_chain_mmap"})
    if (bpf_program* p = bpf_object__find_program_by_name(skel_->obj, n)) bpf_program__set_autoload(p, cfi_chain_);
  prepare_programs(skel_->progs.mt_alloc_enter, skel_->progs.mt_alloc_exit, attach_mode_);
  // The two programs with the unwinder verified at the same time
  // (bpf_object.h; MEMTRACE_SERIAL_LOAD=1: one after the other, for A/B).
  // Attached per process (Attacher), not by the skeleton; copied to the
  // object that loads them before it starts.
  bpf_program__set_autoattach(skel_->progs.mt_alloc_enter, false);
  bpf_program__set_autoattach(skel_->progs.mt_alloc_exit, false);
  objs_.main = skel_;
  bool parallel = !getenv("MEMTRACE_SERIAL_LOAD");
  // --inject: the agent takes the allocator, uprobes are for what it cannot
  // (and a launched program up to its entry point): their verification goes
  // on while the tool attaches, and only an attach of uprobes waits for it.
  bool defer = parallel && o_.inject && !getenv("MEMTRACE_NO_DEFER");
  if (auto r = load_objects(objs_, full_bpf_, parallel, defer); !r) return r;
  if (!defer)
    if (auto r = fill_cfi_chain(); !r) return r;
  phase("load: BPF maps created, programs verified");
  if (o_.sample_bytes && !o_.inject)
    if (auto r = fill_sample_gaps(bpf_map__fd(skel_->maps.sample_gaps), o_.sample_bytes); !r) return r;
  // Before any program is attached: from here on, a process can be stopped.
  if (guardian_)
    if (auto r = guardian_->arm(bpf_map__fd(skel_->maps.stopped), bpf_map__fd(skel_->maps.loader_gone),
                                bpf_map__fd(skel_->maps.targets));
        !r)
      return r;
  // --check attaches the system-wide programs for a moment: a static
  // program's exec then (memtrace-singlestep's, beside a run of the tool)
  // must not be stopped for a loader that only looks.
  if (check_only_) {
    uint32_t zero = 0, gone = 1;
    if (bpf_map_update_elem(bpf_map__fd(skel_->maps.loader_gone), &zero, &gone, BPF_ANY))
      return Error::sys("set loader_gone");
    if (skel_->bss) skel_->bss->tracing_stopped = true;
  }
  // Every link the tool is done with is closed by the guardian (guardian.h):
  // no detach on the tool's clock.
  // (MEMTRACE_SYNC_TEARDOWN=1: closed here, as before issue 33; benchmarks A/B.)
  hand_over_links_ = guardian_ && !getenv("MEMTRACE_SYNC_TEARDOWN");
  if (hand_over_links_)
    set_link_sink([this](const std::vector<int>& fds) { return bool(guardian_->hand_over(fds)); });
  // System-wide: our own binary (static in the kernel tests' guests) is
  // never stopped at an exec (the guardian's), nor probed (scan_system_allocators).
  if (struct stat st {}; system_wide_ && stat("/proc/self/exe", &st) == 0) {
    self_exe_ = {static_cast<uint64_t>(st.st_dev), st.st_ino};
    set_static_known(self_exe_.first, self_exe_.second);
  }
  memtrace_bpf* up = objs_.uprobe_object();
  if (int err = memtrace_bpf__attach(skel_); err)
    return Error::sys("attach BPF tracepoints", -err);
  if (objs_.mmap)
    if (int err = memtrace_bpf__attach(objs_.mmap); err) return Error::sys("attach BPF tracepoints", -err);
  phase("load: tracepoints attached");

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
  std::vector<bpf_program*> enter = {up->progs.mt_alloc_enter};
  if (attach_mode_ == AttachMode::PerfEventPerRole)
    for (uint32_t r = 1; r < MT_ROLE_COUNT; r++) {
      std::string name = "mt_alloc_enter_" + std::to_string(r);
      bpf_program* p = bpf_object__find_program_by_name(up->obj, name.c_str());
      if (!p) return Error::msg("BPF object without " + name);
      enter.push_back(p);
    }
  attacher_ = std::make_unique<Attacher>(std::move(enter), up->progs.mt_alloc_exit, attach_mode_, o_.allocator);
  if (defer)
    attacher_->set_ready([this]() -> Result<void> {
      if (auto r = wait_uprobes(objs_); !r) return r;
      return fill_cfi_chain();
    });
  if (cfi) {
    auto u = unwind::UnwindMaps::create(skel_->maps.unwind_shards, skel_->maps.unwind_procs,
                                        skel_->maps.unwind_epoch, o_.unwind_mb << 20);
    if (!u) return u.error();
    unwind_ = std::move(*u);
    unwind_->set_files_map(bpf_map__fd(skel_->maps.unwind_files));
  }
  return {};
}

// The compat object's CFI chain (bpf/unwind_chain.bpf.h): its program array
// holds each allocator role's entry program (slot R) and the walker (slot
// MT_ROLE_COUNT), all of the object that loaded them. Filled before any
// probe is attached.
Result<void> Tracer::fill_cfi_chain() {
  if (!cfi_chain_) return {};
  memtrace_bpf* up = objs_.uprobe_object();
  bpf_map* m = bpf_object__find_map_by_name(up->obj, "unwind_chain_progs");
  bpf_program* walker = bpf_object__find_program_by_name(up->obj, "mt_unwind_chain");
  if (!m || !walker) return Error::msg("the compat BPF object has no CFI chain (unwind_chain_progs, mt_unwind_chain)");
  for (uint32_t slot = 0; slot <= MT_ROLE_COUNT; slot++) {
    std::string name = slot == MT_ROLE_COUNT ? "mt_unwind_chain"
                       : slot == 0           ? "mt_alloc_enter"
                                             : "mt_alloc_enter_" + std::to_string(slot);
    bpf_program* p = bpf_object__find_program_by_name(up->obj, name.c_str());
    int fd = p ? bpf_program__fd(p) : -1;
    if (fd < 0) return Error::msg("CFI chain: BPF program " + name + " is not loaded");
    if (bpf_map_update_elem(bpf_map__fd(m), &slot, &fd, BPF_ANY))
      return Error::sys("CFI chain: put " + name + " in unwind_chain_progs");
  }
  // mmap's exit, a tracepoint program: its own array (slot 0 the exit, 1 its walker)
  memtrace_bpf* mo = objs_.mmap ? objs_.mmap : skel_;
  bpf_map* tp = bpf_object__find_map_by_name(skel_->obj, "unwind_chain_progs_tp");
  bpf_program* exit = bpf_object__find_program_by_name(mo->obj, "mt_exit_mmap");
  bpf_program* tw = bpf_object__find_program_by_name(skel_->obj, "mt_unwind_chain_mmap");
  if (!tp || !exit || !tw) return Error::msg("the compat BPF object has no CFI chain for mmap (unwind_chain_progs_tp)");
  uint32_t slot = 0;
  for (bpf_program* p : {exit, tw}) {
    int fd = bpf_program__fd(p);
    if (fd < 0) return Error::msg(std::string("CFI chain: BPF program ") + bpf_program__name(p) + " is not loaded");
    if (bpf_map_update_elem(bpf_map__fd(tp), &slot, &fd, BPF_ANY))
      return Error::sys(std::string("CFI chain: put ") + bpf_program__name(p) + " in unwind_chain_progs_tp");
    slot++;
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
  python_add(snap.pid(), snap.maps());  // every read of new code comes here: CPython found once it is mapped
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
  if (!injected_.empty()) {
    drain_injected(true);
    retire_injected(pid);
  }
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
  stacks_after_gc_ = model_.stack_count();
  stacks_gc_last_ = std::chrono::steady_clock::now();
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

// Every uprobe first (the targets run at full speed from here; those that
// still fire before the tool exits), then the tracepoints; resume anything
// we stopped; then the perf events of exited processes go to the reaper,
// which holds no tracepoint.
void Tracer::detach_probes() {
  finishing_ = true;  // no new attach from here (the final drain's exec and mapping records)
  pymem_restore_all();  // the allocator slots first: calls leave the probed jmp before it goes
  if (skel_ && skel_->bss) skel_->bss->tracing_stopped = true;
  for (auto& [pid, p] : procs_) {
    if (p.exited) p.probes.reset();
    else p.probes.reset_before_exit();
  }
  for (auto& [key, set] : system_probes_) set.reset_before_exit();
  system_probes_.clear();
  detach_wait();
  if (skel_ && hand_over_links_) {
    // The tracepoints' links too: the guardian's references keep them until
    // it closes them, ours go at once (libbpf disables a perf-event
    // tracepoint before its close: it stops firing now).
    std::vector<int> fds;
    for (memtrace_bpf* o : {skel_, objs_.mmap})
      for (int i = 0; o && i < o->skeleton->prog_cnt; i++)
        if (bpf_link* l = *o->skeleton->progs[i].link) fds.push_back(bpf_link__fd(l));
    if (!fds.empty()) (void)guardian_->hand_over(fds);  // if not: our closes below are the slow last ones
  }
  if (objs_.mmap) memtrace_bpf__detach(objs_.mmap);
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
  if (skel_ && !objs_.main) memtrace_bpf__destroy(skel_);  // opened, not loaded
  destroy_objects(objs_);
  skel_ = nullptr;
  set_link_sink(nullptr);
}

// After detach_probes: the records written before it. The guardian closes
// the links after it, so that they may still fire meanwhile (a -p process's
// mappings, system-wide every exec): those are not this run's and do not
// keep the drain going.
void Tracer::final_drain() {
  const uint64_t until = ring_pos_[1] ? __atomic_load_n(ring_pos_[1], __ATOMIC_ACQUIRE) : 0;
  while (consume() > 0)
    if (ring_pos_[0] && __atomic_load_n(ring_pos_[0], __ATOMIC_ACQUIRE) >= until) break;
}

// --check: what this kernel offers, then the real thing: load and verify
// every BPF program, attach the tracepoints, attach the allocator probes to
// this process and detach them.
int Tracer::check(std::ostream& os) {
  install_libbpf_print();
  KernelFeatures k = probe_kernel();
  for (const auto& l : describe(k)) os << l << "\n";
  if (!k.can_run()) {
    os << "memtrace-bpf cannot run on this kernel\n";
    return 1;
  }
  o_.faults = k.page_fault_tp;
  check_only_ = true;
  if (auto r = load(); !r) {
    os << "missing  BPF programs: " << r.error().message << "\n";
    return 1;
  }
  size_t nprog = loaded_programs(objs_);
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
       << (attach_mode_ == AttachMode::UprobeMulti ? "uprobe_multi links"
           : shared_uprobes_                       ? "perf-event uprobes (shared events)"
                                                   : "perf-event uprobes")
       << " on " << where.path << " (" << (*obj)->family << ") attached and detached\n";
  }
  teardown();
  for (const auto& n : kernel_notes_) os << "note     " << n << "\n";
  os << "note     --sample-bytes on the BPF path: every allocator call still takes its uprobe traps; only the "
        "sampled ones take a stack and a record (--inject: an unsampled call costs nanoseconds)\n";
  os << (rc ? "memtrace-bpf cannot run on this kernel\n" : "memtrace-bpf can run on this kernel\n");
  return rc;
}

int Tracer::run() {
  stacks_gc_last_ = std::chrono::steady_clock::now();
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
    fc.perf_maps = [this] { return resolver_.perf_map_texts(); };
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
  model_.set_sample_bytes(o_.sample_bytes);
  phase("run: features and outputs ready");
  if (auto r = setup_targets(); !r) {
    std::cerr << "memtrace-bpf: " << r.error().message << "\n";
    if (launcher_ && launcher_->exec_failed()) {  // the program never ran: nothing to report
      teardown();
      return 2;
    }
    // Whatever was captured so far is still reported.
    consume();
    int code = child_status_ ? Launcher::exit_code_of(*child_status_) : 2;
    if (code == 0) code = 2;
    teardown();
    report_final(code);
    return code;
  }

  phase("run: targets set up (a launched program released)");
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
    if (o_.cgroup) what += (what.empty() ? "" : " and ") + std::string("cgroup ") + o_.cgroup->path;
    std::cerr << "memtrace-bpf: tracing " << what << "; Ctrl-C to stop\n";
  }
  auto start = std::chrono::steady_clock::now();
  auto next_tick = start + std::chrono::duration<double>(o_.interval);
  auto pprof_every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(o_.pprof_dir.every));
  auto next_profiles = start + pprof_every;
  int exit_code = 0;
  queue_injections_ = o_.inject;
  while (!g_stop) {
    bool behind = !inject_queue_.empty();  // --inject: copied records wait for the model, or execs their injection: no sleep
    for (const auto& s : injected_) behind = behind || s->backlog();
    int n = poll(injected_.empty() && !behind ? 50 : behind ? 0 : 2);  // --inject: the agent's ring has no wakeup; a writer waits when it is full
    // --inject: the execs that poll's records queued, ~50 ms of them (each
    // holds its process ~70 ms under ptrace), the rest next turn.
    serve_injections(std::chrono::milliseconds(50));
    // --faults: drain at least every 50 ms, so that faults on mappings made
    // before tracing are attributed from /proc/PID/maps while they exist.
    if (o_.faults && (release_held() || held_.empty())) ring_buffer__consume(rb_events_);
    if (n < 0 && n != -EINTR) {
      errors_.push_back(std::string("ring buffer poll: ") + strerror(-n));
      break;
    }
    retire_exited();
    // A scrape waits: the counters as drained so far (metrics/exporter.h),
    // after the exits this drain was past (a process that ended before the
    // scrape is gone in it).
    if (metrics_)
      metrics_->serve([this] { return metrics::snapshot_of(model_, drops(), {o_.faults, !system_wide_}); });
    // A thread a restore's stop found in D state (inject::StopLimits): it
    // stops once it leaves that state, and only this thread may let it go.
    inject::release_late_threads();
    // Images that ended are sealed in steps between drains: 10 ms a turn,
    // more when they queue up (a build's compilers end one after another).
    if (model_.sealing()) model_.seal_some(std::chrono::milliseconds(10 * std::min<size_t>(model_.sealing(), 8)));
    auto now = std::chrono::steady_clock::now();
    if (stacks_gc_due(now)) collect_stacks();
    if (launcher_) {
      int st;
      if (launcher_->poll_exit(&st)) {
        child_status_ = st;
        if (traced_since_) traced_seconds_ = std::chrono::duration<double>(now - *traced_since_).count();
        phase("run: the program exited");
        exit_code = Launcher::exit_code_of(st);
        break;
      }
    }
    if (!o_.pids.empty() && o_.command.empty() && o_.comms.empty() && !o_.cgroup) {
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
  // Execs still waiting for their injection when the loop ended (Ctrl-C,
  // --duration): let go untraced (the probes go next), counted; from here
  // on an exec is handled inline.
  queue_injections_ = false;
  for (const auto& job : inject_queue_) {
    if (!stopped_.count(job.pid)) continue;
    resume(job.pid);
    inject_queue_left_++;
  }
  inject_queue_.clear();
  if (feat_) feat_->end_view();  // the terminal back before the teardown's messages and the report
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
  phase("end: probes detached (handed to the guardian)");
  final_drain();
  phase("end: final drain");
  report_final(exit_code);
  phase("end: report written");
  teardown();
  phase("end: teardown");
  // Every output closed here: what is left is memory (quick_exit_ok).
  file_out_.reset();
  more_outs_.clear();
  feat_.reset();
  pprof_dir_.reset();
  finished_ = true;
  return exit_code;
}

}  // namespace memtrace::loader
