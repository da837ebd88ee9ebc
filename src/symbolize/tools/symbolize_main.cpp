// memtrace-symbolize: the library from the command line, addr2line-style.
//   memtrace-symbolize -e FILE [ADDR...]   addresses are ELF vaddrs of FILE
//   memtrace-symbolize -p PID  [ADDR...]   addresses are runtime addresses of PID
// Options: -r (return addresses: look up ADDR-1), --symbols DIR (repeatable),
// --debug-root DIR, --no-dwarf, -a (print each address first), -t (timing), -q (no output: count only; for benchmarks).
// Without ADDR arguments, addresses are read from stdin, one per line.
// Output per address, innermost first, one "function\nfile:line" pair per frame
// (the format of `addr2line -f -i -C`).
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
  bool from_stdin = addrs.empty();
  std::string line;
  std::string out;
  size_t n = 0;
  for (size_t i = 0;; ++i) {
    uint64_t addr;
    if (from_stdin) {
      if (!std::getline(std::cin, line)) break;
      if (line.empty()) continue;
      addr = std::strtoull(line.c_str(), nullptr, 16);
    } else {
      if (i >= addrs.size()) break;
      addr = addrs[i];
    }
    ++n;
    const Symbolized& s = sym.symbolize(as, addr, ra);
    if (quiet) continue;
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
  if (timing) {
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "%zu addresses in %.3f s (%.0f/s)\n", n, s, n / s);
  }
  return 0;
}
