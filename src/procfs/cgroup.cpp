#include "procfs/cgroup.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

namespace memtrace::procfs {

namespace {

uint32_t depth(const std::string& p);

}  // namespace

std::string cgroup2_mount() {
  std::ifstream f("/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
    auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream rest(line.substr(dash + 3));
    std::string fstype;
    rest >> fstype;
    if (fstype != "cgroup2") continue;
    std::istringstream head(line.substr(0, dash));
    std::string id, parent, dev, root, mnt;
    head >> id >> parent >> dev >> root >> mnt;
    return mnt;
  }
  return "";
}

namespace {

uint32_t depth(const std::string& p) {
  uint32_t n = 0;
  for (size_t i = 0; i < p.size(); i++)
    if (p[i] == '/' && i + 1 < p.size() && p[i + 1] != '/') n++;
  return n;
}

}  // namespace

Result<Cgroup> resolve_cgroup(const std::string& dir) {
  std::string mnt = cgroup2_mount();
  if (mnt.empty()) return Error::msg("--cgroup " + dir + ": no cgroup2 file system is mounted (cgroup v1 only)");
  std::string rel = dir;
  if (rel.compare(0, mnt.size(), mnt) == 0 && (rel.size() == mnt.size() || rel[mnt.size()] == '/'))
    rel = rel.substr(mnt.size());
  while (rel.size() > 1 && rel.back() == '/') rel.pop_back();
  if (rel.empty() || rel[0] != '/') rel = "/" + rel;
  std::string full = mnt + (rel == "/" ? "" : rel);
  struct stat st;
  if (stat(full.c_str(), &st) != 0) return Error::sys("--cgroup " + dir + ": " + full);
  if (!S_ISDIR(st.st_mode) || access((full + "/cgroup.procs").c_str(), F_OK) != 0)
    return Error::msg("--cgroup " + dir + ": " + full + " is not a cgroup v2 directory");
  return Cgroup{rel, static_cast<uint64_t>(st.st_ino), depth(rel)};
}

std::optional<std::string> cgroup_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cgroup");
  std::string line;
  while (std::getline(f, line))
    if (line.compare(0, 3, "0::") == 0) return line.substr(3);
  return std::nullopt;
}

bool cgroup_within(const std::string& path, const std::string& root) {
  if (root == "/") return !path.empty() && path[0] == '/';
  return path.compare(0, root.size(), root) == 0 && (path.size() == root.size() || path[root.size()] == '/');
}

Container container_of(const std::string& p) {
  Container c;
  static const std::regex runtimes[] = {
      std::regex(R"((docker)-([0-9a-f]{12,64})\.scope)"),            // systemd driver: docker
      std::regex(R"((cri-containerd)-([0-9a-f]{12,64})\.scope)"),    // containerd's CRI
      std::regex(R"((crio)-([0-9a-f]{12,64})\.scope)"),              // CRI-O
      std::regex(R"((libpod)-([0-9a-f]{12,64})\.scope)"),            // podman
      std::regex(R"(/(docker)/([0-9a-f]{12,64})(/|$))"),             // cgroupfs driver: docker
      std::regex(R"(/(kubepods)[^ ]*/pod[0-9a-f_-]+/([0-9a-f]{12,64})(/|$))"),  // cgroupfs kubelet
  };
  static const char* names[] = {"docker", "containerd", "cri-o", "podman", "docker", "containerd"};
  std::smatch m;
  for (size_t i = 0; i < sizeof runtimes / sizeof runtimes[0]; i++)
    if (std::regex_search(p, m, runtimes[i])) {
      c.id = m[2];
      c.runtime = names[i];
      break;
    }
  static const std::regex pod(R"(kubepods[^ ]*[-/]pod([0-9a-f]{8}[_-][0-9a-f]{4}[_-][0-9a-f]{4}[_-][0-9a-f]{4}[_-][0-9a-f]{12}))");
  if (std::regex_search(p, m, pod)) {
    c.pod = m[1];
    for (auto& ch : c.pod)
      if (ch == '_') ch = '-';
  }
  return c;
}

}  // namespace memtrace::procfs
