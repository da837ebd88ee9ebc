// memtrace-singlestep: byte-granular access capture of chosen regions of
// another process (ptrace + page protection + capstone, or hardware
// watchpoints). memtrace-bpf's `track` subcommand execs this binary with the
// same arguments.
#include <sched.h>
#include <signal.h>
#include <sys/time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "tracer.h"

using namespace memtrace::singlestep;

namespace {

double g_duration = 0;
timespec g_start;

void on_stop_signal(int sig) { g_stop_signal = sig; }
void on_tick(int) {
  if (g_duration <= 0) return;
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  double el = static_cast<double>(now.tv_sec - g_start.tv_sec) + (now.tv_nsec - g_start.tv_nsec) / 1e9;
  if (el >= g_duration) g_deadline_passed = true;
}

void install_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;  // no SA_RESTART: waitpid returns EINTR
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  sa.sa_handler = on_tick;
  sigaction(SIGALRM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A 50 ms tick bounds the time a stop request waits for the next ptrace event,
  // and drains hardware-watchpoint samples.
  itimerval it{{0, 50000}, {0, 50000}};
  setitimer(ITIMER_REAL, &it, nullptr);
}

uint64_t parse_u64(const std::string& s, const char* what) {
  try {
    size_t pos = 0;
    unsigned long long v = std::stoull(s, &pos, 0);
    if (pos != s.size()) throw std::invalid_argument(s);
    return v;
  } catch (...) {
    std::fprintf(stderr, "memtrace-singlestep: invalid %s: %s\n", what, s.c_str());
    std::exit(2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"memtrace-singlestep: byte-granular access capture of memory regions of another process"};
  Options o;
  std::vector<std::string> addrs, lens;
  std::string out_path, format = "text";
  app.add_option("-p,--pid", o.pid, "process to attach to");
  app.add_option("--addr", addrs, "region start (repeatable, paired with --len)");
  app.add_option("--len", lens, "region length in bytes (repeatable)");
  app.add_option("--symbol", o.symbols, "global variable to track (repeatable)");
  app.add_option("--max", o.max, "stop after N accesses");
  app.add_option("--duration", o.duration, "stop after S seconds");
  app.add_option("-o,--output", out_path, "write the report to FILE (default stdout)");
  app.add_option("--format", format, "text or json")->check(CLI::IsMember({"text", "json"}));
  app.add_option("--mode", o.mode, "auto (hardware watchpoints when the regions fit), step or hw")
      ->check(CLI::IsMember({"auto", "step", "hw"}));
  app.add_flag("!--no-emulate", o.emulate, "single-step every access (no emulation of plain moves)");
  int cpu = -1;
  app.add_option("--cpu", cpu,
                 "pin the helper (and, with -- PROGRAM, the program) to this CPU: ptrace round trips "
                 "are 3-4x cheaper on one CPU in a VM");
  app.add_option("--ready-fd", o.ready_fd, "write one byte to this fd once tracking is armed");
  app.add_option("--track-allocs-from", o.track_allocs_from,
                 "track every block returned by malloc/calloc/realloc to FUNCTION until freed");
  app.add_option("--rearm", o.rearm_ms,
                 "page mode: every MS milliseconds make the regions inaccessible again; the first access "
                 "to each page per interval faults once (seen by memtrace-bpf --faults), then runs");
  app.add_option("--track-alloc-size", o.track_alloc_size, "with --track-allocs-from: only blocks of this size");
  app.footer("  -- PROGRAM ARGS    start PROGRAM under the helper and track it (exit status is PROGRAM's)");
  // Everything after "--" is the program to launch, options included.
  int split = argc;
  for (int i = 1; i < argc; i++)
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  for (int i = split + 1; i < argc; i++) o.command.push_back(argv[i]);
  if (split < argc && o.command.empty()) {
    std::fprintf(stderr, "memtrace-singlestep: nothing to launch after --\n");
    return 2;
  }
  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const std::string& m) {
    std::fprintf(stderr, "memtrace-singlestep: %s\n", m.c_str());
    return 2;
  };
  if ((o.pid != 0) == !o.command.empty()) return fail("give exactly one of -p PID or -- PROGRAM ARGS");
  if (o.pid < 0) return fail("invalid pid");
  if (addrs.size() != lens.size()) return fail("every --addr needs a --len");
  for (size_t i = 0; i < addrs.size(); i++)
    o.ranges.push_back({parse_u64(addrs[i], "--addr"), parse_u64(lens[i], "--len")});
  if (o.ranges.empty() && o.symbols.empty() && o.track_allocs_from.empty())
    return fail("no region: give --addr ADDR --len LEN, --symbol NAME or --track-allocs-from FUNCTION");

  std::ofstream file;
  if (!out_path.empty()) {
    file.open(out_path);
    if (!file) return fail("cannot open " + out_path + " for writing");
  }
  if (o.rearm_ms > 0 && !o.track_allocs_from.empty()) return fail("--rearm and --track-allocs-from do not mix");
  if (o.rearm_ms < 0) return fail("--rearm needs a positive interval");
  g_duration = o.duration;
  clock_gettime(CLOCK_MONOTONIC, &g_start);
  install_handlers();
  if (o.rearm_ms > 0 && o.rearm_ms < 50) {
    // The tick wakes the event loop: make it as fine as the interval.
    long us = static_cast<long>(o.rearm_ms * 1000);
    if (us < 100) us = 100;
    itimerval it{{us / 1000000, us % 1000000}, {us / 1000000, us % 1000000}};
    setitimer(ITIMER_REAL, &it, nullptr);
  }

  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) return fail("cannot pin to CPU " + std::to_string(cpu));
  }
  Tracer tracer(o);
  if (auto r = tracer.start(); !r) {
    if (tracer.launched()) tracer.wait_child_exit();
    return fail(r.error().message);
  }
  tracer.run();
  int code = tracer.wait_child_exit();
  itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  std::ostream& out = out_path.empty() ? std::cout : file;
  if (format == "json") tracer.report().write_json(out);
  else tracer.report().write_text(out);
  out.flush();
  return tracer.launched() ? code : 0;
}
