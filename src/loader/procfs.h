// /proc and tracefs helpers for the loader.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"

namespace memtrace::loader {

struct MapEntry {
  uint64_t start = 0, end = 0, offset = 0;
  std::string perms;
  uint32_t dev_major = 0, dev_minor = 0;
  uint64_t inode = 0;
  std::string path;
  bool exec() const { return perms.size() > 2 && perms[2] == 'x'; }
  bool file() const { return inode != 0 && !path.empty() && path[0] == '/'; }
};

Result<std::vector<MapEntry>> read_maps(pid_t pid);
std::optional<std::string> read_comm(pid_t pid);
std::optional<pid_t> tgid_of(pid_t tid);  // from /proc/TID/status
std::optional<pid_t> ppid_of(pid_t pid);
std::vector<pid_t> all_pids();
bool process_exists(pid_t pid);
char process_state(pid_t pid);  // 'R', 'S', 'T', ... or 0

// A path through which this process can open the file of mapping m of pid:
// /proc/PID/root/PATH when that is the same inode (containers), else
// /proc/PID/map_files/START-END (deleted or replaced files).
std::string openable_path(pid_t pid, const MapEntry& m);

// libbpf needs tracefs for tracepoint ids; a fresh machine does not mount it.
Result<void> ensure_tracefs();

}  // namespace memtrace::loader
