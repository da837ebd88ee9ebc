// Every process /proc lists now, from its stat line: pid, comm, state and
// parent. For tests that look for the tool's own helper processes (the
// guardian, the reaper) or check that none is left.
#pragma once

#include <dirent.h>
#include <sys/types.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace memtrace::testing {

struct ProcTask {
  pid_t pid;
  std::string comm;
  char state;
  pid_t ppid;
};

inline std::vector<ProcTask> proc_tasks() {
  std::vector<ProcTask> out;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    pid_t pid = atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string s;
    std::getline(f, s);
    // "PID (COMM) S PPID ...": COMM may hold spaces and parentheses.
    size_t l = s.find('('), r = s.rfind(')');
    if (l == std::string::npos || r == std::string::npos || r + 4 >= s.size()) continue;
    out.push_back({pid, s.substr(l + 1, r - l - 1), s[r + 2], static_cast<pid_t>(atoi(s.c_str() + r + 4))});
  }
  closedir(d);
  return out;
}

}  // namespace memtrace::testing
