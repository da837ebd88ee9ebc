#include "loader/diff_command.h"

#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "loader/features.h"
#include "loader/output_file.h"
#include "loader/recording.h"
#include "report/diff.h"
#include "report/html.h"
#include "report/outputs.h"
#include "symbolize/debuginfod.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {
namespace {

struct Loaded {
  report::DiffSide side;
  int code = 0;  // 1: a recording cut short; 2: unusable (said on stderr)
};

// A recording (by its magic) or a JSON report: the last JSON document of
// the file (an -o file of --trace --format json holds trace lines first).
Loaded load(const std::string& path, const ReplayOptions& ro, report::DiffMatch match) {
  Loaded l;
  std::ifstream in;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) errno = EISDIR;
  else in.open(path, std::ios::binary);
  if (!in.is_open()) {
    std::cerr << "memtrace-bpf: diff: cannot open " << path << ": " << strerror(errno) << "\n";
    l.code = 2;
    return l;
  }
  char magic[sizeof kRecMagic] = {};
  in.read(magic, sizeof magic);
  in.clear();
  in.seekg(0);
  if (memcmp(magic, kRecMagic, sizeof magic) == 0) {
    ReplayOptions o = ro;
    o.file = path;
    l.code = replay_model(in, o, std::cerr, true, [&](const Replayed& r) {
      l.side = report::diff_side(r.model, r.resolve, match, path);
      l.side.notes = r.notes;
      if (!r.file.error.empty()) {
        std::cerr << "memtrace-bpf: diff: " << path << ": " << r.file.error << "; compared the " << r.file.records
                  << " records before it\n";
        return 1;
      }
      return 0;
    });
    return l;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded())
    if (size_t at = text.rfind("\n{\n"); at != std::string::npos)
      j = nlohmann::json::parse(text.substr(at + 1), nullptr, false);
  if (j.is_discarded()) {
    std::cerr << "memtrace-bpf: diff: " << path << ": neither a memtrace-bpf recording nor a JSON report\n";
    l.code = 2;
    return l;
  }
  auto side = report::diff_side(j, match, path);
  if (!side) {
    std::cerr << "memtrace-bpf: diff: " << side.error().message << "\n";
    l.code = 2;
    return l;
  }
  l.side = std::move(*side);
  return l;
}

}  // namespace

int run_diff(int argc, char** argv) {
  std::string a, b, output, format, by = "line";
  size_t top = 10;
  ReplayOptions ro;
  CLI::App app{"memtrace-bpf diff: what grew and what shrank from A to B, by allocation stack. A and B are "
               "recordings (--record FILE) or JSON reports (-o x.json); stacks are matched by their symbolized "
               "frames, processes by command name",
               "memtrace-bpf diff"};
  app.add_option("a", a, "The earlier recording or JSON report")->required();
  app.add_option("b", b, "The later one")->required();
  app.add_option("-o,--output", output,
                 "Write the diff to FILE (default stdout); .json: JSON, .html: one offline page with a "
                 "differential flame graph");
  app.add_option("--format", format, "text (default), json or html")->check(CLI::IsMember({"text", "json", "html"}));
  app.add_option("--top", top, "Stacks shown per section and program (default 10)");
  app.add_option("--by", by,
                 "Match frames by function, file and line (line, default) or by function only (function: "
                 "across a rebuild that moved lines)")
      ->check(CLI::IsMember({"line", "function"}));
  app.add_option("--symbols", ro.symbol_dirs,
                 "Directory with the recorded binaries or their debug files (matched by build-id) (repeatable)");
  bool no_dwarf = false, no_debuginfod = false;
  app.add_flag("--no-dwarf", no_dwarf, "Symbolize with ELF symbols only (no file:line)");
  app.add_flag("--no-debuginfod", no_debuginfod, "Do not download missing binaries and debug files");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  ro.dwarf = !no_dwarf;
  if (no_debuginfod) {
    symbolize::DebuginfodSettings off;
    off.enabled = false;
    symbolize::Debuginfod::get().configure(off);
  }
  if (auto bad = symbolize::check_symbol_dirs(ro.symbol_dirs); !bad.empty()) {
    std::cerr << "memtrace-bpf: diff: " << bad << "\n";
    return 2;
  }
  // Else by -o's extension: .json, .html; any other, text.
  if (auto f = report::format_of_extension(output); format.empty() && f)
    if (*f == report::Format::Json || *f == report::Format::Html) format = report::to_string(*f);
  auto match = by == "function" ? report::DiffMatch::Function : report::DiffMatch::Line;
  // The output file first: one that cannot be written costs nothing.
  std::unique_ptr<std::ofstream> file;
  if (!output.empty()) {
    auto f = open_output(output, Privacy::Shared);
    if (!f) {
      std::cerr << "memtrace-bpf: diff: " << f.error().message << "\n";
      return 2;
    }
    file = std::move(*f);
  }
  Loaded la = load(a, ro, match);
  if (la.code == 2) return 2;
  Loaded lb = load(b, ro, match);
  if (lb.code == 2) return 2;
  // The page's flame graph draws every stack, its tables the first --top.
  report::Diff d = report::diff_sides(la.side, lb.side, match, top, format == "html");
  std::ostream& os = file ? *file : std::cout;
  if (format == "json") os << report::json_text(report::diff_json(d), 2) << "\n";
  else if (format == "html") (void)report::write_diff_html(os, d, {});  // a failed write: said below
  else report::write_diff_text(os, d);
  os.flush();
  if (!os) {
    std::cerr << "memtrace-bpf: diff: cannot write " << (output.empty() ? "stdout" : output) << "\n";
    return 2;
  }
  return std::max(la.code, lb.code);
}

}  // namespace memtrace::loader
