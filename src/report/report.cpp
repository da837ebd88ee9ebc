#include "common/hex.h"
#include "procfs/cgroup.h"
#include "report/report.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <unordered_map>

namespace memtrace::report {
namespace {

std::string describe(const FrameOut& f) {
  // A Python frame's address is its tagged id (heap::kPyFrameTag | id):
  // nothing a reader can look up, so it is left out.
  std::string s = f.address & heap::kPyFrameTag ? std::string() : hex(f.address) + " ";
  if (!f.function.empty()) {
    s += f.function;
    if (!f.inlined && f.offset) s += "+" + hex(f.offset);
  } else {
    s += "??";
    // Where it is, so that it can be symbolized later: "?? (git+0x6a3f2)".
    if (!f.module.empty()) s += " (" + f.module.substr(f.module.rfind('/') + 1) + "+" + hex(f.module_offset) + ")";
  }
  if (!f.file.empty()) s += " (" + f.file + ":" + std::to_string(f.line) + ")";
  if (f.inlined) s += " [inlined]";
  if (!f.module.empty()) s += " in " + f.module;
  if (!f.unknown.empty()) s += " <" + f.unknown + ">";
  return s;
}

void write_frames_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                       uint64_t stack_id, const char* indent) {
  bool trunc = false;
  auto fs = frames_of(m, r, p, stack_id, &trunc);
  if (size_t shown = text_frames(fs); shown < fs.size()) {  // up to main (report.h)
    fs.resize(shown);
    trunc = false;
  }
  if (fs.empty()) os << indent << "(no stack)\n";
  for (const auto& f : fs) os << indent << describe(f) << "\n";
  if (trunc) os << indent << "... (stack truncated)\n";
}

}  // namespace

std::vector<FrameOut> frames_of(const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                                uint64_t stack_id, bool* truncated) {
  std::vector<FrameOut> out;
  const heap::Stack* st = m.stack(stack_id);
  if (!st) return out;
  if (truncated) *truncated = st->truncated;
  std::vector<std::vector<FrameOut>> each;
  for_each_frame(p, *st, [&](uint64_t addr, const heap::Loc* loc) { each.push_back(r(p, addr, loc, true)); });
  size_t keep = trusted_addresses(each);
  if (keep < each.size() && truncated) *truncated = true;
  for (size_t i = 0; i < keep; i++)
    for (auto& f : each[i]) out.push_back(std::move(f));
  return out;
}

size_t trusted_addresses(const std::vector<std::vector<FrameOut>>& resolved) {
  return heap::trusted_frames(resolved.size(), [&](size_t i) {
    if (resolved[i].empty() || !resolved[i].front().untrusted) return heap::FrameTrust::Good;
    return resolved[i].front().unknown == "unmapped" ? heap::FrameTrust::Unmapped : heap::FrameTrust::Bad;
  });
}

nlohmann::json frames_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, uint64_t stack_id,
                           bool* trunc) {
  using nlohmann::json;
  json stack = json::array();
  for (const auto& f : frames_of(m, r, p, stack_id, trunc)) {
    json jf = {{"address", hex(f.address)}, {"function", f.function}, {"module", f.module}};
    jf["offset"] = f.offset;
    if (!f.file.empty()) {
      jf["file"] = f.file;
      jf["line"] = f.line;
      if (f.column) jf["column"] = f.column;
    }
    if (f.inlined) jf["inlined"] = true;
    if (!f.unknown.empty()) jf["unknown"] = f.unknown;
    if (f.function.empty() && !f.module.empty()) jf["module_offset"] = hex(f.module_offset);
    stack.push_back(std::move(jf));
  }
  return stack;
}

std::vector<FaultSite> fault_sites(const heap::Process& p) {
  std::vector<FaultSite> v;
  for (const auto& [id, sf] : p.fault_stacks) {
    FaultSite s{id, sf, {}};
    if (auto it = p.alloc_sites.find(id); it != p.alloc_sites.end()) s.allocs = it->second;
    v.push_back(s);
  }
  std::sort(v.begin(), v.end(), [](const FaultSite& a, const FaultSite& b) {
    if (a.faults.pages != b.faults.pages) return a.faults.pages > b.faults.pages;
    if (a.faults.faults != b.faults.faults) return a.faults.faults > b.faults.faults;
    return a.stack_id < b.stack_id;
  });
  return v;
}

