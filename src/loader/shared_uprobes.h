// Perf-event uprobes shared by every traced process (kernels without
// uprobe_multi links: before 6.6).
//
// The uprobe PMU makes a new trace event for each perf event, and the
// kernel closes each across RCU grace periods under its event_mutex
// (perf_trace_event_unreg -> tracepoint_synchronize_unregister: ~90 ms here):
// 17 probes of a process cost it ~1.9 s of kernel time to detach, in turn
// with every other close and attach. A tracefs uprobe event
// (uprobe_events) is one trace event per (file, offset) that any number of
// perf events can open: the grace period is paid only when its last one
// closes. So each (file, offset, entry or return) gets one event, created at
// its first use and named memtrace_<tool pid>/pN or rN; one perf event of it
// targeted at kthreadd (no mm: it admits no hit) carries the BPF program (with its cookie:
// the BPF program array is the event's, so it runs for every process the
// event's filter admits) and maps no probed file; and each traced process
// gets a perf event of its own without a program, which only puts its mm in
// the event's filter (breakpoints installed in it, removed at its close: no
// grace period, ~0.1 ms). The carriers close at the end (one grace period
// each, once per run, in the background), then the events are removed.
//
// Measured (this VM, kernel 6.18, MEMTRACE_UPROBE_ATTACH=perf): closing a
// process's perf events 88 ms each with the PMU, ~0 with a shared event.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/result.h"
#include "loader/attach.h"

struct bpf_program;

namespace memtrace::loader::shared_uprobes {

// tracefs's uprobe_events can be written (mounted by ensure_tracefs) and
// MEMTRACE_UPROBE_ATTACH is not perf-pmu (the PMU per process, for A/B).
// Removes, once, the events of earlier runs whose tool is gone.
bool available();

// The perf event that puts pid in the filter of the shared event at
// (dev, inode, offset) of the file at path (entry or return probe), the
// event and its carrier made at first use with prog and cookie (a BPF link
// with cookie, or PERF_EVENT_IOC_SET_BPF without). Link.perf_fd only.
Result<Link> open_for(pid_t pid, const std::string& path, uint64_t dev, uint64_t inode, uint64_t offset, bool ret,
                      bpf_program* prog, uint64_t cookie, bool with_cookie);

// The carriers, to be closed after every process's perf events (no attach
// may follow): the caller closes them (the last references: a grace period
// each) and then calls remove_events.
std::vector<Link> take_carriers();
// "-:memtrace_N/pK" lines of every event made, for remove_events: built
// before a fork whose child may only make system calls.
std::vector<std::string> removal_lines();
// Writes them to uprobe_events (system calls only); an event still open
// somewhere stays (EBUSY) for whoever closes it last.
void remove_events(const std::vector<std::string>& lines);
// Every event of the group of tool `owner` (the guardian, after the tool).
void remove_group(pid_t owner);

}  // namespace memtrace::loader::shared_uprobes
