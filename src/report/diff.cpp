#include "common/hex.h"
#include "report/diff.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <set>

#include "report/outputs.h"

namespace memtrace::report {
namespace {

std::string base_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

// What a frame is in any run of the same program: never its address.
std::string frame_key(const FrameOut& f, DiffMatch match) {
  std::string mod = base_name(f.module);
  if (f.function.empty()) return "?? " + mod + "+" + hex(f.module_offset);
  std::string k = f.function;
  if (match == DiffMatch::Line)
    k += f.file.empty() ? "+" + hex(f.offset) : " " + base_name(f.file) + ":" + std::to_string(f.line);
  if (f.inlined) k += " [inlined]";
  return k + " in " + mod;
}

std::string stack_key(const std::vector<FrameOut>& frames, DiffMatch match) {
  std::string k;
  for (const auto& f : frames) k += frame_key(f, match) + "\n";
  return k;
}

DiffTotals totals_of(const heap::Process& p) {
  return {1,
          static_cast<int64_t>(p.s.in_use_bytes),
          static_cast<int64_t>(p.s.in_use_blocks),
          static_cast<int64_t>(p.s.allocs),
          static_cast<int64_t>(p.s.frees),
          static_cast<int64_t>(p.s.bytes_allocated)};
}

void add(DiffTotals& t, const DiffTotals& o) {
  t.processes += o.processes;
  t.in_use_bytes += o.in_use_bytes;
  t.in_use_blocks += o.in_use_blocks;
  t.allocs += o.allocs;
  t.frees += o.frees;
  t.bytes_allocated += o.bytes_allocated;
}

void add(DiffCounts& c, const DiffCounts& o, int sign = 1) {
  c.live_bytes += sign * o.live_bytes;
  c.live_blocks += sign * o.live_blocks;
  c.allocs += sign * o.allocs;
  c.alloc_bytes += sign * o.alloc_bytes;
}

DiffCounts delta(const DiffRow& r) {
  DiffCounts d = r.b;
  add(d, r.a, -1);
  return d;
}

DiffCounts counts_of(const StackCounts& s) {
  return {static_cast<int64_t>(s.live_bytes), static_cast<int64_t>(s.live_blocks),
          static_cast<int64_t>(s.alloc_count), static_cast<int64_t>(s.alloc_bytes)};
}

// Rows into grew / shrank / churn, the largest change first, the first
// `top` of each kept (*kept: which of `rows` each kept one is, in order).
void sort_rows(std::vector<DiffRow>& rows, DiffGroup& g, size_t top, std::vector<size_t>* kept = nullptr) {
  std::vector<std::pair<DiffCounts, size_t>> grew, shrank, churn;
  for (size_t i = 0; i < rows.size(); i++) {
    DiffCounts d = delta(rows[i]);
    if (d.live_bytes > 0 || (d.live_bytes == 0 && d.live_blocks > 0)) grew.push_back({d, i});
    else if (d.live_bytes < 0 || d.live_blocks < 0) shrank.push_back({d, i});
    else if (d.allocs || d.alloc_bytes) churn.push_back({d, i});
  }
  auto by_live = [](const auto& x, const auto& y) {
    if (x.first.live_bytes != y.first.live_bytes) return std::abs(x.first.live_bytes) > std::abs(y.first.live_bytes);
    if (x.first.live_blocks != y.first.live_blocks) return std::abs(x.first.live_blocks) > std::abs(y.first.live_blocks);
    return x.first.allocs > y.first.allocs;
  };
  auto by_allocs = [](const auto& x, const auto& y) {
    if (x.first.allocs != y.first.allocs) return std::abs(x.first.allocs) > std::abs(y.first.allocs);
    return std::abs(x.first.alloc_bytes) > std::abs(y.first.alloc_bytes);
  };
  std::stable_sort(grew.begin(), grew.end(), by_live);
  std::stable_sort(shrank.begin(), shrank.end(), by_live);
  std::stable_sort(churn.begin(), churn.end(), by_allocs);
  auto fill = [&](DiffSection& s, const std::vector<std::pair<DiffCounts, size_t>>& v) {
    s.total = v.size();
    for (const auto& [d, i] : v) {
      add(s.delta, d);
      if (s.rows.size() < top) {
        s.rows.push_back(rows[i]);
        if (kept) kept->push_back(i);
      }
    }
  };
  fill(g.grew, grew);
  fill(g.shrank, shrank);
  fill(g.churn, churn);
}

void sort_groups(Diff& d) {
  std::stable_sort(d.groups.begin(), d.groups.end(), [](const DiffGroup& x, const DiffGroup& y) {
    int64_t dx = std::abs(x.b.in_use_bytes - x.a.in_use_bytes), dy = std::abs(y.b.in_use_bytes - y.a.in_use_bytes);
    return dx != dy ? dx > dy : x.label < y.label;
  });
}

// A frame of a JSON report's stack.
FrameOut frame_of_json(const nlohmann::json& jf) {
  FrameOut f;
  auto num = [&](const char* k) -> uint64_t {
    auto it = jf.find(k);
    if (it == jf.end()) return 0;
    if (it->is_number_unsigned() || it->is_number_integer()) return it->get<uint64_t>();
    if (it->is_string()) return strtoull(it->get<std::string>().c_str(), nullptr, 0);
    return 0;
  };
  auto str = [&](const char* k) {
    auto it = jf.find(k);
    return it != jf.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  f.address = num("address");
  f.function = str("function");
  f.offset = num("offset");
  f.module = str("module");
  f.module_offset = num("module_offset");
  f.file = str("file");
  f.line = static_cast<int>(num("line"));
  f.column = static_cast<int>(num("column"));
  f.inlined = jf.value("inlined", false);
  f.unknown = str("unknown");
  return f;
}

std::string signed_text(int64_t v) { return (v > 0 ? "+" : "") + std::to_string(v); }

std::string pids_text(const std::vector<pid_t>& pids) {
  if (pids.empty()) return "none";
  std::string s = pids.size() == 1 ? "pid " : "pids ";
  for (size_t i = 0; i < pids.size() && i < 8; i++) s += (i ? ", " : "") + std::to_string(pids[i]);
  if (pids.size() > 8) s += ", ... (" + std::to_string(pids.size()) + ")";
  return s;
}

// A frame as it reads in any run: no address.
std::string frame_text(const FrameOut& f) {
  std::string s;
  if (f.function.empty()) {
    s = "??";
    if (!f.module.empty()) s += " (" + base_name(f.module) + "+" + hex(f.module_offset) + ")";
  } else {
    s = f.function;
  }
  if (!f.file.empty()) s += " (" + f.file + ":" + std::to_string(f.line) + ")";
  if (f.inlined) s += " [inlined]";
  if (!f.module.empty()) s += " in " + f.module;
  return s;
}

std::string from_to(int64_t a, int64_t b, const char* unit) {
  return std::to_string(a) + " -> " + std::to_string(b) + (*unit ? " " : "") + unit + " (" + signed_text(b - a) + ")";
}

void write_section(std::ostream& os, const char* title, const DiffSection& s, bool allocs) {
  os << "  " << title << ": ";
  if (!s.total) {
    os << "nothing\n\n";
    return;
  }
  os << s.total << (s.total == 1 ? " stack" : " stacks");
  if (s.delta.live_bytes || s.delta.live_blocks)
    os << ", " << signed_text(s.delta.live_bytes) << " bytes, " << signed_text(s.delta.live_blocks) << " blocks in use";
  if (allocs) os << ", " << signed_text(s.delta.allocs) << " allocs";
  os << "\n";
  for (const auto& r : s.rows) {
    DiffCounts d = delta(r);
    os << "    ";
    if (d.live_bytes || d.live_blocks)
      os << signed_text(d.live_bytes) << " bytes, " << signed_text(d.live_blocks) << " blocks in use (" << r.a.live_bytes
         << " bytes in " << r.a.live_blocks << " blocks -> " << r.b.live_bytes << " in " << r.b.live_blocks << ")";
    if (allocs) {
      if (d.live_bytes || d.live_blocks) os << "; ";
      os << signed_text(d.allocs) << " allocs (" << r.a.allocs << " -> " << r.b.allocs << "), "
         << signed_text(d.alloc_bytes) << " bytes allocated";
    }
    os << "\n";
    if (r.frames.empty()) os << "        (no stack)\n";
    for (const auto& f : r.frames) os << "        " << frame_text(f) << "\n";
    if (r.truncated) os << "        ... (stack truncated)\n";
  }
  if (s.rows.size() < s.total) os << "    ... " << s.total - s.rows.size() << " more (--top)\n";
  os << "\n";
}

nlohmann::json counts_json(const DiffCounts& c, bool allocs) {
  nlohmann::json j = {{"live_bytes", c.live_bytes}, {"live_blocks", c.live_blocks}};
  j["allocs"] = allocs ? nlohmann::json(c.allocs) : nlohmann::json(nullptr);
  j["alloc_bytes"] = allocs ? nlohmann::json(c.alloc_bytes) : nlohmann::json(nullptr);
  return j;
}

nlohmann::json totals_json(const DiffTotals& t, const std::vector<pid_t>& pids) {
  return {{"processes", t.processes}, {"pids", pids},       {"in_use_bytes", t.in_use_bytes},
          {"in_use_blocks", t.in_use_blocks}, {"allocs", t.allocs}, {"frees", t.frees},
          {"bytes_allocated", t.bytes_allocated}};
}

nlohmann::json section_json(const DiffSection& s, bool allocs) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& r : s.rows) {
    nlohmann::json stack = nlohmann::json::array();
    for (const auto& f : r.frames) {
      nlohmann::json jf = {{"function", f.function}, {"module", f.module}};
      if (!f.file.empty()) {
        jf["file"] = f.file;
        jf["line"] = f.line;
      }
      if (f.inlined) jf["inlined"] = true;
      if (f.function.empty()) jf["module_offset"] = hex(f.module_offset);
      stack.push_back(std::move(jf));
    }
    rows.push_back({{"a", counts_json(r.a, allocs)},
                    {"b", counts_json(r.b, allocs)},
                    {"delta", counts_json(delta(r), allocs)},
                    {"stack", std::move(stack)},
                    {"stack_truncated", r.truncated}});
  }
  return {{"stacks", std::move(rows)}, {"total", s.total}, {"delta", counts_json(s.delta, allocs)}};
}

}  // namespace

