#include "report/report.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <unordered_map>

namespace memtrace::report {
namespace {

bool active(const heap::Process& p) {
  return p.s.allocs || p.s.frees || p.s.in_use_blocks || p.s.failed_allocs || p.s.mmap_calls ||
         p.s.unknown_frees;
}

std::string hex(uint64_t v) {
  char b[32];
  snprintf(b, sizeof b, "0x%" PRIx64, v);
  return b;
}

std::vector<FrameOut> frames_of(const heap::HeapModel& m, const Resolver& r, pid_t pid,
                                uint64_t stack_id, bool* truncated) {
  std::vector<FrameOut> out;
  const heap::Stack* st = m.stack(stack_id);
  if (!st) return out;
  if (truncated) *truncated = st->truncated;
  for (size_t i = 0; i < st->ips.size(); i++) {
    // Every recorded ip is a return address (the caller's call site).
    auto fs = r(pid, st->ips[i], true);
    for (auto& f : fs) out.push_back(std::move(f));
  }
  return out;
}

std::string describe(const FrameOut& f) {
  std::string s = hex(f.address) + " ";
  if (!f.function.empty()) {
    s += f.function;
    if (!f.inlined && f.offset) s += "+" + hex(f.offset);
  } else {
    s += "??";
  }
  if (!f.file.empty()) s += " (" + f.file + ":" + std::to_string(f.line) + ")";
  if (f.inlined) s += " [inlined]";
  if (!f.module.empty()) s += " in " + f.module;
  if (!f.unknown.empty()) s += " <" + f.unknown + ">";
  return s;
}

}  // namespace

std::vector<LeakGroup> leak_groups(const heap::Process& p) {
  std::unordered_map<uint64_t, LeakGroup> g;
  for (const auto& [addr, b] : p.live) {
    auto& lg = g[b.stack_id];
    lg.stack_id = b.stack_id;
    lg.bytes += b.size;
    lg.blocks++;
  }
  std::vector<LeakGroup> v;
  v.reserve(g.size());
  for (auto& [k, lg] : g) v.push_back(lg);
  std::sort(v.begin(), v.end(), [](const LeakGroup& a, const LeakGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.stack_id < b.stack_id;
  });
  return v;
}

void write_summary_text(std::ostream& os, const heap::Process& p, bool at_exit) {
  const auto& s = p.s;
  char when[64];
  time_t now = time(nullptr);
  strftime(when, sizeof when, "%a %b %d %H:%M:%S %Y", localtime(&now));
  os << "HEAP SUMMARY " << when << " for pid " << p.pid << " (" << p.comm << ")";
  if (p.exited && p.exit_code) os << ", exit status " << (*p.exit_code >> 8);
  os << "\n\n";
  os << "    in use" << (at_exit ? " at exit" : "") << ": " << s.in_use_bytes << " bytes in "
     << s.in_use_blocks << " blocks\n";
  os << "    total heap usage: " << s.allocs << " allocs, " << s.frees << " frees, "
     << s.bytes_allocated << " bytes allocated\n";
  os << "    peak in use: " << s.peak_in_use_bytes << " bytes\n";
  os << "    failed allocations: " << s.failed_allocs << "\n";
  os << "    mmap: " << s.mmap_bytes_allocator << " bytes mapped by the allocator, "
     << s.mmap_bytes_direct << " bytes mapped directly (now mapped: " << s.mapped_now_allocator
     << " / " << s.mapped_now_direct << ")\n";
  if (s.brk_now > s.brk_start)
    os << "    brk heap: " << (s.brk_now - s.brk_start) << " bytes\n";
  if (s.inherited_blocks) os << "    inherited from parent at fork: " << s.inherited_blocks << " blocks\n";
  if (s.unknown_frees) os << "    frees of unknown blocks: " << s.unknown_frees << "\n";
  os << "\n";
}

void write_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                const Drops& d) {
  for (const auto& [pid, pp] : m.processes()) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    write_summary_text(os, p, o.at_exit);
    if (!o.leaks) continue;
    auto groups = leak_groups(p);
    size_t n = std::min(groups.size(), o.top);
    if (!groups.empty())
      os << "LEAKS (live blocks by allocation stack, largest first; " << n << " of "
         << groups.size() << ")\n\n";
    for (size_t i = 0; i < n; i++) {
      const auto& g = groups[i];
      os << g.bytes << " bytes in " << g.blocks << " blocks were not freed\n";
      bool trunc = false;
      auto fs = frames_of(m, r, pid, g.stack_id, &trunc);
      if (fs.empty()) os << "    (no stack)\n";
      for (const auto& f : fs) os << "    " << describe(f) << "\n";
      if (trunc) os << "    ... (stack truncated)\n";
      os << "\n";
    }
  }
  os << "DROPPED:";
  for (const auto& [k, v] : d.dropped) os << " " << k << "=" << v;
  os << "\n";
  if (!d.stats.empty()) {
    os << "STATS:";
    for (const auto& [k, v] : d.stats) os << " " << k << "=" << v;
    os << "\n";
  }
}