std::vector<FaultSite> alloc_sites_by_bytes(const heap::Process& p) {
  std::vector<FaultSite> v;
  for (const auto& [id, as] : p.alloc_sites) {
    FaultSite s{id, {}, as};
    if (auto it = p.fault_stacks.find(id); it != p.fault_stacks.end()) s.faults = it->second;
    v.push_back(s);
  }
  std::sort(v.begin(), v.end(), [](const FaultSite& a, const FaultSite& b) {
    return a.allocs.bytes != b.allocs.bytes ? a.allocs.bytes > b.allocs.bytes : a.stack_id < b.stack_id;
  });
  return v;
}

std::vector<std::pair<std::string, heap::SiteFaults>> fault_regions(const heap::Process& p) {
  std::vector<std::pair<std::string, heap::SiteFaults>> v(p.fault_regions.begin(), p.fault_regions.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    if (a.second.pages != b.second.pages) return a.second.pages > b.second.pages;
    if (a.second.faults != b.second.faults) return a.second.faults > b.second.faults;
    return a.first < b.first;
  });
  return v;
}

void write_faults_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                       size_t top) {
  const auto& f = p.f;
  os << "PAGE FAULTS: " << f.total << " (read " << f.read << ", write " << f.write << ", instruction "
     << f.instr << "), " << f.pages_first_touched << " pages first touched, " << f.access_errors
     << " answered with SIGSEGV (--rearm pages or crashes)\n\n";
  auto sites = fault_sites(p);
  size_t n = std::min(sites.size(), top);
  if (!sites.empty())
    os << "RSS BY ALLOCATION SITE (pages first touched, by allocation stack; " << n << " of " << sites.size()
       << ")\n\n";
  for (size_t i = 0; i < n; i++) {
    const auto& s = sites[i];
    os << s.faults.pages << " pages touched in " << s.faults.faults << " faults (" << s.faults.reads << " read, "
       << s.faults.writes << " write) by " << (s.faults.kind == heap::Hit::Mmap ? "mmap" : "blocks")
       << " from this stack; " << s.allocs.bytes << " bytes allocated in " << s.allocs.blocks << " blocks\n";
    write_frames_text(os, m, r, p, s.stack_id, "    ");
    os << "\n";
  }
  auto by_bytes = alloc_sites_by_bytes(p);
  n = std::min(by_bytes.size(), top);
  if (!by_bytes.empty())
    os << "ALLOCATION SITES BY BYTES, WITH PAGES TOUCHED (" << n << " of " << by_bytes.size() << ")\n\n";
  for (size_t i = 0; i < n; i++) {
    const auto& s = by_bytes[i];
    os << s.allocs.bytes << " bytes in " << s.allocs.blocks << " blocks, " << s.allocs.touched_blocks
       << " touched, " << s.faults.pages << " pages touched"
       << (s.faults.faults == 0 ? " (never touched)" : "") << "\n";
    write_frames_text(os, m, r, p, s.stack_id, "    ");
    os << "\n";
  }
  auto regions = fault_regions(p);
  if (!regions.empty()) os << "FAULTS BY MAPPING (outside live blocks)\n";
  for (const auto& [label, sf] : regions)
    os << "    " << sf.pages << " pages touched in " << sf.faults << " faults (" << sf.reads << " read, "
       << sf.writes << " write): " << label << "\n";
  if (!regions.empty()) os << "\n";
}

