// /proc and tracefs helpers for the loader.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"

namespace memtrace::loader {

using MapEntry = procfs::Mapping;  // src/procfs: the one parser of /proc/PID/maps
using procfs::read_maps;
std::optional<std::string> read_comm(pid_t pid);
std::optional<pid_t> tgid_of(pid_t tid);  // from /proc/TID/status
std::optional<pid_t> ppid_of(pid_t pid);
// pid as its own pid namespace numbers it (the last of /proc/PID/status's
// NSpid: a container's process), pid itself outside one.
std::optional<pid_t> ns_pid_of(pid_t pid);
// When pid started (clock ticks since boot, /proc/PID/stat): with the pid,
// one process (a pid used again is another start).
std::optional<uint64_t> start_time(pid_t pid);
// The NUL-separated strings of /proc/PID/FILE ("environ", "cmdline"): what
// pid was started with; none when it is gone.
std::vector<std::string> proc_strings(pid_t pid, const char* file);
std::vector<pid_t> all_pids();
bool process_exists(pid_t pid);
char process_state(pid_t pid);  // 'R', 'S', 'T', ... or 0

using procfs::openable_path;  // (src/procfs/proc_maps.h)

// libbpf needs tracefs for tracepoint ids; a fresh machine does not mount it.
Result<void> ensure_tracefs();

}  // namespace memtrace::loader
