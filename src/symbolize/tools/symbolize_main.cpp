// memtrace-symbolize: the library from the command line, addr2line-style.
//   memtrace-symbolize -e FILE [ADDR...]   addresses are ELF vaddrs of FILE
//   memtrace-symbolize -p PID  [ADDR...]   addresses are runtime addresses of PID
// Options: -r (return addresses: look up ADDR-1), --symbols DIR (repeatable),
// --debug-root DIR, --no-dwarf, -a (print each address first), -t (timing), -q (no output: count only; for benchmarks).
// --passes N: symbolize the list N times (pass 2+ measure warm lookups).
// Without ADDR arguments, addresses are read from stdin, one per line.
// Output per address, innermost first, one "function\nfile:line" pair per frame
// (the format of `addr2line -f -i -C`).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "symbolize/symbolize.h"

using namespace memtrace::symbolize;

int main(int argc, char** argv) {
  Options opts;
  std::string file;
  pid_t pid = 0;
  bool ra = false, quiet = false, timing = false, show_addr = false;
  int passes = 1;
  std::vector<uint64_t> addrs;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs an argument\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-e") file = next();
    else if (a == "-p") pid = std::atoi(next().c_str());
    else if (a == "-r") ra = true;
    else if (a == "-q") quiet = true;
    else if (a == "-a") show_addr = true;
    else if (a == "-t") timing = true;
    else if (a == "--passes") passes = std::max(1, std::atoi(next().c_str()));
    else if (a == "--symbols") opts.symbol_dirs.push_back(next());
    else if (a == "--debug-root") opts.debug_root = next();
    else if (a == "--no-dwarf") opts.dwarf = false;
    else addrs.push_back(std::strtoull(a.c_str(), nullptr, 16));
  }
  if (file.empty() == (pid == 0)) {
    std::fprintf(stderr, "usage: %s (-e FILE | -p PID) [-r] [-q] [-t] [--symbols DIR] [ADDR...]\n", argv[0]);
    return 2;
  }
  auto t0 = std::chrono::steady_clock::now();
  Symbolizer sym(opts);
  AddressSpace as;
  auto r = file.empty() ? sym.update(as, pid) : sym.add_file(as, file);
  if (!r) {
    std::fprintf(stderr, "%s\n", r.error().message.c_str());
    return 1;
  }
  if (addrs.empty()) {
    std::string line;
    while (std::getline(std::cin, line))
      if (!line.empty()) addrs.push_back(std::strtoull(line.c_str(), nullptr, 16));
  }
  double open_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string out;
  for (int pass = 0; pass < passes; ++pass) {
    auto p0 = std::chrono::steady_clock::now();
    for (uint64_t addr : addrs) {
      const Symbolized& s = sym.symbolize(as, addr, ra);
      if (quiet || pass > 0) continue;
      if (show_addr) {
        char b[32];
        std::snprintf(b, sizeof b, "0x%016llx\n", static_cast<unsigned long long>(addr));
        out += b;
      }
      if (s.unknown != Unknown::None) {
        out += "??\n??:0\n";
      } else {
        for (const auto& f : s.frames) {
          out += f.function.empty() ? "??" : f.function;
          out += '\n';
          out += f.file.empty() ? "??" : f.file;
          out += ':' + std::to_string(f.line) + '\n';
        }
      }
      if (out.size() > (1 << 16)) {
        std::fwrite(out.data(), 1, out.size(), stdout);
        out.clear();
      }
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    out.clear();
    std::fflush(stdout);
    if (timing) {
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
      if (pass == 0) s += open_s;  // the first pass pays for opening and parsing
      std::fprintf(stderr, "pass %d: %zu addresses in %.4f s (%.0f/s)\n", pass + 1, addrs.size(), s,
                   addrs.size() / s);
    }
  }
  return 0;
}
