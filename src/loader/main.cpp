// memtrace-bpf: where memory goes, from outside the process.
#include <ucontext.h>
#include <limits.h>
#include <stdlib.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "loader/diff_command.h"
#include "loader/faults.h"
#include "loader/feature_cli.h"
#include "common/phase_log.h"
#include "loader/launcher.h"
#include "loader/tracer.h"
#include "symbolize/debuginfod.h"
#include "symbolize/symbolize.h"

namespace {

// `memtrace-bpf track ...` is the byte-granular access capture of the
// companion helper: run memtrace-singlestep from our own directory.
int run_track(int argc, char** argv) {
  std::string helper = memtrace::loader::singlestep_helper_path();
  std::vector<char*> args;
  args.push_back(const_cast<char*>(helper.c_str()));
  for (int i = 2; i < argc; i++) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(helper.c_str(), args.data());
  std::cerr << "memtrace-bpf: cannot run " << helper << ": " << strerror(errno) << "\n";
  return 2;
}

// A crash of the tool itself names where: the faulting pc and the return
// addresses of the frame-pointer chain on stderr (addr2line -e memtrace-bpf
// reads them), then the default action. The traced processes run on: the
// guardian resumes what the tool stopped.
void on_crash(int sig, siginfo_t*, void* ctx) {
  signal(sig, SIG_DFL);  // a fault in here ends the tool, as it would have
  const auto* mc = &static_cast<ucontext_t*>(ctx)->uc_mcontext;
#if defined(__aarch64__)
  uint64_t pc = mc->pc, lr = mc->regs[30], fp = mc->regs[29];
#else
  uint64_t pc = mc->gregs[REG_RIP], lr = 0, fp = mc->gregs[REG_RBP];
#endif
  char b[64 * 19 + 128];
  int n = snprintf(b, sizeof b, "memtrace-bpf: crashed (signal %d); addr2line -e memtrace-bpf -f -C:\n  %#lx %#lx", sig,
                   (unsigned long)pc, (unsigned long)lr);
  for (int i = 0; i < 48 && fp && !(fp & 7) && n < (int)sizeof b - 24; i++) {
    const uint64_t* f = reinterpret_cast<const uint64_t*>(fp);
    n += snprintf(b + n, sizeof b - n, " %#lx", (unsigned long)f[1]);
    if (f[0] <= fp) break;
    fp = f[0];
  }
  n += snprintf(b + n, sizeof b - n, "\n");
  ssize_t unused = write(2, b, n);
  (void)unused;
  raise(sig);
}

}  // namespace