nlohmann::json faults_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, size_t top) {
  using nlohmann::json;
  const auto& f = p.f;
  json j = {{"total", f.total},
            {"read", f.read},
            {"write", f.write},
            {"instruction", f.instr},
            {"pages_first_touched", f.pages_first_touched},
            {"access_errors", f.access_errors}};
  json by_stack = json::array();
  auto sites = fault_sites(p);
  for (size_t i = 0; i < std::min(sites.size(), top); i++) {
    const auto& s = sites[i];
    bool trunc = false;
    json st = frames_json(m, r, p, s.stack_id, &trunc);
    by_stack.push_back({{"pages", s.faults.pages},
                        {"faults", s.faults.faults},
                        {"reads", s.faults.reads},
                        {"writes", s.faults.writes},
                        {"kind", heap::to_string(s.faults.kind)},
                        {"bytes_allocated", s.allocs.bytes},
                        {"blocks", s.allocs.blocks},
                        {"stack", std::move(st)},
                        {"stack_truncated", trunc}});
  }
  j["by_stack"] = std::move(by_stack);
  j["by_stack_total"] = sites.size();
  json by_bytes = json::array();
  auto bb = alloc_sites_by_bytes(p);
  for (size_t i = 0; i < std::min(bb.size(), top); i++) {
    const auto& s = bb[i];
    bool trunc = false;
    json st = frames_json(m, r, p, s.stack_id, &trunc);
    by_bytes.push_back({{"bytes", s.allocs.bytes},
                        {"blocks", s.allocs.blocks},
                        {"touched_blocks", s.allocs.touched_blocks},
                        {"pages", s.faults.pages},
                        {"faults", s.faults.faults},
                        {"stack", std::move(st)},
                        {"stack_truncated", trunc}});
  }
  j["by_bytes"] = std::move(by_bytes);
  json by_mapping = json::array();
  for (const auto& [label, sf] : fault_regions(p))
    by_mapping.push_back({{"region", label},
                          {"pages", sf.pages},
                          {"faults", sf.faults},
                          {"reads", sf.reads},
                          {"writes", sf.writes}});
  j["by_mapping"] = std::move(by_mapping);
  return j;
}

std::vector<LeakGroup> leak_groups(const heap::Process& p) {
  std::unordered_map<uint64_t, LeakGroup> g;
  if (p.sealed) {  // its blocks are counted by stack (and may be gone)
    for (const auto& [id, sa] : p.stack_allocs)
      if (sa.live_blocks) g[id] = LeakGroup{sa.live_bytes, sa.live_blocks, id, sa.untouched_blocks};
  } else {
    for (const auto& [addr, b] : p.live) {
      auto& lg = g[b.stack_id];
      lg.stack_id = b.stack_id;
      lg.bytes += b.size;
      lg.blocks++;
      if (!b.touched) lg.untouched_blocks++;
      if (b.py) lg.python_blocks++;
    }
  }
  std::vector<LeakGroup> v;
  v.reserve(g.size());
  for (auto& [k, lg] : g) v.push_back(lg);
  std::sort(v.begin(), v.end(), [](const LeakGroup& a, const LeakGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.stack_id < b.stack_id;
  });
  return v;
}

// ---------------------------------------------------------------- analyses

namespace {

std::string seconds(double s) {
  char b[32];
  snprintf(b, sizeof b, "%.3f s", s);
  return b;
}

std::string rate(double v) {
  char b[32];
  snprintf(b, sizeof b, v >= 100 ? "%.0f" : "%.1f", v);
  return b;
}

double since_first(const heap::Process& p, uint64_t ts) { return ts > p.first_ts ? (ts - p.first_ts) / 1e9 : 0; }

std::string base_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

// Lifetimes of freed blocks in four ranges: [0, 2^10), [2^10, 2^20),
// [2^20, 2^30) ns and longer (about 1 us, 1 ms, 1 s).
std::array<uint64_t, 4> lifetime_ranges(const heap::Lifetimes& l) {
  std::array<uint64_t, 4> r{};
  for (size_t i = 0; i < l.freed.size(); i++) r[std::min<size_t>(i / 10, 3)] += l.freed[i];
  return r;
}

}  // namespace

std::vector<std::pair<uint64_t, const heap::StackAllocs*>> stacks_by(const heap::Process& p,
                                                                      uint64_t heap::StackAllocs::*field) {
  std::vector<std::pair<uint64_t, const heap::StackAllocs*>> v;
  for (const auto& [id, sa] : p.stack_allocs)
    if (sa.*field) v.emplace_back(id, &sa);
  std::sort(v.begin(), v.end(), [field](const auto& a, const auto& b) {
    return a.second->*field != b.second->*field ? a.second->*field > b.second->*field : a.first < b.first;
  });
  return v;
}

double traced_seconds(const heap::Process& p) { return p.last_ts > p.first_ts ? (p.last_ts - p.first_ts) / 1e9 : 0; }

