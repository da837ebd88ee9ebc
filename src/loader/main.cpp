// memtrace-bpf: where memory goes, from outside the process.
#include <limits.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "loader/tracer.h"

namespace {

// `memtrace-bpf track ...` is the byte-granular access capture of the
// companion helper: run memtrace-singlestep from our own directory.
int run_track(int argc, char** argv) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  std::string dir = ".";
  if (n > 0) {
    self[n] = 0;
    dir = std::string(self);
    dir = dir.substr(0, dir.rfind('/'));
  }
  std::string helper = dir + "/memtrace-singlestep";
  if (access(helper.c_str(), X_OK) != 0) {
    // Build tree layout: build/src/loader/memtrace-bpf, build/src/singlestep-helper/memtrace-singlestep
    std::string alt = dir + "/../singlestep-helper/memtrace-singlestep";
    if (access(alt.c_str(), X_OK) == 0) helper = alt;
  }
  std::vector<char*> args;
  args.push_back(const_cast<char*>(helper.c_str()));
  for (int i = 2; i < argc; i++) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(helper.c_str(), args.data());
  std::cerr << "memtrace-bpf: cannot run " << helper << ": " << strerror(errno) << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "track") return run_track(argc, argv);

  memtrace::loader::Options o;
  CLI::App app{
      "memtrace-bpf: trace malloc-family calls and mmap/munmap/mremap/brk with call stacks, "
      "from outside the process.\n\n"
      "  memtrace-bpf -- ./prog args     launch and trace a program\n"
      "  memtrace-bpf -p PID [-p PID]    attach to running processes\n"
      "  memtrace-bpf -c COMM [-c COMM]  processes by command name, also ones started later\n"
      "  memtrace-bpf                    system-wide, until Ctrl-C or --duration\n"
      "  memtrace-bpf track ...          byte-granular access capture (memtrace-singlestep)\n",
      "memtrace-bpf"};
  std::vector<int> pids;
  app.add_option("-p,--pid", pids, "Trace this process (repeatable); its children are followed");
  app.add_option("-c,--comm", o.comms, "Trace processes with this command name (repeatable)");
  app.add_option("--duration", o.duration, "Stop after SECONDS");
  app.add_option("--interval", o.interval, "Print heap summaries every SECONDS");
  app.add_option("-o,--output", o.output, "Write the report to FILE");
  app.add_option("--format", o.format, "Report format")->check(CLI::IsMember({"text", "json"}));
  app.add_option("--top", o.top, "Leak groups shown per process (default 10)");
  bool no_stacks = false;
  app.add_flag("--no-stacks", no_stacks, "Do not capture call stacks");
  app.add_option("--ringbuf-mb", o.ringbuf_mb, "Ring buffer size in MiB (default 64)");
  app.add_option("--symbols", o.symbol_dirs,
                 "Directory with debug files (matched by build-id), searched first (repeatable)");
  bool no_dwarf = false;
  app.add_flag("--no-dwarf", no_dwarf, "Symbolize with ELF symbols only (no file:line)");
  app.add_flag("--explain-probes", o.explain_probes,
               "Print where each allocator probe is placed and why");
  app.add_flag("-v,--verbose", o.verbose, "Log attach/exec/fork/exit");
  app.add_option("command", o.command, "Program and arguments to launch (after --)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.stacks = !no_stacks;
  o.dwarf = !no_dwarf;
  for (int p : pids) {
    if (p <= 0) {
      std::cerr << "memtrace-bpf: invalid pid " << p << "\n";
      return 2;
    }
    if (!memtrace::loader::process_exists(p)) {
      std::cerr << "memtrace-bpf: no such process: " << p << "\n";
      return 2;
    }
    auto tgid = memtrace::loader::tgid_of(p);
    o.pids.push_back(tgid ? *tgid : p);
  }
  for (const auto& c : o.comms) {
    if (c.empty() || c.size() > MT_COMM_LEN - 1) {
      std::cerr << "memtrace-bpf: command name '" << c << "' is longer than the "
                << MT_COMM_LEN - 1 << " characters the kernel keeps (see /proc/PID/comm)\n";
      return 2;
    }
  }
  if (!o.command.empty() && (!o.pids.empty() || !o.comms.empty())) {
    std::cerr << "memtrace-bpf: launch a program or use -p/-c, not both\n";
    return 2;
  }
  memtrace::loader::Tracer t(std::move(o));
  return t.run();
}