DiffSide diff_side(const heap::HeapModel& m, const Resolver& r, DiffMatch match, const std::string& name) {
  DiffSide side;
  side.name = name;
  for (const heap::Process* p : m.images()) {
    if (p->prelude || !heap::active(*p)) continue;
    auto& g = side.groups[p->comm];
    g.pids.push_back(p->pid);
    add(g.t, totals_of(*p));
    for (const StackCounts& sc : stack_counts(*p)) {
      bool trunc = false;
      auto frames = frames_of(m, r, *p, sc.stack_id, &trunc);
      auto [it, fresh] = g.stacks.try_emplace(stack_key(frames, match));
      if (fresh) {
        it->second.frames = std::move(frames);
        it->second.truncated = trunc;
      }
      add(it->second.c, counts_of(sc));
      g.listed++;
      g.total++;
    }
  }
  return side;
}

Result<DiffSide> diff_side(const nlohmann::json& j, DiffMatch match, const std::string& name) {
  if (!j.is_object() || !j.contains("processes") || !j["processes"].is_array())
    return Error::msg(name + ": not a memtrace-bpf JSON report (no \"processes\" list)");
  DiffSide side;
  side.name = name;
  for (const auto& jp : j["processes"]) {
    if (!jp.is_object() || !jp.contains("summary") || !jp["summary"].is_object())
      return Error::msg(name + ": not a memtrace-bpf JSON report (a process without a summary)");
    const auto& s = jp["summary"];
    auto num = [&](const char* k) { return s.contains(k) && s[k].is_number() ? s[k].get<int64_t>() : 0; };
    auto& g = side.groups[jp.value("comm", std::string())];
    g.allocs_by_stack = false;
    if (jp.contains("pid") && jp["pid"].is_number_integer()) g.pids.push_back(jp["pid"].get<pid_t>());
    add(g.t, {1, num("in_use_bytes"), num("in_use_blocks"), num("allocs"), num("frees"), num("bytes_allocated")});
    const auto leaks = jp.value("leaks", nlohmann::json::array());
    for (const auto& jl : leaks) {
      std::vector<FrameOut> frames;
      if (jl.contains("stack") && jl["stack"].is_array())
        for (const auto& jf : jl["stack"]) frames.push_back(frame_of_json(jf));
      auto [it, fresh] = g.stacks.try_emplace(stack_key(frames, match));
      if (fresh) {
        it->second.frames = std::move(frames);
        it->second.truncated = jl.value("stack_truncated", false);
      }
      it->second.c.live_bytes += jl.value("bytes", int64_t(0));
      it->second.c.live_blocks += jl.value("blocks", int64_t(0));
    }
    g.listed += leaks.size();
    g.total += jp.value("leak_groups_total", leaks.size());
  }
  return side;
}