double per_second(const heap::Process& p, uint64_t n) {
  double t = traced_seconds(p);
  return t > 0 ? n / t : 0;
}

size_t text_frames(const std::vector<FrameOut>& fs) {
  for (size_t i = 0; i < fs.size(); i++)
    if (fs[i].function == "main" && !fs[i].inlined) return i + 1;
  return fs.size();
}

std::string stack_line(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, uint64_t stack_id,
                       size_t max_frames) {
  bool trunc = false;
  auto fs = frames_of(m, r, p, stack_id, &trunc);
  if (fs.empty()) return "(no stack)";
  size_t shown = text_frames(fs);
  if (shown < fs.size()) trunc = false;  // ends at main: below it is not cut, only not shown
  fs.resize(shown);
  std::string s;
  for (size_t i = 0; i < fs.size() && i < max_frames; i++) {
    const auto& f = fs[i];
    if (i) s += " < ";
    if (!f.function.empty()) s += f.function;
    else if (!f.module.empty()) s += "?? (" + base_name(f.module) + "+" + hex(f.module_offset) + ")";
    else s += hex(f.address);
    if (!f.file.empty()) s += " (" + base_name(f.file) + ":" + std::to_string(f.line) + ")";
  }
  if (fs.size() > max_frames || trunc) s += " < ...";
  return s;
}

void write_analysis_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const heap::Process& p,
                         size_t top) {
  const auto& s = p.s;
  auto peak = stacks_by(p, &heap::StackAllocs::peak_bytes);
  size_t n = std::min(peak.size(), top);
  if (n) {
    os << "PEAK: " << s.peak_in_use_bytes << " bytes at " << seconds(since_first(p, s.peak_ts))
       << "; live then, by stack (" << n << " of " << peak.size() << ")\n";
    for (size_t i = 0; i < n; i++)
      os << "    " << peak[i].second->peak_bytes << " bytes in " << peak[i].second->peak_blocks << " blocks: "
         << stack_line(m, r, p, peak[i].first) << "\n";
    os << "\n";
  }
  auto temp = stacks_by(p, &heap::StackAllocs::temporary);
  n = std::min(temp.size(), top);
  if (n) {
    os << "MOST TEMPORARY ALLOCATIONS (freed before their thread's next allocator call; " << n << " of "
       << temp.size() << ")\n";
    for (size_t i = 0; i < n; i++) {
      const auto& sa = *temp[i].second;
      char pct[16];
      snprintf(pct, sizeof pct, "%.1f%%", 100.0 * sa.temporary / (sa.allocs ? sa.allocs : 1));
      os << "    " << sa.temporary << " of " << sa.allocs << " allocations (" << pct << "): "
         << stack_line(m, r, p, temp[i].first) << "\n";
    }
    os << "\n";
  }
  auto churn = stacks_by(p, &heap::StackAllocs::allocs);
  n = std::min(churn.size(), top);
  if (n) {
    os << "MOST ALLOCATIONS (churn over " << seconds(traced_seconds(p)) << " traced; " << n << " of " << churn.size()
       << ")\n";
    for (size_t i = 0; i < n; i++) {
      const auto& sa = *churn[i].second;
      os << "    " << sa.allocs << " allocations (" << rate(per_second(p, sa.allocs)) << "/s), " << sa.bytes
         << " bytes: " << stack_line(m, r, p, churn[i].first) << "\n";
    }
    os << "\n";
  }
}