int main(int argc, char** argv) {
  memtrace::phase("start");
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
    struct sigaction sa {};
    sa.sa_sigaction = on_crash;
    sa.sa_flags = SA_SIGINFO;
    sigaction(sig, &sa, nullptr);
  }
  if (argc > 1 && std::string(argv[1]) == "track") return run_track(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "replay") return memtrace::loader::run_replay(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "diff") return memtrace::loader::run_diff(argc - 1, argv + 1);

  memtrace::loader::Options o;
  CLI::App app{
      "memtrace-bpf: trace malloc-family calls and mmap/munmap/mremap/brk with call stacks, "
      "from outside the process.\n\n"
      "  memtrace-bpf -- ./prog args     launch and trace a program\n"
      "  memtrace-bpf -p PID [-p PID]    attach to running processes\n"
      "  memtrace-bpf -c COMM [-c COMM]  processes by command name, also ones started later\n"
      "  memtrace-bpf                    system-wide, until Ctrl-C or --duration\n"
      "  memtrace-bpf top [-p PID|-c COMM|--cgroup DIR]  the live view: processes and stacks, updating\n"
      "  memtrace-bpf track ...          byte-granular access capture (memtrace-singlestep)\n"
      "  memtrace-bpf replay FILE        the report of a --record FILE\n"
      "  memtrace-bpf diff A B           what grew and shrank from A to B (recordings or JSON reports)\n",
      "memtrace-bpf"};
  std::vector<int> pids;
  app.add_option("-p,--pid", pids, "Trace this process (repeatable); its children are followed");
  app.add_option("-c,--comm", o.comms, "Trace processes with this command name (repeatable)");
  std::string cgroup_dir;
  app.add_option("--cgroup", cgroup_dir,
                 "Trace the processes of this cgroup v2 subtree (a directory under the cgroup2 mount, or its path "
                 "from the cgroup root, as /proc/PID/cgroup says it), those started later too");
  app.add_option("--duration", o.duration, "Stop after SECONDS");
  app.add_option("--interval", o.interval, "Print heap summaries every SECONDS");
  std::vector<std::string> outputs;
  std::string format, folded_value = "live_bytes";
  memtrace::loader::add_output_options(app, outputs, format, folded_value);
  app.add_option("--top", o.top, "Leak groups shown per process (default 10)");
  std::string python_frames = "on";
  app.add_option("--python-frames", python_frames,
                 "Python frames in the stacks of processes that run CPython 3.11 (BPF path, x86-64): on (default; "
                 "each _PyEval_EvalFrameDefault frame replaced by the Python functions it ran, "
                 "'qualname (file.py:line)'), only (the Python frames alone), off")
      ->check(CLI::IsMember({"off", "on", "only"}));
  std::string python_domain = "on";
  app.add_option("--python-domain", python_domain,
                 "CPython 3.11's own allocator (pymalloc: every object of 512 bytes or less) traced as the python "
                 "domain beside malloc (BPF path, x86-64): on (default), off")
      ->check(CLI::IsMember({"off", "on"}));
  bool no_stacks = false;
  app.add_flag("--no-stacks", no_stacks, "Do not capture call stacks");
  std::string unwind = "cfi";
  app.add_option("--unwind", unwind,
                 "Stack unwinding: cfi (.eh_frame tables in BPF, complete stacks; default) or fp "
                 "(frame pointers only, cheaper)")
      ->check(CLI::IsMember({"cfi", "fp"}));
  app.add_option("-O,--object", o.allocator.object,
                 "Object that provides the allocator (path or file name, e.g. libjemalloc.so.2); "
                 "default: found in each process's mappings");
  std::string prefix;
  auto* prefix_opt = app.add_option("-S,--symbol-prefix", prefix,
                                    "Prefix of the allocator's symbols (e.g. je_ for je_malloc)");
  app.add_option("--ringbuf-mb", o.ringbuf_mb,
                 "Events ring buffer size in MiB (default 64 system-wide and with -c, 16 for a launched program "
                 "or -p; a power of two)");
  app.add_option("--unwind-mb", o.unwind_mb,
                 "Cap on the unwind tables in the kernel, MiB (default 512); files past it unwind by frame pointers")
      ->check(CLI::Range(size_t(1), size_t(1) << 20));
  app.add_option("--max-images", o.max_images,
                 "Ended processes (exec'd or exited images) reported one by one (default 256, 0: no limit); "
                 "past it, the oldest of the command name with the most are merged into one entry per command "
                 "name, which bounds the tool's memory on a host that starts many processes");
  app.add_option("--symbols", o.symbol_dirs,
                 "Directory with debug files (matched by build-id), searched first (repeatable)");
  bool no_dwarf = false;
  app.add_flag("--no-dwarf", no_dwarf, "Symbolize with ELF symbols only (no file:line)");
  bool no_debuginfod = false;
  app.add_flag("--no-debuginfod", no_debuginfod,
               "Do not download missing debug files from the servers in DEBUGINFOD_URLS");
  app.add_flag("--explain-probes", o.explain_probes,
               "Print where each allocator probe is placed and why");
  app.add_flag("-v,--verbose", o.verbose, "Log attach/exec/fork/exit; end the text report with STATS, the tool's own counters");
  app.add_flag("--inject", o.inject,
               "With -p: load memtrace's agent library into the process (ptrace, no restart) and take its malloc "
               "family from there instead of uprobes: in-process cost (docs/inject.md); its stacks walk the CFI "
               "tables in the process (MEMTRACE_INJECT_UNWIND=libunwind: libunwind's instead; =verify: both, "
               "compared on every stack)");
  auto* ring_mb = app.add_option("--inject-ring-mb", o.inject_ring_mb,
                                 "--inject: the agent's ring, MiB (a power of two; default 64, with --sample-bytes 4)");
  app.add_option("--sample-bytes", o.sample_bytes,
                 "Record one allocation per N bytes allocated on average (Poisson, per thread), weighted: every "
                 "figure an estimate (default 0: every call; 524288 for production). With --inject an unsampled "
                 "call costs nanoseconds; on the BPF path it still pays its uprobe trap, not its stack");
  bool check = false;
  app.add_flag("--check", check,
               "Print what this kernel supports and which fallbacks are used, load and attach everything "
               "once, exit non-zero if memtrace-bpf cannot run here");
  app.add_flag("--faults", o.faults,
               "Trace user page faults and charge them to the block or mapping they hit (RSS by allocation site)");
  app.add_flag("--trace-faults", o.trace_faults,
               "Print one line per page fault (implies --faults); JSON lines with --format json");
  app.add_option("--rearm", o.rearm_ms,
                 "Every MS milliseconds make the --range pages fault again on their next access "
                 "(implies --faults; one -p PID; runs memtrace-singlestep)");
  app.add_option("--range", o.ranges, "START-END, or the ADDR of a live block, re-armed by --rearm (repeatable)");
  memtrace::loader::add_feature_options(app, o.features);
  app.add_option("--metrics", o.metrics,
                 "Serve Prometheus metrics at http://ADDR:PORT/metrics while tracing (ADDR:PORT, [IPv6]:PORT "
                 "or :PORT for every address; port 0 picks a free one)");
  app.add_option("--metrics-max-processes", o.metrics_max_processes,
                 "Processes with series of their own in --metrics (default 200); the rest are summed into "
                 "pid=\"other\"");
  app.add_option("--pprof-dir", o.pprof_dir.dir,
                 "Write a pprof (COMM-PID-TIME.pb.gz) per traced process into DIR every --pprof-every seconds and "
                 "at the end, for Pyroscope or Parca (DIR is created if missing)");
  auto* pprof_every = app.add_option("--pprof-every", o.pprof_dir.every,
                                     "Seconds between two --pprof-dir files of a process (default 10)")
                          ->check(CLI::Range(0.1, 86400.0));
  auto* pprof_keep = app.add_option("--pprof-keep", o.pprof_dir.keep,
                                    "Rounds of --pprof-dir files kept (default 10: a process's 10 newest); older "
                                    "files this run wrote are removed")
                         ->check(CLI::Range(size_t(1), size_t(1000000)));
  app.add_option("command", o.command, "Program and arguments to launch (after --)");
  // `memtrace-bpf top ...`: the same options, with the live view.
  std::vector<char*> args(argv, argv + argc);
  bool top = argc > 1 && std::string(argv[1]) == "top";
  if (top) args.erase(args.begin() + 1);
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (top) o.features.live_view = true;
  // Sampled, the agent writes a record per sample: 4 MiB hold seconds of
  // them, and each injection maps (MAP_POPULATE) and the tool allocates a
  // sixteenth of the full trace's ring.
  if (o.sample_bytes && !ring_mb->count()) o.inject_ring_mb = 4;
  o.stacks = !no_stacks;
  o.python_frames = *memtrace::python::parse_mode(python_frames);
  o.python_domain = python_domain == "on";
  if (o.pprof_dir.dir.empty() && (pprof_every->count() || pprof_keep->count())) {
    std::cerr << "memtrace-bpf: --pprof-every and --pprof-keep are for --pprof-dir DIR\n";
    return 2;
  }
  // Before anything is traced: a bad -o costs nothing (report/outputs.h).
  if (auto bad = memtrace::loader::plan_output_options(outputs, format, folded_value, o.outputs, o.format,
                                                       o.folded_value);
      !bad.empty()) {
    std::cerr << "memtrace-bpf: " << bad << "\n";
    return 2;
  }
  if (no_debuginfod) {
    memtrace::symbolize::DebuginfodSettings off;
    off.enabled = false;
    memtrace::symbolize::Debuginfod::get().configure(off);
  }
  if (auto bad = memtrace::symbolize::check_symbol_dirs(o.symbol_dirs); !bad.empty()) {
    std::cerr << "memtrace-bpf: " << bad << "\n";
    return 2;
  }
  if (check) {
    if (geteuid() != 0) std::cerr << "memtrace-bpf: --check without root: BPF is only probed as this user\n";
    memtrace::loader::Tracer t(std::move(o));
    return t.check(std::cout);
  }
  if (auto bad = memtrace::loader::check_feature_options(o.features, !o.command.empty()); !bad.empty()) {
    std::cerr << "memtrace-bpf: " << bad << "\n";
    return 2;
  }
  if (o.trace_faults || o.rearm_ms > 0) o.faults = true;
