// What a shell command prints on stdout (tests and benches compare with
// readelf, nm, addr2line, gdb ...). "" if it could not be started.
#pragma once
#include <cstdio>
#include <string>

namespace memtrace::testing {

inline std::string shell_output(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

}  // namespace memtrace::testing