nlohmann::json analysis_json(const heap::HeapModel& m, const Resolver& r, const heap::Process& p, size_t top) {
  using nlohmann::json;
  const auto& s = p.s;
  std::vector<uint64_t> listed;  // stacks shown: their spans follow
  auto stack_entry = [&](uint64_t id, json j) {
    bool trunc = false;
    j["stack_id"] = hex(id);
    j["stack"] = frames_json(m, r, p, id, &trunc);
    j["stack_truncated"] = trunc;
    listed.push_back(id);
    return j;
  };
  json a;
  a["first_ts_ns"] = p.first_ts;
  a["last_ts_ns"] = p.last_ts;
  a["traced_s"] = traced_seconds(p);
  a["allocs_per_s"] = per_second(p, s.allocs);
  a["temporary_allocs"] = s.temporary_allocs;
  a["temporary_per_s"] = per_second(p, s.temporary_allocs);

  auto peak = stacks_by(p, &heap::StackAllocs::peak_bytes);
  json ps = json::array();
  for (size_t i = 0; i < std::min(peak.size(), top); i++)
    ps.push_back(stack_entry(peak[i].first, {{"bytes", peak[i].second->peak_bytes}, {"blocks", peak[i].second->peak_blocks}}));
  a["peak"] = {{"bytes", s.peak_in_use_bytes}, {"ts_ns", s.peak_ts}, {"at_s", since_first(p, s.peak_ts)},
               {"stacks_total", peak.size()}, {"stacks", std::move(ps)}};

  auto temp = stacks_by(p, &heap::StackAllocs::temporary);
  json ts = json::array();
  for (size_t i = 0; i < std::min(temp.size(), top); i++) {
    const auto& sa = *temp[i].second;
    ts.push_back(stack_entry(temp[i].first, {{"temporary", sa.temporary}, {"allocs", sa.allocs},
                                             {"temporary_per_s", per_second(p, sa.temporary)}}));
  }
  a["temporary"] = {{"stacks_total", temp.size()}, {"stacks", std::move(ts)}};

  auto churn = stacks_by(p, &heap::StackAllocs::allocs);
  json cs = json::array();
  for (size_t i = 0; i < std::min(churn.size(), top); i++) {
    const auto& sa = *churn[i].second;
    cs.push_back(stack_entry(churn[i].first, {{"allocs", sa.allocs}, {"allocs_per_s", per_second(p, sa.allocs)},
                                              {"bytes", sa.bytes}, {"temporary", sa.temporary}}));
  }
  a["churn"] = {{"stacks_total", churn.size()}, {"stacks", std::move(cs)}};

  a["lifetimes"] = {{"freed", p.lifetimes.freed}, {"freed_bytes", p.lifetimes.freed_bytes},
                    {"live_at_end", p.lifetimes.live_at_end}};

  json pts = json::array();
  for (const auto& pt : p.timeline) pts.push_back({pt.ts, pt.in_use_bytes, pt.mapped_bytes, pt.touched_pages});
  a["timeline"] = {{"step_ns", p.timeline_step_ns}, {"points", std::move(pts)}};

  // The leak groups' stacks too (the same top).
  auto groups = leak_groups(p);
  for (size_t i = 0; i < std::min(groups.size(), top); i++) listed.push_back(groups[i].stack_id);
  std::sort(listed.begin(), listed.end());
  listed.erase(std::unique(listed.begin(), listed.end()), listed.end());
  json by_stack = json::object();
  for (uint64_t id : listed) {
    auto it = p.spans.find(id);
    if (it == p.spans.end()) continue;
    json v = json::array();
    for (const auto& sp : it->second) v.push_back({sp.alloc_bucket, sp.free_bucket, sp.bytes, sp.count});
    by_stack[hex(id)] = std::move(v);
  }
  a["spans"] = {{"t0_ns", p.span_t0}, {"bucket_ns", p.span_bucket_ns}, {"live_bucket", heap::kSpanLive},
                {"by_stack", std::move(by_stack)}};
  return a;
}

