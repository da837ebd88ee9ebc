// The loader's side of --inject: the shared-memory ring of one target
// (ring.h), the agent loaded into it (injector.h), the records drained in
// order. The records are bpf/memtrace.h's (mt_event, mt_stack): the caller
// feeds them to the heap model as it does the BPF ring's.
//
//   auto s = inject::Session::start(pid, {.agent = inject::agent_path()});
//   while (...) { s->drain([&](const void* d, size_t n) { model.apply(d, n); }); }
//   s->detach();   // hooks call straight through from now on; drain once more
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/result.h"
#include "inject/cfi_rows.h"
#include "inject/injector.h"
#include "inject/ring.h"
#include "inject/trampoline.h"
#include "procfs/proc_maps.h"

namespace memtrace::inject {

// libmemtrace_agent.so: $MEMTRACE_AGENT, else beside this program (the
// build tree), else where cmake --install and the .deb put it
// (/usr/lib/<arch>/memtrace-bpf/ for /usr/bin/memtrace-bpf).
std::string agent_path();

struct SessionOptions {
  std::string agent;                         // path of libmemtrace_agent.so
  size_t ring_mb = 64;                       // data area, MiB (a power of two)
  int stack_mode = MT_INJ_STACK_LIBUNWIND;   // enum mt_inj_stack_mode
  int timeout_ms = 10000;                    // for the dlopen call
  StoppedProcess* held = nullptr;            // stopped already (hold_at_entry)
  bool entries = true;                       // patch the allocator's entries (trampoline.h; x86-64)
  bool got = true;                           // rewrite GOT slots
  bool verify_stacks = false;                // MT_INJ_STACK_CFI: each walk compared with libunwind's (ring.h MT_INJ_CFI_VERIFY)
  uint64_t sample_bytes = 0;                 // --sample-bytes (ring.h sample_bytes); 0: every call
  // CPython's frames (ring.h py_frames): where the agent finds them, as
  // for the BPF walk (Tracer::python_add); unset: no Python frames.
  std::optional<mt_py_proc> py;
  // The program's allocator when it is not glibc's (ring.h fns): its
  // functions as the BPF path's detection found them (src/probes), with
  // the role each records as; empty: glibc's, found by the agent.
  struct AllocatorFn {
    uint64_t addr = 0;
    uint32_t role = 0;     // enum mt_role
    bool primary = false;  // the role's own function (malloc, je_malloc), not another entry (new, sdallocx)
    std::string name;
  };
  std::vector<AllocatorFn> allocator;
  std::string allocator_name;  // "jemalloc in /usr/lib/x86_64-linux-gnu/libjemalloc.so.2", for the log
  // The process as the caller read it (maps; the allocator's code, busy
  // for the dlopen call): one snapshot for the whole attach. Empty maps:
  // read here.
  ProcessView view;
};

// The ring, mapped in this process too; the file's name is removed once the
// agent has mapped it (or when the session goes).
class Ring {
 public:
  // cfi: MT_INJ_STACK_CFI's rows, carried after the data area (ring.h cfi_off).
  // root: agent_root(pid)'s ("" ours): the file is made under it.
  static Result<std::unique_ptr<Ring>> create(pid_t pid, size_t data_bytes, int stack_mode,
                                              const CfiRows* cfi = nullptr, const std::string& root = "");
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Every complete record in order, at most max; fn(record, bytes). The
  // number of records (pads not counted). Compact records (ring.h) come
  // as mt_event (expand) or as the struct mt_inj_rec they are, their ts
  // in ns either way.
  size_t drain(const std::function<void(const void*, size_t)>& fn, size_t max = SIZE_MAX, bool expand = true);
  void heartbeat();             // the agent's check that the loader lives (MT_INJ_STALE_NS)
  void set_state(uint32_t s);   // enum mt_inj_state
  void unlink_name();
  const volatile mt_inj_hdr& hdr() const { return *hdr_; }
  mt_inj_hdr* mutable_hdr() { return hdr_; }
  uint64_t backlog() const;     // bytes written and not drained
  uint64_t malformed() const { return malformed_; }
  bool tsc() const { return tsc_; }

