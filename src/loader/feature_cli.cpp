#include "loader/feature_cli.h"

#include <CLI/CLI.hpp>
#include <iostream>

#include "symbolize/debuginfod.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {

void add_feature_options(CLI::App& app, FeatureOptions& f) {
  app.add_flag("--console", f.console,
               "Read commands from stdin (status, report, monitor N, clear, live, help, quit); "
               "with -p, -c or system-wide");
  app.add_flag("--trace", f.trace,
               "Print one line per allocator/mmap event (time comm pid tid event address size old_address "
               "caller) to the report output; JSON lines with --format json");
  app.add_flag("--live", f.live, "List every live block (address, size, age, stack) in the final report");
  app.add_option("--live-max", f.live_max, "Live blocks listed per process (default 1000)");
  app.add_option("--dump-bytes", f.dump_bytes,
                 "Show the first N bytes of each live block (read from the process while it lives); implies --live");
  app.add_option("--record", f.record, "Write every ring-buffer record and the mappings to FILE, for `replay`");
}

int run_replay(int argc, char** argv) {
  ReplayOptions o;
  CLI::App app{"memtrace-bpf replay: the report of a --record file, symbolized against the files on disk "
               "(matched by build-id)",
               "memtrace-bpf replay"};
  app.add_option("file", o.file, "Recording (from --record FILE)")->required();
  app.add_option("--format", o.format, "Report format")->check(CLI::IsMember({"text", "json"}));
  app.add_option("-o,--output", o.output, "Write the report to FILE");
  app.add_option("--top", o.top, "Leak groups shown per process (default 10)");
  app.add_flag("--live", o.live, "List every live block at the end of the recording");
  app.add_option("--live-max", o.live_max, "Live blocks listed per process (default 1000)");
  app.add_option("--symbols", o.symbol_dirs,
                 "Directory with the recorded binaries or their debug files (matched by build-id), searched "
                 "first (repeatable)");
  bool no_dwarf = false;
  app.add_flag("--no-dwarf", no_dwarf, "Symbolize with ELF symbols only (no file:line)");
  bool no_debuginfod = false;
  app.add_flag("--no-debuginfod", no_debuginfod,
               "Do not download missing binaries and debug files from the servers in DEBUGINFOD_URLS");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.dwarf = !no_dwarf;
  if (no_debuginfod) symbolize::Debuginfod::get().configure({.enabled = false});
  if (auto bad = symbolize::check_symbol_dirs(o.symbol_dirs); !bad.empty()) {
    std::cerr << "memtrace-bpf: replay: " << bad << "\n";
    return 2;
  }
  return replay(o);
}

}  // namespace memtrace::loader