void write_summary_text(std::ostream& os, const heap::Process& p, bool at_exit) {
  const auto& s = p.s;
  char when[64];
  time_t now = time(nullptr);
  strftime(when, sizeof when, "%a %b %d %H:%M:%S %Y", localtime(&now));
  if (p.merged) {
    os << "HEAP SUMMARY " << when << " for " << p.merged << " ended processes of " << p.comm << ", merged (pids";
    for (pid_t m : p.merged_pids) os << " " << m;
    os << (p.merged > p.merged_pids.size() ? " ...)" : ")") << "\n\n";
    os << "    in use at their ends: " << s.in_use_bytes << " bytes in " << s.in_use_blocks << " blocks\n";
  } else {
    os << "HEAP SUMMARY " << when << " for pid " << p.pid << " (" << p.comm << ")";
    if (p.image || p.ended_by_exec) os << ", image " << p.image;
    if (p.ended_by_exec) os << ", until it exec'd";
    else if (p.exited && p.exit_code) os << ", exit status " << (*p.exit_code >> 8);
    os << "\n\n";
    os << "    in use" << (p.ended_by_exec ? " at exec" : at_exit ? " at exit" : "") << ": " << s.in_use_bytes
       << " bytes in " << s.in_use_blocks << " blocks\n";
  }
  if (procfs::Container c = procfs::container_of(p.cgroup); !c.id.empty() || !c.pod.empty()) {
    os << "    container: " << (c.runtime.empty() ? "" : c.runtime + " ") << c.id.substr(0, 12);
    if (!c.pod.empty()) os << (c.id.empty() ? "" : ", ") << "pod " << c.pod;
    os << ", cgroup " << p.cgroup << "\n";
  }
  os << "    total heap usage: " << s.allocs << " allocs, " << s.frees << " frees, "
     << s.bytes_allocated << " bytes allocated\n";
  if (const heap::DomainSummary& py = s.python; py.allocs || py.frees || py.unknown_frees || py.in_use_blocks) {
    // Two allocator domains (issue 32): malloc's and CPython's pymalloc.
    os << "    by domain: malloc " << s.allocs - py.allocs << " allocs, " << s.frees - py.frees << " frees, "
       << s.bytes_allocated - py.bytes_allocated << " bytes allocated, in use " << s.in_use_bytes - py.in_use_bytes
       << " bytes in " << s.in_use_blocks - py.in_use_blocks << " blocks\n";
    os << "               python " << py.allocs << " allocs, " << py.frees << " frees, " << py.bytes_allocated
       << " bytes allocated, in use " << py.in_use_bytes << " bytes in " << py.in_use_blocks << " blocks, peak "
       << py.peak_in_use_bytes << " bytes";
    if (py.unknown_frees) os << ", " << py.unknown_frees << " frees of blocks not seen allocated";
    os << "\n";
  }
  os << "    peak in use: " << s.peak_in_use_bytes << " bytes" << (p.merged ? " (the largest member's)" : "");
  if (s.peak_ts && p.first_ts && !p.merged)
    os << " at " << seconds(since_first(p, s.peak_ts)) << " (of " << seconds(traced_seconds(p)) << " traced)";
  os << "\n";
  if (s.allocs) {
    char pct[16];
    snprintf(pct, sizeof pct, "%.1f%%", 100.0 * s.temporary_allocs / s.allocs);
    os << "    temporary allocations: " << s.temporary_allocs << " (" << pct << " of allocs), "
       << rate(per_second(p, s.temporary_allocs)) << "/s; all allocations: " << rate(per_second(p, s.allocs))
       << "/s\n";
  }
  if (s.frees || s.in_use_blocks) {
    auto lr = lifetime_ranges(p.lifetimes);
    os << "    lifetimes: " << lr[0] << " blocks freed within 1 us, " << lr[1] << " within 1 ms, " << lr[2]
       << " within 1 s, " << lr[3] << " later; " << p.lifetimes.live_at_end << " live\n";
  }
  os << "    failed allocations: " << s.failed_allocs << "\n";
  os << "    mmap: " << s.mmap_bytes_allocator << " bytes mapped by the allocator, "
     << s.mmap_bytes_direct << " bytes mapped directly (now mapped: " << s.mapped_now_allocator
     << " / " << s.mapped_now_direct << ")\n";
  if (s.brk_now > s.brk_start)
    os << "    brk heap: " << (s.brk_now - s.brk_start) << " bytes\n";
  if (s.inherited_blocks) os << "    inherited from parent at fork: " << s.inherited_blocks << " blocks\n";
  if (s.unknown_frees)
    os << "    frees of blocks not seen allocated (from before tracing, or the allocator's own): " << s.unknown_frees
       << "\n";
  os << "\n";
}

