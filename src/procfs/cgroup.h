// src/procfs: cgroup v2 (issue 34's --cgroup and container ids), read in
// this one place.
//
//   resolve_cgroup("/sys/fs/cgroup/system.slice/x.service")  the subtree to
//       trace: its id (the directory's inode: cgroup v2's id, what BPF's
//       bpf_get_current_ancestor_cgroup_id returns) and level (0: the root)
//   cgroup_of(pid)         "/system.slice/x.service" (/proc/PID/cgroup's "0::" line)
//   container_of(path)     the container id and Kubernetes pod uid a
//                          runtime's cgroup name carries (docker, containerd
//                          and CRI-O, podman, kubepods)
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/result.h"

namespace memtrace::procfs {

// The cgroup2 mount point ("/sys/fs/cgroup" on a unified host,
// "/sys/fs/cgroup/unified" on a hybrid one); "" : none.
std::string cgroup2_mount();

struct Cgroup {
  std::string path;  // from the cgroup2 root: "/" or "/a/b"
  uint64_t id = 0;
  uint32_t level = 0;
};
// A directory in the cgroup2 file system (its mount found in
// /proc/self/mountinfo), or a cgroup path under that mount ("/a/b").
Result<Cgroup> resolve_cgroup(const std::string& dir);
std::optional<std::string> cgroup_of(pid_t pid);
// path under (or equal to) root, both from the cgroup2 root
bool cgroup_within(const std::string& path, const std::string& root);

struct Container {
  std::string id;       // 64 hex digits (or 12+ as the runtime wrote them); "" : none
  std::string runtime;  // "docker", "containerd", "cri-o", "podman"; "" : none
  std::string pod;      // Kubernetes pod uid, "" : none
};
Container container_of(const std::string& cgroup_path);

}  // namespace memtrace::procfs
