#include "report/folded.h"

#include <cinttypes>
#include <cstdio>
#include <map>

namespace memtrace::report {

std::string folded_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case ';': o += "%3B"; break;
      case '\n': o += "%0A"; break;
      case '\r': o += "%0D"; break;
      case '%': o += "%25"; break;
      default: o += c;
    }
  }
  return o;
}

namespace {

std::string frame_name(const FrameOut& f) {
  char b[64];
  if (!f.function.empty()) return folded_escape(f.function);
  if (!f.module.empty()) {
    snprintf(b, sizeof b, "+0x%" PRIx64 "]", f.module_offset);
    return "[" + folded_escape(f.module.substr(f.module.rfind('/') + 1)) + b;
  }
  snprintf(b, sizeof b, "[0x%" PRIx64 "]", f.address);
  return b;
}

uint64_t value_of(const StackCounts& c, FoldedValue v) {
  switch (v) {
    case FoldedValue::LiveBytes: return c.live_bytes;
    case FoldedValue::AllocBytes: return c.alloc_bytes;
    case FoldedValue::AllocCount: return c.alloc_count;
    case FoldedValue::LiveBlocks: return c.live_blocks;
  }
  return 0;
}

}  // namespace

void write_folded(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                  FoldedValue value) {
  for (const heap::Process* pp : m.images()) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    std::string root = folded_escape(p.comm.empty() ? "?" : p.comm) + " (" + std::to_string(p.pid) + ")";
    if (p.image) root += " image " + std::to_string(p.image);
    // Two stacks can name the same frames (two call sites on one line):
    // one line per distinct text, values summed.
    std::map<std::string, uint64_t> lines;
    for (const auto& c : stack_counts(p)) {
      uint64_t v = value_of(c, value);
      if (!v) continue;
      std::string line = root;
      if (!c.stack_id) {
        line += ";[no stack]";
      } else {
        bool trunc = false;
        auto fs = frames_of(m, r, p, c.stack_id, &trunc);
        if (trunc) line += ";[truncated]";
        for (auto it = fs.rbegin(); it != fs.rend(); ++it) line += ";" + frame_name(*it);
        if (fs.empty()) line += ";[no stack]";
      }
      lines[line] += v;
    }
    for (const auto& [line, v] : lines) os << line << " " << v << "\n";
  }
}

}  // namespace memtrace::report
