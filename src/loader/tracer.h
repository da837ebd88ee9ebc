// The attach-and-drain loop: loads bpf/memtrace.bpf.c, attaches allocator
// probes per process, follows exec/fork/exit, drains the ring buffers into
// the heap model and prints reports.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "procfs/cgroup.h"

#include "common/result.h"
#include "heap/heap_model.h"
#include "loader/attach.h"
#include "loader/bpf_object.h"
#include "loader/kernel_features.h"
#include "loader/faults.h"
#include "loader/features.h"
#include "loader/guardian.h"
#include "loader/launcher.h"
#include "loader/pprof_dir.h"
#include "loader/resolver.h"
#include "python/pymem.h"
#include "report/outputs.h"
#include "report/report.h"
#include "unwind/unwind_maps.h"

struct memtrace_bpf;
struct ring_buffer;
namespace memtrace::metrics {
class Exporter;
}
namespace memtrace::inject {
class Session;
struct SessionOptions;
class StoppedProcess;
}

namespace memtrace::loader {

struct Options {
  std::vector<pid_t> pids;
  std::vector<std::string> comms;
  std::optional<procfs::Cgroup> cgroup;  // --cgroup: a cgroup v2 subtree, processes started later too
  std::vector<std::string> command;  // launch mode
  double duration = 0;               // seconds, 0 = until the end
  double interval = 0;               // periodic summaries
  // -o FILE (repeatable) with its format (report/outputs.h: plan_outputs);
  // empty: the report to the default stream in `format`.
  std::vector<report::OutputSpec> outputs;
  std::string format = "text";       // of the primary output (text or json): --trace, --interval, console
  report::FoldedValue folded_value = report::FoldedValue::LiveBytes;  // --folded-value
  size_t top = 10;
  bool stacks = true;
  bool cfi = true;                   // --unwind cfi (default) | fp
  AllocatorChoice allocator;         // -O / -S
  size_t ringbuf_mb = 0;             // events ring, MiB (0: 64 system-wide and -c, 16 else)
  int drain_nice = -10;              // system-wide: the drain thread's nice value (MEMTRACE_DRAIN_NICE)
  std::string test_unreadable_comm;  // tests (MEMTRACE_TEST_UNREADABLE_COMM): processes taken for gone unread
  size_t unwind_mb = 512;  // cap on the unwind tables in the kernel
  size_t max_images = 256;  // ended images kept one by one (--max-images; heap_model.h set_image_cap)
  std::vector<std::string> symbol_dirs;
  bool dwarf = true;
  bool explain_probes = false;
  bool verbose = false;
  // Page faults (issue 6).
  bool faults = false;               // --faults (also implied by the two below)
  bool trace_faults = false;         // --trace-faults: one line per fault
  double rearm_ms = 0;               // --rearm MS (with --range, one -p PID)
  std::vector<std::string> ranges;   // --range START-END | ADDR
  FeatureOptions features;           // --console --trace --live --dump-bytes --record (features.h)
  std::string metrics;               // --metrics ADDR:PORT (metrics/exporter.h)
  size_t metrics_max_processes = 200;  // --metrics-max-processes
  PprofDirOptions pprof_dir;         // --pprof-dir DIR (empty: off), --pprof-every, --pprof-keep (pprof_dir.h)
  // --inject (issue 21): the -p processes' malloc family from the agent
  // library loaded into them (src/inject), not from uprobes; BPF keeps
  // mmap/brk, exec/fork/exit.
  bool inject = false;
  size_t inject_ring_mb = 64;
  // --inject's stacks under --unwind cfi (issue 33, MEMTRACE_INJECT_UNWIND):
  // the agent's walk on the loader's CFI rows (default), libunwind's alone,
  // or the rows' walk compared with libunwind's on every stack (verify).
  enum class InjectUnwind { Cfi, Libunwind, Verify } inject_unwind = InjectUnwind::Cfi;
  // --sample-bytes N (issue 34): the agent records one allocation per N
  // bytes on average (Poisson, per thread), weighted; 0: every call.
  uint64_t sample_bytes = 0;
  // --python-frames (issue 32, src/python): CPython frames spliced into the
  // stacks of processes that run it (BPF path, x86-64).
  python::Mode python_frames = python::Mode::On;
  // --python-domain (issue 32, src/python/pymem.h): CPython's pymalloc
  // traced as the python domain beside malloc (BPF path, 3.11, x86-64).
  bool python_domain = true;
};

class Tracer {
 public:
  explicit Tracer(Options o);
  ~Tracer();
  // Runs until the traced program exits, the last traced process exits (-p),
  // --duration, or SIGINT/SIGTERM/SIGHUP. Returns the tool's exit code.
  int run();
  // run() ended normally: the report written, every output closed, the
  // links handed over. The process may end without freeing the tool's
  // memory piece by piece (the model, the symbol tables: 0.3 s on W1).
  bool quick_exit_ok() const { return finished_; }
  // memtrace-bpf --check: prints what the kernel supports and which
  // fallbacks are used, loads and attaches everything once; 0 if it can run.
  int check(std::ostream& os);

