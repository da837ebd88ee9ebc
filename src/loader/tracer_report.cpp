// Tracer: what it reports (losses, notes, the final report).
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
    case MT_C_PY_NO_TSTATE: return "python_no_thread_state";
    case MT_C_PY_READ_FAILED: return "python_frames_unreadable";
    case MT_C_PY_CUT: return "python_frames_cut";
    case MT_C_PY_CODE_RINGBUF_FULL: return "python_code_ringbuf";
    case MT_C_CHAIN_FALLBACK: return "cfi_chain_fallbacks";
  }
  return "?";
}

bool counter_is_loss(int c) {
  return c != MT_C_NESTED && c != MT_C_FAULTS_FILTERED && c != MT_C_STACK_TRUNCATED &&
         c != MT_C_FAULT_VMA_BUSY && c != MT_C_PY_NO_TSTATE && c != MT_C_CHAIN_FALLBACK;
}

}  // namespace

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
  python_drops(d);
  d.stats["mappings_incomplete"] = resolver_.incomplete();        // gone before a library's mapping was read
  // Of those: mappings rebuilt from the kernel's records, and records whose file was not found.
  d.stats["mappings_from_kernel"] = resolver_.kernel_given();
  d.stats["mappings_from_kernel_unresolved"] = resolver_.kernel_unresolved();
  d.stats["mappings_read_after_next_exec"] = resolver_.misread();  // dropped: the kernel's records instead
  d.dropped["stack_record_missing"] = model_.missing_stacks();
  d.dropped["malformed"] = model_.malformed_records();
  d.dropped["attach_failed"] = attach_failures_;
  // System-wide: execs of stripped static programs (no allocator to probe).
  d.dropped["static_without_symbols"] = static_without_symbols_;
  d.stats["static_exec_stops"] = static_stops_;          // first execs of static programs, held for their probes
  d.stats["static_exec_stop_max_us"] = static_stop_max_us_;  // the longest such hold
  if (inject_leftovers_restored_ || inject_leftovers_unrestored_) {  // processes, not events
    d.stats["inject_leftovers_restored"] = inject_leftovers_restored_;
    d.dropped["inject_leftovers_unrestored"] = inject_leftovers_unrestored_;
  }
  if (!injected_.empty() || inject_retired_.sessions) {  // --inject: records the agent could not write (its ring full)
    // The sessions of processes that ended, then those still going.
    InjectTotals t = inject_retired_;
    for (const auto& s : injected_) t.add(const_cast<inject::Session&>(*s));
    d.dropped["python_frames_cut"] += t.py_cut;  // the BPF walk's counter too
    d.dropped["inject_ring_full"] = t.drops;
    d.dropped["inject_malformed"] = t.malformed;
    // a fork's child calling the allocator before the agent's atfork child
    // handler (another library's handler): neither ring sees those calls
    d.dropped["inject_fork_child_calls"] = t.fork_child;
    d.stats["inject_full_waits"] = t.full_waits;  // 50 us naps of the target's threads: the drain was behind
    d.stats["inject_backlog_peak_kb"] = t.backlog_peak >> 10;  // records copied out of the ring, not yet in the model
    // The agent's CFI walk (ring.h MT_INJ_STACK_CFI): walks the rows could
    // not finish, redone by libunwind; stacks left short (no libunwind: the
    // rows' frames, flagged truncated); MEMTRACE_INJECT_UNWIND=verify: walks
    // compared with libunwind's, and those that differed.
    d.stats["inject_stack_slow"] = t.stack_slow;
    d.dropped["inject_stack_cut"] = t.stack_cut;
    d.stats["inject_stack_verified"] = t.stack_verified;
    d.stats["inject_stack_mismatch"] = t.stack_mismatch;
    d.stats["inject_sessions_ended"] = inject_retired_.sessions;  // their threads and rings released
  }
  if (inject_queued_) {  // --inject: execs injected between drains (serve_injections)
    d.stats["inject_execs_queued"] = inject_queued_;
    d.stats["inject_queue_waiting"] = inject_queue_.size();    // now (a scrape's, a live view's)
    d.stats["inject_queue_peak"] = inject_queue_peak_;         // waiting at once, at most
    d.stats["inject_queue_wait_max_us"] = inject_wait_max_us_;  // the longest wait, stopped, for its turn
    d.stats["inject_queue_ended_waiting"] = inject_queue_gone_;  // ended (killed) before their turn
    d.dropped["inject_queue_left_at_end"] = inject_queue_left_;   // started as the run ended: let go untraced
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
  if (attach_mode_ != AttachMode::UprobeMulti) {
    DetachStats ds = detach_stats();
    d.stats["uprobe_detach_us"] = ds.us;
    d.stats["uprobe_detach_sets"] = ds.sets;
  }
  if (pprof_dir_) pprof_dir_->add_stats(d.stats);
  return d;
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
          {"uprobes", attach_mode_ == AttachMode::UprobeMulti ? "uprobe_multi"
              : shared_uprobes_                       ? "perf_event_shared"
                                                      : "perf_event"},
          {"stacks", !o_.stacks ? "none" : o_.cfi ? "cfi" : "frame_pointers"},
          {"stack_walker", !o_.stacks ? "none" : !o_.cfi ? "frame_pointers" : cfi_chain_ ? "tail_calls" : "bpf_loop"},
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
    if (!p->exited && (p->comm.empty() || p->cgroup.empty())) identify(pid, p->comm.empty());
  report::Options ro;
  ro.top = o_.top;
  ro.at_exit = true;
  ro.include_idle = !system_wide_;
  ro.stats = o_.verbose;  // the tool's own counters: -v (JSON has them always)
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

}  // namespace memtrace::loader
