// JIT code named by perf maps: /tmp/perf-PID.map, one line per piece of
// generated code, "START SIZE name" (START and SIZE in hex, 0x optional; the
// name is the rest of the line, spaces included). Written by node
// --perf-basic-prof, the JVM (jcmd PID Compiler.perfmap,
// -XX:+DumpPerfMapAtExit), .NET (DOTNET_PerfMapEnabled=1), LuaJIT; appended
// to while the process runs. No I/O in PerfMap: PerfMapFile reads a file as
// it grows.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "common/fd.h"

namespace memtrace::symbolize {

struct PerfMapEntry {
  uint64_t start = 0, size = 0;
  std::string name;
};

class PerfMap {
 public:
  // Text that follows what was fed before (a file's new bytes): complete
  // lines are parsed, a last line without its newline waits for the rest.
  // A line that is not "START SIZE name" is counted (bad_lines), not fatal.
  void feed(std::string_view text);
  // The end of the file: a last line without a newline is a line too.
  void finish();
  // The entry whose [start, start + size) holds addr; where code was made
  // again over old code, the line written last.
  const PerfMapEntry* find(uint64_t addr) const;
  size_t size() const { return by_start_.size(); }
  uint64_t bad_lines() const { return bad_; }
  uint64_t lines() const { return lines_; }
  void clear();

 private:
  void line(std::string_view l);
  std::string partial_;
  std::map<uint64_t, PerfMapEntry> by_start_;
  uint64_t bad_ = 0, lines_ = 0;
};

// A perf map file read as it grows: refresh() reads what was appended since
// the last read (from the start again if the file shrank: a new one). The
// file is kept open once found, so that it stays readable where its path
// does not (a container's process that exited: /proc/PID/root is gone).
class PerfMapFile {
 public:
  PerfMapFile() = default;
  explicit PerfMapFile(std::string path) : path_(std::move(path)) {}
  // Opens the file if not yet, reads its new bytes. true when the map changed.
  bool refresh();
  // Another path to open it by when not open yet (the first that opens wins).
  void also(std::string path) {
    if (!fd_.valid()) path_ = std::move(path);
  }
  const PerfMap& map() const { return map_; }
  const std::string& path() const { return path_; }
  bool found() const { return fd_.valid(); }
  // Every byte read so far (what a recording keeps).
  const std::string& text() const { return text_; }

 private:
  std::string path_;
  Fd fd_;
  uint64_t read_ = 0;
  PerfMap map_;
  std::string text_;
};

}  // namespace memtrace::symbolize