  // For the ring buffer callbacks.
  int on_event(void* data, size_t len);
  void apply_event(void* data, size_t len);
  int on_proc_event(void* data, size_t len);

 private:
  struct Proc {
    pid_t pid = 0;
    ProbeSet probes;
    std::set<std::pair<uint64_t, uint64_t>> objects;  // (dev, inode) of files looked at for allocators
    bool attached = false;  // through its own probes, or system-wide ones
    bool injected = false;  // --inject: its malloc family from the agent, not uprobes
    bool exited = false;
    bool leftovers_tried = false;  // inject::restore_left_patched ran for it (once: an attach retried after it does not again)
  };

  Result<void> load();
  Result<void> fill_cfi_chain();
  Result<void> setup_targets();
  // One read of a process's /proc/PID/maps for one event, handed to every
  // part that needs it (resolver, unwinder, attacher, recording): made on
  // first use, null if the process is gone.
  class Snapshot {
   public:
    Snapshot(pid_t pid, uint64_t* reads) : pid_(pid), reads_(reads) {}
    const std::vector<MapEntry>* maps();
    Result<void> error();  // why maps() is null
    pid_t pid() const { return pid_; }
   private:
    pid_t pid_;
    uint64_t* reads_;
    std::optional<Result<std::vector<MapEntry>>> m_;
  };
  uint64_t maps_reads_ = 0;  // /proc/PID/maps reads by the tracer (STATS)
  Result<void> attach_process(pid_t pid, bool required, Snapshot* snap = nullptr);
  void attach_more_allocators(Snapshot& snap);
  void set_target_state(pid_t pid, uint32_t state, uint32_t follow);
  void resume(pid_t pid);
  uint32_t image_of(pid_t pid);
  void scan_system_allocators(pid_t only = -1, uint64_t exec_id = 0);
  bool attach_again_later(pid_t pid, const std::string& why);
  // System-wide: pid exec'd a program without an interpreter (MT_F_EXEC_STATIC),
  // its mappings just read (tracer_attach.cpp).
  void static_exec(pid_t pid, uint32_t kdev, uint64_t inode);  // the file as the kernel names it
  void set_static_known(uint64_t dev, uint64_t inode);  // BPF's static_known: its execs not stopped
  // Statically linked programs' files looked at, by (dev, inode): true if
  // stripped with no allocator found (its processes' allocations untraced).
  std::map<std::pair<uint64_t, uint64_t>, bool> static_files_;
  uint64_t static_without_symbols_ = 0;  // execs of those (dropped: static_without_symbols)
  uint64_t static_stops_ = 0, static_stop_max_us_ = 0;  // first execs stopped for their probes, and how long
  // System-wide exec (exec_id: the exec's id, heap::Process::exec_ts) or new code (0).
  void read_process_once(pid_t pid, uint64_t ts, uint64_t exec_id);
  // Every so often: raw stacks of ended images dropped, and BPF told to send them again.
  void collect_stacks();
  // pid exited: once its last records are applied (retire_exited), its image
  // is sealed and its mappings forgotten.
  void process_gone(pid_t pid, int exit_code);
  void on_map_event(const mt_map_event& e);
  void retire_exited(bool all = false);  // all: every queued exit (the rings are drained)
  struct Exited {
    uint64_t until;  // the events ring's producer position when its exit was read
    pid_t pid;
    int code;
  };
  std::deque<Exited> exited_;
  std::map<pid_t, uint64_t> last_read_ns_;  // when each process's mappings were last read
  std::map<pid_t, uint64_t> exec_ids_;      // system-wide: each process's last exec's id
  // System-wide: the new image's name, given to it when the events ring's
  // MT_EV_EXEC is applied (a fork right after inherits it), by exec id.
  std::map<pid_t, std::pair<uint64_t, std::string>> exec_comms_;
  void report_final(int exit_code);
  void log_pprof_round(const PprofDir::RoundStats& rs);  // -v
  report::Drops drops();
  std::ostream& out();
  void detach_probes();  // run()'s end and teardown()
  void final_drain();    // the records written before detach_probes
  bool finishing_ = false;  // detach_probes ran: nothing more is attached
  bool check_only_ = false;  // --check: its programs never stop a process (nobody would resume it)
  bool finished_ = false;   // quick_exit_ok
  void teardown();
  void log(const std::string& s);