void write_text(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                const Drops& d) {
  if (m.sample_bytes())
    os << "SAMPLED: one allocation per " << m.sample_bytes()
       << " bytes on average (--sample-bytes), weighted: every count and byte figure of the malloc family below is an "
          "estimate\n\n";
  for (const heap::Process* pp : m.images()) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    write_summary_text(os, p, o.at_exit);
    if (!o.leaks) {
      if (m.faults_enabled()) write_faults_text(os, m, r, p, o.top);
      continue;
    }
    auto groups = leak_groups(p);
    size_t n = std::min(groups.size(), o.top);
    if (!groups.empty())
      os << "LEAKS (live blocks by allocation stack, largest first; " << n << " of "
         << groups.size() << ")\n\n";
    for (size_t i = 0; i < n; i++) {
      const auto& g = groups[i];
      os << g.bytes << " bytes in " << g.blocks << " blocks were not freed";
      if (m.faults_enabled()) os << " (" << g.untouched_blocks << " never touched)";
      os << "\n";
      bool trunc = false;
      auto fs = frames_of(m, r, p, g.stack_id, &trunc);
      if (size_t shown = text_frames(fs); shown < fs.size()) {
        fs.resize(shown);
        trunc = false;
      }
      if (fs.empty()) os << "    (no stack)\n";
      for (const auto& f : fs) os << "    " << describe(f) << "\n";
      if (trunc) os << "    ... (stack truncated)\n";
      os << "\n";
    }
    write_analysis_text(os, m, r, p, o.top);
    if (m.faults_enabled()) write_faults_text(os, m, r, p, o.top);
  }
  write_tail_text(os, d, o.stats);
}

namespace {

// What a DROPPED counter that is not 0 means for the figures above it.
const char* drop_meaning(const std::string& k) {
  static const std::map<std::string, const char*> m = {
      {"ringbuf", "allocator/mmap events lost, the ring buffer full (--ringbuf-mb): counts may be low, a lost "
                  "free shows as a leak"},
      {"stack_ringbuf", "stacks lost, their ring full: those allocations are counted, under \"(no stack)\""},
      {"inflight_map_full", "calls not followed to their return: those allocations are not counted"},
      {"stack_missing", "stacks the kernel returned empty: those allocations are counted, under \"(no stack)\""},
      {"missed_returns", "allocator returns never seen: those allocations are not counted"},
      {"stop_failed", "processes not stopped for their attach: their first allocations may be missing"},
      {"sysargs_map_full", "mmap-family calls not followed to their return: mmap figures may be low"},
      {"fault_ringbuf", "page faults lost, their ring full: fault figures are low"},
      {"stack_record_missing", "events whose stack record was lost: counted, under \"(no stack)\""},
      {"malformed", "records that could not be read: counts may be low"},
      {"attach_failed", "attaches that failed (see the error lines): those processes are missing or incomplete"},
      {"static_without_symbols",
       "execs of statically linked, stripped programs (system-wide): no allocator symbols to probe, their "
       "allocations are not traced"},
      {"inject_leftovers_unrestored",
       "processes a killed --inject session left patched and that could not be put back: their counts are "
       "incomplete"},
      {"inject_ring_full", "--inject records lost, the agent's ring full: counts may be low"},
      {"inject_stack_cut", "--inject stacks the agent's CFI walk could not finish nor libunwind: those "
                           "allocations are counted, their stacks end early"},
      {"inject_malformed", "--inject records that could not be read: counts may be low"},
      {"inject_queue_left_at_end", "processes that exec'd as the run ended, before their --inject turn: let go "
                                   "untraced"},
      {"inject_fork_child_calls", "allocator calls in a fork's child before the agent saw the fork: not counted"},
      {"unwind_table_over_cap", "files past --unwind-mb, unwound by frame pointers: their stacks may be cut"},
      {"unwind_table_failed", "files whose unwind tables could not be built: their stacks may be cut"},
  };
  auto it = m.find(k);
  return it == m.end() ? "events lost (docs/usage.md): the figures above may be low" : it->second;
}

}  // namespace

void write_tail_text(std::ostream& os, const Drops& d, bool stats) {
  bool any = false;
  for (const auto& [k, v] : d.dropped) any = any || v;
  if (!any) {
    os << "nothing dropped\n";
  } else {
    os << "DROPPED:";
    for (const auto& [k, v] : d.dropped)
      if (v) os << " " << k << "=" << v;
    os << "\n";
    for (const auto& [k, v] : d.dropped)
      if (v) os << "    " << k << ": " << drop_meaning(k) << "\n";
  }
  if (stats && !d.stats.empty()) {
    os << "STATS:";
    for (const auto& [k, v] : d.stats) os << " " << k << "=" << v;
    os << "\n";
  }
}