 private:
  Ring() = default;
  mt_inj_hdr* hdr_ = nullptr;
  char* data_ = nullptr;
  size_t map_bytes_ = 0;
  uint64_t mask_ = 0;
  uint64_t malformed_ = 0;
  // ts_mode MT_INJ_TS_TSC: the TSC and CLOCK_MONOTONIC read together at
  // creation and at the latest drain; ticks per ns between them (refined
  // at every drain, the span growing: 1e-5 after a second).
  bool tsc_ = false;
  uint64_t tsc0_ = 0, ns0_ = 0, tsc1_ = 0, ns1_ = 0;
  double ticks_per_ns_ = 0;
  void calibrate();
  uint64_t ns_of(uint64_t tsc) const;
  std::string path_;
};

// The end of a session in the target, one function for a clean end
// (Session::detach) and a dead session's leftovers (restore_left_patched):
// the hooks call straight through (state DETACHED), then the allocator's
// entries go back as the file has them and the agent's pointers to the
// originals with them (unpatch_entries: every thread stopped, a uprobe's
// int3 kept); the stubs are not run any more. hdr: the session's ring
// header as this process maps it. How many entries were put back.
Result<uint32_t> end_in_target(pid_t pid, mt_inj_hdr* hdr);

// A process an earlier --inject session left patched (its tool was
// SIGKILLed: the agent's hooks call the originals through the stubs, past
// any uprobe on the entries' first instructions), ended as a clean detach
// would (end_in_target), before the BPF path's uprobes go on it. maps:
// pid's; the agent's rings are found there (MT_INJ_PATH_FMT, mapped
// shared) and opened through /proc/PID/map_files. 0: nothing to do (no
// ring, a clean end before, no entry patched); else how many entries were
// put back. An error when entries stay patched: ptrace refused, or a live
// --inject session (another tool's) records the process; its uprobe
// counts are then incomplete.
Result<uint32_t> restore_left_patched(pid_t pid, const std::vector<procfs::Mapping>& maps);

class Session {
 public:
  static Result<std::unique_ptr<Session>> start(pid_t pid, const SessionOptions& o);
  ~Session();  // detach()
  pid_t pid() const { return pid_; }
  Ring& ring() { return *ring_; }
  const LoadStats& load_stats() const { return load_; }
  const PatchReport& patch_report() const { return patch_; }
  // MT_INJ_STACK_CFI: the rows the agent was given (empty otherwise).
  struct CfiStats {
    size_t mods = 0, rows = 0, bytes = 0, mappings_without = 0;
    double build_ms = 0;
    std::string first_error;
  };
  const CfiStats& cfi_stats() const { return cfi_; }
  // Without the copier: the ring's records (at most max). With it: what
  // the copier has taken (up to kChunksPerDrain chunks; all with flush),
  // and with flush the ring's rest too: every record written so far.
  size_t drain(const std::function<void(const void*, size_t)>& fn, size_t max = SIZE_MAX, bool flush = false);
  // A thread of its own copies the ring's records into this process's
  // memory as they come, up to max_backlog bytes held: the target's
  // threads wait for a full ring only when the heap model (drain's fn) is
  // that far behind, not whenever it is 64 MiB behind.
  void start_copier(size_t max_backlog);
  bool backlog() const { return queued_.load(std::memory_order_relaxed) != 0; }
  uint64_t backlog_peak() const { return backlog_peak_; }
  // The hooks stop writing; records already reserved are committed within
  // a few microseconds: drain after this (with flush).
  void detach();
  // Its process is gone: its ring is done (nothing is written into it
  // again), its copier stopped, nothing asked of the pid (it may be
  // another process's by now).
  void ended();

 private:
  Session() = default;
  pid_t pid_ = 0;
  std::unique_ptr<Ring> ring_;
  LoadStats load_;
  PatchReport patch_;
  CfiStats cfi_;
  // The copier: chunks of [u32 bytes][record] (mt_inj_rec or mt_stack).
  static constexpr size_t kChunkBytes = 1 << 20;
  static constexpr size_t kChunksPerDrain = 16;
  void copier();
  void stop_copier();
  std::thread copier_;
  std::atomic<bool> stop_{false};
  std::mutex ring_mu_;  // one consumer of the ring at a time
  std::mutex mu_;       // chunks_, spare_
  std::deque<std::vector<char>> chunks_;
  // The chunk the copier is filling (ring_mu_): records already taken out
  // of the ring, not yet in chunks_; a flush takes them too, in order.
  std::vector<char> cur_;
  std::vector<std::vector<char>> spare_;
  std::atomic<size_t> queued_{0};  // bytes in chunks_
  size_t max_backlog_ = 0;
  uint64_t backlog_peak_ = 0;
};

}  // namespace memtrace::inject