Diff diff_sides(const DiffSide& a, const DiffSide& b, DiffMatch match, size_t top, bool every_stack) {
  Diff d;
  d.a_name = a.name;
  d.b_name = b.name;
  d.match = match;
  std::set<std::string> names;
  for (const auto& [n, g] : a.groups) names.insert(n);
  for (const auto& [n, g] : b.groups) names.insert(n);
  static const DiffSide::Group none;
  for (const auto& n : names) {
    auto ia = a.groups.find(n), ib = b.groups.find(n);
    const DiffSide::Group& ga = ia == a.groups.end() ? none : ia->second;
    const DiffSide::Group& gb = ib == b.groups.end() ? none : ib->second;
    DiffGroup g;
    g.label = n;
    g.a_pids = ga.pids;
    g.b_pids = gb.pids;
    g.a = ga.t;
    g.b = gb.t;
    // A side that does not count allocations per stack (a JSON report) has
    // nothing to compare them with.
    g.allocs_by_stack = (ia == a.groups.end() || ga.allocs_by_stack) && (ib == b.groups.end() || gb.allocs_by_stack);
    std::vector<DiffRow> rows;
    std::map<std::string, size_t> at;
    auto put = [&](const DiffSide::Group& side, bool is_b) {
      for (const auto& [key, st] : side.stacks) {
        auto [it, fresh] = at.try_emplace(key, rows.size());
        if (fresh) rows.emplace_back();
        DiffRow& r = rows[it->second];
        (is_b ? r.b : r.a) = st.c;
        if (fresh || is_b) {  // B's frames (file names, modules as they are now)
          r.frames = st.frames;
          r.truncated = st.truncated;
        }
      }
    };
    put(ga, false);
    put(gb, true);
    if (!g.allocs_by_stack)
      for (auto& r : rows) r.a.allocs = r.a.alloc_bytes = r.b.allocs = r.b.alloc_bytes = 0;
    sort_rows(rows, g, top, every_stack ? &g.shown : nullptr);
    if (every_stack) g.stacks = std::move(rows);
    for (const auto* side : {&ga, &gb})
      if (side->listed < side->total)
        d.notes.push_back((side == &ga ? a.name : b.name) + " lists " + std::to_string(side->listed) + " of the " +
                          std::to_string(side->total) + " leak groups of " + n +
                          " (the report's --top): the others are not compared");
    if (!g.allocs_by_stack && (ia != a.groups.end()) && (ib != b.groups.end()))
      d.notes.push_back(n + ": allocations by stack are not in a JSON report: in use compared only");
    d.groups.push_back(std::move(g));
  }
  sort_groups(d);
  for (const auto& n : a.notes) d.notes.push_back(a.name + ": " + n);
  for (const auto& n : b.notes) d.notes.push_back(b.name + ": " + n);
  return d;
}