  std::vector<std::string> notes() const;  // kernel fallbacks, then the attacher's
  nlohmann::json kernel_json() const;

  Options o_;
  KernelFeatures kf_;
  bool full_bpf_ = true;  // the full BPF object, else the compat one (kernel_features.h)
  bool syscall_fexit_ = false;  // mmap family and fork child on fentry/fexit, not syscalls:* tracepoints
  bool cfi_chain_ = false;  // compat object with CFI stacks: the walker is a chain of tail calls (fill_cfi_chain)
  AttachMode attach_mode_ = AttachMode::UprobeMulti;
  bool shared_uprobes_ = false;  // perf-event uprobes: shared events (shared_uprobes.h)
  std::vector<std::string> kernel_notes_;  // fallbacks this kernel needs, shown in the report
  struct memtrace_bpf* skel_ = nullptr;  // objs_.main once loaded: its maps, rodata, bss, tracepoints
  BpfObjects objs_;                       // bpf_object.h
  struct ring_buffer* rb_ = nullptr;
  struct ring_buffer* rb_events_ = nullptr;
  Fd epoll_;                      // both rings' epoll fds
  int consume();                  // drain both rings: records consumed, or -errno
  void drain_events();            // the whole events ring (inside a lifecycle callback)
  uint32_t budget_ = 0;           // events left in consume()'s slice (0: no limit)
  // System-wide: an events-ring MT_EV_EXEC whose lifecycle record has not
  // been handled waits for it (consumption stops there): the image that
  // exec ends is sealed only when the lifecycle ring's records from before
  // the exec are in (a forked child's parent's mappings: its exec's read,
  // the kernel's MT_EV_MAPFILE records).
  std::vector<char> held_;
  uint64_t drain_bound_ = 0;      // drain_events inside a lifecycle record's callback: its time
  std::set<std::pair<pid_t, uint64_t>> lifecycle_execs_;  // execs (pid, id) whose lifecycle record was handled
  bool release_held();            // applies the held record, unless it comes after drain_bound_
  const uint64_t* ring_pos_[2] = {nullptr, nullptr};  // events ring: consumer, producer position
  uint64_t ring_peak_ = 0;        // bytes queued in it at most, seen at a consume()
  int poll(int timeout_ms);       // wait for either ring, then consume()
  std::unique_ptr<Attacher> attacher_;
  std::unique_ptr<unwind::UnwindMaps> unwind_;  // null: frame pointers only
  void unwind_add(Snapshot& snap);
  // The model's process named from /proc: its comm (comm: read it) and, the
  // first time, its cgroup (what every output labels it with).
  void identify(pid_t pid, bool comm = true);
  // Python frames (tracer_python.cpp): CPython found in a process (its
  // py_procs entry for the BPF walk), the frames of a stack record spliced.
  struct PyProc {
    python::Interpreter in;
    python::CodeTable codes;                  // from its MT_EV_PYCODE records
    std::unique_ptr<python::CodeReader> code;  // what those could not carry, read while it lives
    bool exited = false;  // its stacks still queued are named from the cache
  };
  bool py_seen_ = false;  // some process ran CPython: its counters are reported
  std::map<pid_t, PyProc> py_;
  python::FrameTable py_frames_;
  python::Counts py_counts_;
  std::set<std::string> py_unsupported_;  // lines said once
  uint64_t py_gone_ = 0;                  // Python frames of a process no longer known: dropped
  // CPython in pid: its PyProc, and the walk's offsets in the BPF map
  // (walk null) or in *walk (--inject: the agent's ring header). False: none.
  bool python_add(pid_t pid, const std::vector<procfs::Mapping>* maps, mt_py_proc* walk = nullptr);
  void python_forget(pid_t pid, bool exited = false);
  // A stack record with Python pairs, spliced into out (false: leave it as it is).
  bool python_splice(const void* data, size_t len, std::vector<char>& out);
  void python_drops(report::Drops& d) const;
  void python_code(const void* data, size_t len);  // an MT_EV_PYCODE record
  uint64_t py_code_records_ = 0, py_code_fallback_ = 0;
  // The python domain (src/python/pymem.h, tracer_pymem.cpp): pymalloc's
  // probes of a CPython process and the allocator slots written in it.
  struct PyMemProc {
    ProbeSet probes;
    std::vector<python::PyMemSlot> slots;
  };
  std::map<pid_t, PyMemProc> pymem_;
  std::set<std::string> pymem_said_;  // notes said once
  uint64_t pymem_procs_ = 0, pymem_inlined_ = 0, pymem_failed_ = 0;
  void pymem_add(pid_t pid, const python::Interpreter& in, const std::vector<procfs::Mapping>& maps);
  void pymem_forget(pid_t pid, bool exited);
  void pymem_restore_all();
  void pymem_drops(report::Drops& d) const;
  heap::HeapModel model_;
  Resolver resolver_;
  size_t stacks_gc_at_ = size_t{1} << 16;  // collect_stacks() once the model holds this many raw stacks
  uint64_t stacks_collected_ = 0;          // dropped by collect_stacks() in all
  // ... or once it holds stacks_gc_growth_ more than after the last
  // collection and stacks_gc_every_ has passed: a daemon over short
  // processes (each a new address space: new raw stacks, sealed at its end)
  // would otherwise grow to 65,536 of them (~13 MiB) before the first
  // collection (bench/soak). MEMTRACE_STACKS_GC_MS (tests): every MS, any growth.
  size_t stacks_gc_growth_ = 4096;
  std::chrono::steady_clock::duration stacks_gc_every_ = std::chrono::seconds(30);
  std::chrono::steady_clock::time_point stacks_gc_last_{};
  size_t stacks_after_gc_ = 0;
  bool stacks_gc_due(std::chrono::steady_clock::time_point now) const {
    size_t n = model_.stack_count();
    return n >= stacks_gc_at_ || (n >= stacks_after_gc_ + stacks_gc_growth_ && now - stacks_gc_last_ >= stacks_gc_every_);
  }
  std::map<pid_t, Proc> procs_;
  std::map<std::pair<uint64_t, uint64_t>, ProbeSet> system_probes_;  // system-wide mode
  std::pair<uint64_t, uint64_t> self_exe_{0, 0};  // (dev, inode) of our own binary: never probed system-wide
  std::set<pid_t> stopped_;  // processes BPF stopped that we must resume
  std::optional<Guardian> guardian_;  // resumes them if this process dies first (run() only)
  bool hand_over_links_ = false;      // and closes the links (guardian.h)
  void forget_stopped(pid_t pid);     // and the BPF map's entry for it
  std::optional<Launcher> launcher_;
  std::optional<int> child_status_;
  std::unique_ptr<std::ostream> file_out_;  // the primary output's file (report/outputs.h)
  // The other -o files, written by report_final only (null: out()).
  std::vector<std::pair<report::OutputSpec, std::unique_ptr<std::ostream>>> more_outs_;
  bool text_report_ = true;  // some output is text or JSON
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::vector<std::string> errors_;  // non-fatal, shown in the report
  uint64_t attach_failures_ = 0;
  uint64_t attach_count_ = 0, attach_us_ = 0;  // per-process attaches, time in Attacher::attach
  // Processes a killed --inject session left patched: put back before the
  // uprobes, and not (their counts incomplete; inject::restore_left_patched).
  uint64_t inject_leftovers_restored_ = 0, inject_leftovers_unrestored_ = 0;
  uint64_t unwind_errors_ = 0;
  uint64_t unwind_gone_ = 0;
  // Launch mode: from the resume after the allocator probes were attached
  // to the program's exit (microseconds in the stats).
  std::optional<std::chrono::steady_clock::time_point> traced_since_;
  double traced_seconds_ = -1;
  bool system_wide_ = false;
  bool torn_down_ = false;
  // --faults / --trace-faults / --rearm (src/loader/faults.h)
  Result<void> start_rearm();
  void stop_rearm();
  std::unique_ptr<MapsCache> maps_cache_;
  std::unique_ptr<FaultTrace> fault_trace_;
  std::unique_ptr<RearmHelper> rearm_;
  nlohmann::json rearm_report_;
  std::unique_ptr<Features> feat_;  // features.h: null unless one is asked for
  std::unique_ptr<metrics::Exporter> metrics_;  // --metrics
  std::unique_ptr<PprofDir> pprof_dir_;         // --pprof-dir
  // --inject: one agent session per traced process (src/inject/session.h);
  // a process the agent cannot go into gets one line and the BPF path.
  Result<void> inject_process(pid_t pid, inject::StoppedProcess* held = nullptr);
  Result<void> inject_allocator(pid_t pid, const std::vector<MapEntry>& maps, inject::SessionOptions* so);
  Result<void> inject_or_attach(pid_t pid, bool given);
  Result<void> inject_at_exec(pid_t pid, Snapshot& snap);
  // --inject: execs stopped by BPF, waiting for their injection (the
  // lifecycle callback queues them while the run loop runs; serve_injections
  // takes them a few a turn, so that an exec storm, ~70 ms of ptrace work
  // each, does not keep the loop from /metrics, --pprof-dir, the live view
  // and Ctrl-C: each waits stopped meanwhile, as it did inside the callback).
  struct PendingInject {
    pid_t pid;
    uint64_t queued_ns;
    Snapshot snap;  // its mappings at its exec (the process has not run since)
  };
  std::deque<PendingInject> inject_queue_;
  bool queue_injections_ = false;  // the run loop is serving inject_queue_
  uint64_t inject_queued_ = 0, inject_queue_gone_ = 0, inject_wait_max_us_ = 0, inject_queue_peak_ = 0;
  uint64_t inject_queue_left_ = 0;  // still waiting when the run ended: let go untraced
  void serve_injections(std::chrono::milliseconds budget);
  void note_launched_traced(pid_t pid);  // launch mode: the program runs traced from here
  void wait_stop_landed(pid_t pid);
  size_t drain_injected(bool flush = false);  // flush: every record written so far
  void detach_injected();
  std::vector<std::unique_ptr<inject::Session>> injected_;
  // The counters of the sessions whose process ended (retire_injected):
  // their threads and rings go with their process, their counts stay.
  struct InjectTotals {
    uint64_t sessions = 0, drops = 0, py_cut = 0, malformed = 0, fork_child = 0, full_waits = 0, backlog_peak = 0;
    uint64_t stack_slow = 0, stack_cut = 0, stack_verified = 0, stack_mismatch = 0;
    void add(inject::Session& s);
  };
  InjectTotals inject_retired_;
  void retire_injected(pid_t pid);  // its session's counters kept, the session ended
  // --inject of a process at its exec: its uprobes record it up to its entry
  // point, where the agent takes over (inject_at_exec). From then on the
  // uprobes' allocator records of the image are dropped (they are closed in
  // the background and still fire meanwhile): handed_over_. BPF's stops at
  // its new libraries on the way were taken under ptrace there, not by
  // resume(): swallowed_ of each pid, forgotten when their records come.
  std::set<pid_t> handed_over_;
  bool handed_over_call(const void* data, size_t len) const;
  std::map<pid_t, int> swallowed_;
};

}  // namespace memtrace::loader
