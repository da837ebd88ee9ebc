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
  app.add_flag("--live-view", f.live_view,
               "The live view in the terminal (as `memtrace-bpf top`): processes by bytes in use, growth or "
               "allocation rate, a process's stacks; keys u g a d j k Enter b q; with -p, -c, --cgroup or "
               "system-wide");
  app.add_flag("--trace", f.trace,
               "Print one line per allocator/mmap event (time comm pid tid event address size old_address "
               "caller) to the report output; JSON lines with --format json");
  app.add_flag("--live", f.live, "List every live block (address, size, age, stack) in the final report");
  app.add_option("--live-max", f.live_max, "Live blocks listed per process (default 1000)");
  app.add_option("--dump-bytes", f.dump_bytes,
                 "Show the first N bytes of each live block (read from the process while it lives); implies --live");
  app.add_option("--record", f.record, "Write every ring-buffer record and the mappings to FILE, for `replay`");
}

void add_output_options(CLI::App& app, std::vector<std::string>& outputs, std::string& format,
                        std::string& folded_value) {
  app.add_option("-o,--output", outputs,
                 "Write the report to FILE (repeatable); its format follows --format, else its extension: "
                 ".txt, .json, .folded (folded stacks), .pb.gz (pprof), .html (flame graphs, memory over time)")
      ->allow_extra_args(false);  // one FILE per -o: `-o a.txt -- prog args` leaves prog's to it
  app.add_option("--format", format, "Report format: text (default), json, folded, pprof or html (for every -o FILE)")
      ->check(CLI::IsMember({"text", "json", "folded", "pprof", "html"}));
  app.add_option("--folded-value", folded_value,
                 "Value of each folded stack: live_bytes (at the end; default), alloc_bytes, alloc_count, "
                 "live_blocks")
      ->check(CLI::IsMember({"live_bytes", "alloc_bytes", "alloc_count", "live_blocks"}));
}

std::string plan_output_options(const std::vector<std::string>& outputs, const std::string& format,
                                const std::string& folded_value, std::vector<report::OutputSpec>& specs,
                                std::string& primary_format, report::FoldedValue& value) {
  auto plan = report::plan_outputs(outputs, format);
  if (!plan) return plan.error().message;
  specs = std::move(*plan);
  const report::OutputSpec* primary = report::primary_output(specs);
  primary_format = primary && primary->format == report::Format::Json ? "json" : "text";
  value = report::folded_value_named(folded_value).value_or(report::FoldedValue::LiveBytes);
  return "";
}

int run_replay(int argc, char** argv) {
  ReplayOptions o;
  CLI::App app{"memtrace-bpf replay: the report of a --record file, symbolized against the files on disk "
               "(matched by build-id)",
               "memtrace-bpf replay"};
  app.add_option("file", o.file, "Recording (from --record FILE)")->required();
  std::vector<std::string> outputs;
  std::string format, folded_value = "live_bytes";
  add_output_options(app, outputs, format, folded_value);
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
  app.add_flag("-v,--verbose", o.verbose, "End the text report with STATS, the tool's own counters");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.dwarf = !no_dwarf;
  if (auto bad = plan_output_options(outputs, format, folded_value, o.outputs, o.format, o.folded_value);
      !bad.empty()) {
    std::cerr << "memtrace-bpf: replay: " << bad << "\n";
    return 2;
  }
  if (no_debuginfod) {
    symbolize::DebuginfodSettings off;
    off.enabled = false;
    symbolize::Debuginfod::get().configure(off);
  }
  if (auto bad = symbolize::check_symbol_dirs(o.symbol_dirs); !bad.empty()) {
    std::cerr << "memtrace-bpf: replay: " << bad << "\n";
    return 2;
  }
  return replay(o);
}

}  // namespace memtrace::loader