nlohmann::json container_json(const std::string& cgroup) {
  procfs::Container c = procfs::container_of(cgroup);
  if (c.id.empty() && c.pod.empty()) return nullptr;
  nlohmann::json j = {{"id", c.id}, {"runtime", c.runtime}};
  j["pod"] = c.pod.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.pod);
  return j;
}

nlohmann::json to_json(const heap::HeapModel& m, const Resolver& r, const Options& o,
                       const Drops& d) {
  using nlohmann::json;
  json procs = json::array();
  for (const heap::Process* pp : m.images()) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    const auto& s = p.s;
    json jp;
    jp["pid"] = p.pid;
    jp["ppid"] = p.ppid;
    jp["comm"] = p.comm;
    jp["cgroup"] = p.cgroup.empty() ? json(nullptr) : json(p.cgroup);
    jp["container"] = container_json(p.cgroup);
    // One entry per image: exec_index counts pid's images reported before it;
    // an image that exec'd ended "exec" (its blocks are in use at the exec).
    jp["exec_index"] = p.image;
    jp["ended"] = p.merged ? "merged" : p.ended_by_exec ? "exec" : p.exited ? "exit" : "running";
    if (p.merged) jp["merged"] = {{"processes", p.merged}, {"pids", p.merged_pids}};
    if (p.exited && p.exit_code && !p.ended_by_exec && !p.merged) {
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
        {"temporary_allocs", s.temporary_allocs},
        {"peak_ts_ns", s.peak_ts},
    };
    {
      const heap::DomainSummary& py = s.python;
      jp["summary"]["domains"] = {
          {"malloc",
           {{"allocs", s.allocs - py.allocs},
            {"frees", s.frees - py.frees},
            {"bytes_allocated", s.bytes_allocated - py.bytes_allocated},
            {"in_use_bytes", s.in_use_bytes - py.in_use_bytes},
            {"in_use_blocks", s.in_use_blocks - py.in_use_blocks},
            {"failed_allocs", s.failed_allocs - py.failed_allocs},
            {"unknown_frees", s.unknown_frees - py.unknown_frees}}},
          {"python",
           {{"allocs", py.allocs},
            {"frees", py.frees},
            {"bytes_allocated", py.bytes_allocated},
            {"in_use_bytes", py.in_use_bytes},
            {"in_use_blocks", py.in_use_blocks},
            {"peak_in_use_bytes", py.peak_in_use_bytes},
            {"failed_allocs", py.failed_allocs},
            {"unknown_frees", py.unknown_frees}}},
      };
    }
    json leaks = json::array();
    if (o.leaks) {
      auto groups = leak_groups(p);
      size_t n = std::min(groups.size(), o.top);
      for (size_t i = 0; i < n; i++) {
        const auto& g = groups[i];
        bool trunc = false;
        json stack = frames_json(m, r, p, g.stack_id, &trunc);
        json jl = {{"bytes", g.bytes}, {"blocks", g.blocks}, {"stack_id", hex(g.stack_id)}, {"stack", stack},
                   {"stack_truncated", trunc}};
        if (m.faults_enabled()) jl["untouched_blocks"] = g.untouched_blocks;
        if (s.python.allocs) jl["python_blocks"] = g.python_blocks;
        leaks.push_back(std::move(jl));
      }
      jp["leak_groups_total"] = groups.size();
    }
    jp["leaks"] = std::move(leaks);
    if (o.leaks) jp["analysis"] = analysis_json(m, r, p, o.top);
    if (m.faults_enabled()) jp["faults"] = faults_json(m, r, p, o.top);
    procs.push_back(std::move(jp));
  }
  json j;
  j["processes"] = std::move(procs);
  // --sample-bytes (issue 34): 0, exact figures; else the malloc family's
  // counts and bytes are estimates from one sample per that many bytes.
  j["sample_bytes"] = m.sample_bytes();
  j["estimates"] = m.sample_bytes() != 0;
  j["dropped"] = d.dropped;
  j["stats"] = d.stats;
  return j;
}

std::string json_text(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace memtrace::report