#if defined(__aarch64__)
  // Not written for arm64 yet (docs/arm64.md): one line, exit 2.
  // --faults and --trace-faults work (a kprobe on handle_mm_fault), and so
  // does the single-step helper's page mode; but --rearm's faults are access
  // errors, which end in SIGSEGV before handle_mm_fault is called.
  if (o.rearm_ms > 0) {
    std::cerr << "memtrace-bpf: not supported on aarch64 yet: --rearm (the arm64 fault hook, a kprobe on "
                 "handle_mm_fault, does not see the access errors it makes)\n";
    return 2;
  }
#endif
  if (!o.ranges.empty() && o.rearm_ms <= 0) {
    std::cerr << "memtrace-bpf: --range is for --rearm MS\n";
    return 2;
  }
  if (o.rearm_ms > 0 && o.ranges.empty()) {
    std::cerr << "memtrace-bpf: --rearm needs --range START-END (or --range ADDR of a live block)\n";
    return 2;
  }
  if (o.rearm_ms > 0 && (pids.size() != 1 || !o.comms.empty() || !o.command.empty())) {
    std::cerr << "memtrace-bpf: --rearm works on one running process: give exactly one -p PID\n";
    return 2;
  }
  o.cfi = unwind == "cfi";
  if (prefix_opt->count()) o.allocator.prefix = prefix;
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
  if (!cgroup_dir.empty()) {
    auto cg = memtrace::procfs::resolve_cgroup(cgroup_dir);
    if (!cg) {
      std::cerr << "memtrace-bpf: " << cg.error().message << "\n";
      return 2;
    }
    o.cgroup = *cg;
  }
  if (o.inject && o.pids.empty() && o.comms.empty() && o.command.empty() && !o.cgroup) {
    std::cerr << "memtrace-bpf: --inject needs -p PID, -c COMM, --cgroup PATH or a program to launch (not system-wide)\n";
    return 2;
  }
  // --inject's unwinder (docs/inject.md): the CFI rows' walk unless told.
  if (const char* e = getenv("MEMTRACE_INJECT_UNWIND"); e && *e) {
    using IU = memtrace::loader::Options::InjectUnwind;
    std::string v = e;
    if (v == "cfi") o.inject_unwind = IU::Cfi;
    else if (v == "libunwind") o.inject_unwind = IU::Libunwind;
    else if (v == "verify") o.inject_unwind = IU::Verify;
    else {
      std::cerr << "memtrace-bpf: MEMTRACE_INJECT_UNWIND=" << v << ": not cfi, libunwind or verify\n";
      return 2;
    }
  }
  if (o.inject && (o.inject_ring_mb == 0 || (o.inject_ring_mb & (o.inject_ring_mb - 1)))) {
    std::cerr << "memtrace-bpf: --inject-ring-mb must be a power of two\n";
    return 2;
  }
  if (!o.command.empty() && (!o.pids.empty() || !o.comms.empty() || o.cgroup)) {
    std::cerr << "memtrace-bpf: launch a program or use -p/-c/--cgroup, not both\n";
    return 2;
  }
  // A program that cannot start: one line, exit 2, before anything is loaded.
  if (!o.command.empty())
    if (auto r = memtrace::loader::Launcher::check_executable(o.command[0]); !r) {
      std::cerr << "memtrace-bpf: " << r.error().message << "\n";
      return 2;
    }
  auto* t = new memtrace::loader::Tracer(std::move(o));
  int rc = t->run();
  if (t->quick_exit_ok()) {
    memtrace::phase("exit");
    std::cout.flush();
    std::cerr.flush();
    _exit(rc);
  }
  delete t;
  memtrace::phase("exit: the tool's memory freed");
  return rc;
}