HeapSnapshot snapshot_heap(const heap::HeapModel& m) {
  HeapSnapshot s;
  for (const auto& [pid, p] : m.processes()) {
    if (p->prelude) continue;
    auto& sp = s.procs[{pid, p->comm}];
    sp.t = totals_of(*p);
    for (const StackCounts& sc : stack_counts(*p)) sp.stacks[sc.stack_id] = counts_of(sc);
  }
  return s;
}

Diff diff_since(const HeapSnapshot& s, const heap::HeapModel& m, const Resolver& r, size_t top) {
  Diff d;
  d.a_name = "snapshot";
  d.b_name = "now";
  d.console = true;
  const HeapSnapshot now = snapshot_heap(m);
  std::set<std::pair<pid_t, std::string>> keys;
  for (const auto& [k, p] : s.procs) keys.insert(k);
  for (const auto& [k, p] : now.procs) keys.insert(k);
  static const HeapSnapshot::Proc none;
  for (const auto& k : keys) {
    auto ia = s.procs.find(k);
    auto ib = now.procs.find(k);
    const auto& pa = ia == s.procs.end() ? none : ia->second;
    const auto& pb = ib == now.procs.end() ? none : ib->second;
    DiffGroup g;
    g.label = "pid " + std::to_string(k.first) + " (" + k.second + ")";
    if (ia != s.procs.end()) g.a_pids = {k.first};
    if (ib != now.procs.end()) g.b_pids = {k.first};
    g.a = pa.t;
    g.b = pb.t;
    std::vector<DiffRow> rows;
    std::vector<uint64_t> ids;
    std::map<uint64_t, size_t> at;
    for (const auto* side : {&pa, &pb})
      for (const auto& [id, c] : side->stacks) {
        auto [it, fresh] = at.try_emplace(id, rows.size());
        if (fresh) {
          rows.emplace_back();
          ids.push_back(id);
        }
        (side == &pa ? rows[it->second].a : rows[it->second].b) = c;
      }
    std::vector<size_t> kept;
    sort_rows(rows, g, top, &kept);
    // Symbolized once shown (the console runs on the drain thread).
    size_t i = 0;
    heap::Process gone;  // a process that ended since the snapshot: its stacks as far as they are still known
    gone.pid = k.first;
    const heap::Process* cur = m.find(k.first);
    for (auto* sec : {&g.grew, &g.shrank, &g.churn})
      for (auto& row : sec->rows) row.frames = frames_of(m, r, cur ? *cur : gone, ids[kept[i++]], &row.truncated);
    bool same = g.a.in_use_bytes == g.b.in_use_bytes && g.a.in_use_blocks == g.b.in_use_blocks &&
                g.a.allocs == g.b.allocs && g.a.frees == g.b.frees;
    if (same && !g.grew.total && !g.shrank.total && !g.churn.total) continue;
    d.groups.push_back(std::move(g));
  }
  sort_groups(d);
  return d;
}

