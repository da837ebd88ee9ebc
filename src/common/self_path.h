// Files installed next to this program (the single-step helper, the
// debuginfod helper, the --inject agent): found from /proc/self/exe, so the
// build tree and /usr/bin work alike.
#pragma once
#include <unistd.h>

#include <climits>
#include <string>

namespace memtrace {

// This program's directory, with a trailing '/' ("./" if /proc says nothing).
inline std::string self_dir() {
  char self[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "./";
  std::string p(self, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/') + 1);
}

}  // namespace memtrace
