// Tracer: the records of the two ring buffers (allocator events; exec, fork,
// exit and mappings), applied to the heap model.
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

#include "common/phase_log.h"
#include "loader/output_file.h"
#include "loader/recording.h"
#include "memtrace_bpf.skel.h"
#include "memtrace_bpf_compat.skel.h"
#include "inject/session.h"
#include "metrics/exporter.h"

namespace memtrace::loader {

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
  // Python frames spliced first: the model and a recording get the stack as reported.
  if (len >= sizeof(mt_hdr) && static_cast<const mt_hdr*>(data)->kind == MT_EV_PYCODE) {
    python_code(data, len);  // the tool's own: not the model's, not recorded
    return;
  }
  std::vector<char> spliced;
  if (len >= MT_STACK_HDR_BYTES && static_cast<const mt_hdr*>(data)->kind == MT_EV_STACK &&
      python_splice(data, len, spliced)) {
    data = spliced.data();
    len = spliced.size();
  }
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
        if (e.h.flags & MT_F_EXEC_STATIC) static_exec(pid, e.ppid, e.len);
        // A static program's first exec, stopped until its probes were in
        // (static_exec): on its way now, not after the drain below.
        if (stopped) {
          resume(pid);
          stopped = false;
          uint64_t us = (monotonic_ns() - e.h.ts) / 1000;
          static_stops_++;
          static_stop_max_us_ = std::max(static_stop_max_us_, us);
          log("static program pid " + std::to_string(pid) + " (" + comm + ") stopped " + std::to_string(us) +
              " us at its exec for its probes");
        }
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
      python_forget(pid);  // the old image's interpreter
      unwind_add(snap);  // the new image (and ld.so) even before an allocator is mapped
      procs_[pid].injected = false;  // its agent went with its old image
      handed_over_.erase(pid);       // the old image's records are in (drained above)
      swallowed_.erase(pid);
      if (o_.inject && stopped && queue_injections_) {  // injected between drains (serve_injections), stopped till then
        snap.maps();                                   // read now, while nothing of it has run
        inject_queue_.push_back({pid, monotonic_ns(), snap});
        inject_queued_++;
        inject_queue_peak_ = std::max<uint64_t>(inject_queue_peak_, inject_queue_.size());
        stopped = false;
        break;
      }
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
      python_forget(pid, true);
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
  note_launched_traced(pid);
  return 0;
}

// The launched program runs traced from here (benchmarks time this part).
void Tracer::note_launched_traced(pid_t pid) {
  if (launcher_ && pid == launcher_->pid() && procs_[pid].attached && !traced_since_) {
    traced_since_ = std::chrono::steady_clock::now();
    phase("run: the launched program's allocator probes attached, resumed");
  }
}

// --inject: the execs the lifecycle callback queued, oldest first, for at
// most `budget` a turn of the run loop (one at least). A process that ended
// while it waited (killed: its exit record forgot its stop) is skipped.
void Tracer::serve_injections(std::chrono::milliseconds budget) {
  auto deadline = std::chrono::steady_clock::now() + budget;
  while (!inject_queue_.empty()) {
    PendingInject job = std::move(inject_queue_.front());
    inject_queue_.pop_front();
    pid_t pid = job.pid;
    if (!stopped_.count(pid)) {
      inject_queue_gone_++;
      log("pid " + std::to_string(pid) + " ended while it waited for its injection");
      continue;
    }
    inject_wait_max_us_ = std::max(inject_wait_max_us_, (monotonic_ns() - job.queued_ns) / 1000);
    if (auto r = inject_at_exec(pid, job.snap); !r) {
      errors_.push_back(r.error().message);
      attach_failures_++;
    }
    resume(pid);
    note_launched_traced(pid);
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
}

}  // namespace memtrace::loader