nlohmann::json to_json(const heap::HeapModel& m, const Resolver& r, const Options& o,
                       const Drops& d) {
  using nlohmann::json;
  json procs = json::array();
  for (const auto& [pid, pp] : m.processes()) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    const auto& s = p.s;
    json jp;
    jp["pid"] = p.pid;
    jp["ppid"] = p.ppid;
    jp["comm"] = p.comm;
    if (p.exited && p.exit_code) {
      int st = *p.exit_code;
      jp["exit_code"] = (st & 0x7f) ? 128 + (st & 0x7f) : (st >> 8) & 0xff;
    } else {
      jp["exit_code"] = nullptr;
    }
    jp["summary"] = {
        {"allocs", s.allocs},
        {"frees", s.frees},
        {"bytes_allocated", s.bytes_allocated},
        {"in_use_bytes", s.in_use_bytes},
        {"in_use_blocks", s.in_use_blocks},
        {"peak_in_use_bytes", s.peak_in_use_bytes},
        {"failed_allocs", s.failed_allocs},
        {"mmap_bytes_allocator", s.mmap_bytes_allocator},
        {"mmap_bytes_direct", s.mmap_bytes_direct},
        {"mapped_now_allocator", s.mapped_now_allocator},
        {"mapped_now_direct", s.mapped_now_direct},
        {"mmap_calls", s.mmap_calls},
        {"munmap_calls", s.munmap_calls},
        {"mremap_calls", s.mremap_calls},
        {"brk_calls", s.brk_calls},
        {"brk_heap_bytes", s.brk_now > s.brk_start ? s.brk_now - s.brk_start : 0},
        {"unknown_frees", s.unknown_frees},
        {"inherited_blocks", s.inherited_blocks},
    };
    json leaks = json::array();
    if (o.leaks) {
      auto groups = leak_groups(p);
      size_t n = std::min(groups.size(), o.top);
      for (size_t i = 0; i < n; i++) {
        const auto& g = groups[i];
        bool trunc = false;
        json stack = json::array();
        for (const auto& f : frames_of(m, r, pid, g.stack_id, &trunc)) {
          json jf = {{"address", hex(f.address)}, {"function", f.function}, {"module", f.module}};
          jf["offset"] = f.offset;
          if (!f.file.empty()) {
            jf["file"] = f.file;
            jf["line"] = f.line;
          }
          if (f.inlined) jf["inlined"] = true;
          if (!f.unknown.empty()) jf["unknown"] = f.unknown;
          stack.push_back(std::move(jf));
        }
        leaks.push_back({{"bytes", g.bytes}, {"blocks", g.blocks}, {"stack", stack},
                         {"stack_truncated", trunc}});
      }
      jp["leak_groups_total"] = groups.size();
    }
    jp["leaks"] = std::move(leaks);
    procs.push_back(std::move(jp));
  }
  json j;
  j["processes"] = std::move(procs);
  j["dropped"] = d.dropped;
  j["stats"] = d.stats;
  return j;
}

}  // namespace memtrace::report