void write_diff_text(std::ostream& os, const Diff& d) {
  os << "DIFF " << d.a_name << " -> " << d.b_name << ": what grew and what shrank, by allocation stack";
  if (!d.console)
    os << " (stacks matched by " << (d.match == DiffMatch::Line ? "function, file and line" : "function") << ")";
  os << "\n\n";
  if (d.groups.empty()) os << "no change\n\n";
  for (const auto& g : d.groups) {
    os << g.label;
    if (!d.console) os << " (A: " << pids_text(g.a_pids) << "; B: " << pids_text(g.b_pids) << ")";
    os << "\n";
    os << "    in use: " << from_to(g.a.in_use_bytes, g.b.in_use_bytes, "bytes") << ", "
       << from_to(g.a.in_use_blocks, g.b.in_use_blocks, "blocks") << "\n";
    os << "    allocs: " << from_to(g.a.allocs, g.b.allocs, "") << ", frees: " << from_to(g.a.frees, g.b.frees, "")
       << ", bytes allocated: " << from_to(g.a.bytes_allocated, g.b.bytes_allocated, "") << "\n\n";
    write_section(os, "GREW", g.grew, g.allocs_by_stack);
    write_section(os, "SHRANK", g.shrank, g.allocs_by_stack);
    if (g.allocs_by_stack) write_section(os, "ALLOCATIONS CHANGED, IN USE THE SAME", g.churn, true);
  }
  for (const auto& n : d.notes) os << "note: " << n << "\n";
}

nlohmann::json diff_json(const Diff& d) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : d.groups) {
    DiffTotals dt{g.b.processes - g.a.processes, g.b.in_use_bytes - g.a.in_use_bytes,
                  g.b.in_use_blocks - g.a.in_use_blocks, g.b.allocs - g.a.allocs, g.b.frees - g.a.frees,
                  g.b.bytes_allocated - g.a.bytes_allocated};
    nlohmann::json jd = totals_json(dt, {});
    jd.erase("pids");
    groups.push_back({{"label", g.label},
                      {"a", totals_json(g.a, g.a_pids)},
                      {"b", totals_json(g.b, g.b_pids)},
                      {"delta", std::move(jd)},
                      {"allocs_by_stack", g.allocs_by_stack},
                      {"grew", section_json(g.grew, g.allocs_by_stack)},
                      {"shrank", section_json(g.shrank, g.allocs_by_stack)},
                      {"churn", section_json(g.churn, g.allocs_by_stack)}});
  }
  return {{"diff",
           {{"a", d.a_name},
            {"b", d.b_name},
            {"match", d.console ? "stack_id" : d.match == DiffMatch::Line ? "line" : "function"},
            {"groups", std::move(groups)},
            {"notes", d.notes}}}};
}

}  // namespace memtrace::report
