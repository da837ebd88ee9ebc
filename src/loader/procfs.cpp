#include "loader/procfs.h"

#include <dirent.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace memtrace::loader {

static std::string slurp(const std::string& fn) {
  std::ifstream in(fn);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<std::string> read_comm(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
  std::string s;
  if (!std::getline(in, s)) return std::nullopt;
  return s;
}

static std::optional<pid_t> status_field(pid_t pid, const char* key) {
  std::string s = slurp("/proc/" + std::to_string(pid) + "/status");
  auto at = s.find(std::string("\n") + key + ":");
  if (at == std::string::npos) return std::nullopt;
  return static_cast<pid_t>(strtol(s.c_str() + at + strlen(key) + 2, nullptr, 10));
}

std::optional<pid_t> tgid_of(pid_t tid) { return status_field(tid, "Tgid"); }
std::optional<pid_t> ppid_of(pid_t pid) { return status_field(pid, "PPid"); }

std::optional<pid_t> ns_pid_of(pid_t pid) {
  std::string s = slurp("/proc/" + std::to_string(pid) + "/status");
  auto at = s.find("\nNSpid:");
  if (at == std::string::npos) return std::nullopt;
  auto end = s.find('\n', at + 1);
  std::istringstream in(s.substr(at + 7, end == std::string::npos ? std::string::npos : end - at - 7));
  long v = 0, last = -1;
  while (in >> v) last = v;
  if (last <= 0) return std::nullopt;
  return static_cast<pid_t>(last);
}

std::vector<std::string> proc_strings(pid_t pid, const char* file) {
  std::string s = slurp("/proc/" + std::to_string(pid) + "/" + file);
  std::vector<std::string> out;
  for (size_t at = 0; at < s.size();) {
    size_t end = s.find('\0', at);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> v;
  DIR* d = opendir("/proc");
  if (!d) return v;
  while (dirent* e = readdir(d)) {
    char* end;
    long p = strtol(e->d_name, &end, 10);
    if (*end == 0 && p > 0) v.push_back(static_cast<pid_t>(p));
  }
  closedir(d);
  return v;
}

bool process_exists(pid_t pid) {
  return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM) &&
         access(("/proc/" + std::to_string(pid)).c_str(), F_OK) == 0;
}

char process_state(pid_t pid) {
  std::string s = slurp("/proc/" + std::to_string(pid) + "/stat");
  auto rp = s.rfind(')');
  if (rp == std::string::npos || rp + 2 >= s.size()) return 0;
  return s[rp + 2];
}

std::optional<uint64_t> start_time(pid_t pid) {
  std::string s = slurp("/proc/" + std::to_string(pid) + "/stat");
  auto rp = s.rfind(')');
  if (rp == std::string::npos) return std::nullopt;
  // Fields after the command: state is the 3rd, starttime the 22nd.
  size_t at = rp + 2;
  for (int field = 3; field < 22; field++) {
    at = s.find(' ', at);
    if (at == std::string::npos) return std::nullopt;
    at++;
  }
  char* end = nullptr;
  uint64_t t = strtoull(s.c_str() + at, &end, 10);
  if (end == s.c_str() + at) return std::nullopt;
  return t;
}

Result<void> ensure_tracefs() {
  if (access("/sys/kernel/tracing/events", F_OK) == 0) return {};
  if (access("/sys/kernel/debug/tracing/events", F_OK) == 0) return {};
  if (mount("nodev", "/sys/kernel/tracing", "tracefs", 0, nullptr) != 0)
    return Error::sys("mount tracefs on /sys/kernel/tracing");
  return {};
}

}  // namespace memtrace::loader
