#include "report/html.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <iterator>
#include <map>
#include <unordered_map>

#include "report/html/assets.h"
#include "report/outputs.h"

namespace memtrace::report {
namespace {

using nlohmann::json;

// The value columns of a stack; names are the page's (app.js KINDS).
enum Col { kLiveBytes, kLiveBlocks, kAllocBytes, kAllocCount, kPeakBytes, kTemporary, kPages, kCols };
constexpr const char* kColName[kCols] = {"live_bytes",  "live_blocks", "alloc_bytes", "alloc_count",
                                         "peak_bytes", "temporary",   "pages"};

struct Row {
  uint64_t stack_id = 0;
  std::array<uint64_t, kCols> v{};
};

// Strings and frames of the page, shared by every image.
class Tables {
 public:
  int64_t str(const std::string& s) {
    if (s.empty()) return -1;
    auto [it, added] = strings_.try_emplace(s, static_cast<int64_t>(strings_.size()));
    if (added) strings_json_.push_back(s);
    return it->second;
  }
  // A frame is its name, file, line, module and whether it was inlined:
  // one entry for every place that names the same.
  int64_t frame(const std::string& name, const std::string& file, int line, const std::string& module,
                bool inlined) {
    std::array<int64_t, 5> key = {str(name), str(file), line, str(module), inlined ? 1 : 0};
    auto [it, added] = frames_.try_emplace(key, static_cast<int64_t>(frames_json_.size()));
    if (added) frames_json_.push_back(key);
    return it->second;
  }
  int64_t synthetic(const std::string& name) { return frame(name, "", 0, "", false); }
  json strings() const { return strings_json_; }
  json frames() const { return frames_json_; }

 private:
  struct KeyHash {
    size_t operator()(const std::array<int64_t, 5>& k) const {
      size_t h = 0;
      for (int64_t x : k) h = h * 1000003 ^ std::hash<int64_t>()(x);
      return h;
    }
  };
  std::unordered_map<std::string, int64_t> strings_;
  std::unordered_map<std::array<int64_t, 5>, int64_t, KeyHash> frames_;
  json strings_json_ = json::array(), frames_json_ = json::array();
};

// A frame's name as the folded output shows it, not escaped: the function,
// else "[module+0xoffset]", else "[0xaddress]".
std::string frame_label(const FrameOut& f) {
  char b[64];
  if (!f.function.empty()) return f.function;
  if (!f.module.empty()) {
    snprintf(b, sizeof b, "+0x%" PRIx64 "]", f.module_offset);
    return "[" + f.module.substr(f.module.rfind('/') + 1) + b;
  }
  snprintf(b, sizeof b, "[0x%" PRIx64 "]", f.address);
  return b;
}

// A call path: the frames of a stack, outermost first, after kTruncated
// when the stack was cut short. A frame is its return address (raw stacks),
// or its location as module << kLocShift | offset (sealed stacks: every
// stack of one image is either).
constexpr uint64_t kTruncated = ~uint64_t(0);
constexpr unsigned kLocShift = 40;
std::vector<uint64_t> path_of(const heap::HeapModel& m, uint64_t stack_id) {
  std::vector<uint64_t> path;
  const heap::Stack* st = stack_id ? m.stack(stack_id) : nullptr;
  if (!st) return path;
  if (st->truncated) path.push_back(kTruncated);
  if (st->sealed)
    for (auto l = st->locs.rbegin(); l != st->locs.rend(); ++l)
      path.push_back(l->module == heap::kPyModule
                         ? heap::kPyFrameTag | l->offset  // a Python frame: its tagged id
                         : uint64_t{l->module} << kLocShift | (l->offset & ((uint64_t{1} << kLocShift) - 1)));
  else
    path.insert(path.end(), st->ips.rbegin(), st->ips.rend());
  return path;
}

// Frame indexes of call paths of one process, each address symbolized once.
class PathFrames {
 public:
  PathFrames(const Resolver& r, Tables& t, const heap::Process& p) : r_(r), t_(t), p_(p) {}
  // The frames of path's first n addresses, outermost first (an address
  // with inlined frames: the function they were inlined into first).
  json frames(const std::vector<uint64_t>& path, size_t n) {
    json out = json::array();
    for (size_t i = 0; i < n && i < path.size(); i++)
      for (int64_t f : of(path[i])) out.push_back(f);
    return out;
  }
  // A raw stack's path cut before its first frame after the innermost that
  // is no return address (FrameOut::untrusted, as frames_of cuts), and
  // marked truncated; sealed stacks were cut when sealed.
  void trim(std::vector<uint64_t>& path) {
    if (p_.sealed || path.size() < 2) return;
    size_t first = path[0] == kTruncated ? 1 : 0;
    std::vector<std::vector<FrameOut>> each;  // innermost first
    for (size_t i = path.size(); i-- > first;) each.push_back(r_(p_, path[i], nullptr, true));
    size_t keep = trusted_addresses(each);
    if (keep == each.size()) return;
    path.erase(path.begin(), path.end() - keep);
    path.insert(path.begin(), kTruncated);
  }

 private:
  const std::vector<int64_t>& of(uint64_t ip) {
    auto [it, added] = by_ip_.try_emplace(ip);
    if (!added) return it->second;
    if (ip == kTruncated) {
      it->second.push_back(t_.synthetic("[truncated]"));
      return it->second;
    }
    // Every recorded address is a return address (the caller's call site).
    std::vector<FrameOut> fs;
    if (p_.sealed && !(ip & heap::kPyFrameTag)) {
      heap::Loc l{static_cast<uint32_t>(ip >> kLocShift), ip & ((uint64_t{1} << kLocShift) - 1)};
      fs = r_(p_, heap::address_of(p_, l), &l, true);
    } else {
      fs = r_(p_, ip, nullptr, true);
    }
    for (auto f = fs.rbegin(); f != fs.rend(); ++f)
      it->second.push_back(t_.frame(frame_label(*f), f->file, f->line, f->module, f->inlined));
    return it->second;
  }
  const Resolver& r_;
  Tables& t_;
  const heap::Process& p_;
  std::unordered_map<uint64_t, std::vector<int64_t>> by_ip_;
};

std::vector<Row> rows_of(const heap::HeapModel& m, const heap::Process& p) {
  std::unordered_map<uint64_t, Row> by;
  for (const auto& c : stack_counts(p)) {
    auto& r = by[c.stack_id];
    r.v[kLiveBytes] = c.live_bytes;
    r.v[kLiveBlocks] = c.live_blocks;
    r.v[kAllocBytes] = c.alloc_bytes;
    r.v[kAllocCount] = c.alloc_count;
  }
  for (const auto& [id, sa] : p.stack_allocs) {
    auto& r = by[id];
    r.v[kPeakBytes] = sa.peak_bytes;
    r.v[kTemporary] = sa.temporary;
  }
  if (m.faults_enabled())
    for (const auto& [id, sf] : p.fault_stacks) by[id].v[kPages] += sf.pages;
  std::vector<Row> rows;
  rows.reserve(by.size());
  for (auto& [id, r] : by) {
    r.stack_id = id;
    rows.push_back(r);
  }
  return rows;
}

// A row's share of the process's total, the largest over the columns.
class Share {
 public:
  explicit Share(const std::vector<Row>& rows) {
    for (const auto& r : rows)
      for (int c = 0; c < kCols; c++) total_[c] += static_cast<double>(r.v[c]);
  }
  double operator()(const Row& r) const {
    double s = 0;
    for (int c = 0; c < kCols; c++)
      if (total_[c] > 0) s = std::max(s, static_cast<double>(r.v[c]) / total_[c]);
    return s;
  }

 private:
  std::array<double, kCols> total_{};
};

void add(Row& to, const Row& from) {
  for (int c = 0; c < kCols; c++) to.v[c] += from.v[c];
}

// A stack of the page: its frames (outermost first), its values and the
// model's stacks it holds (one, or those folded into it).
struct Entry {
  json frames = json::array();
  Row row;
  std::vector<uint64_t> ids;
};

struct Entries {
  std::vector<Entry> list;  // kept stacks, then folds
  size_t stacks = 0, kept = 0, folded = 0;
};

// The page's stacks of p: the `cap` stacks with the largest share of any
// value, whole; every other stack is folded into a frame "(N other stacks)"
// under the longest call path it shares with a kept stack (the same return
// addresses from the outermost in), so that its values stay where they were
// spent. At most `cap` folds: the smallest join the one at the root.
Entries entries_of(const heap::HeapModel& m, const heap::Process& p, PathFrames& pf, Tables& t, size_t cap) {
  std::vector<Row> rows = rows_of(m, p);
  Share share(rows);
  std::vector<std::pair<double, size_t>> order;
  for (size_t i = 0; i < rows.size(); i++) order.emplace_back(share(rows[i]), i);
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : rows[a.second].stack_id < rows[b.second].stack_id;
  });
  Entries out;
  out.stacks = rows.size();
  out.kept = std::min(rows.size(), cap);
  out.folded = rows.size() - out.kept;
  // The kept paths as a trie: node -> the kept path through it and its depth.
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> child;
  std::vector<std::pair<size_t, size_t>> node_at = {{0, 0}};
  std::vector<std::vector<uint64_t>> paths;
  for (size_t k = 0; k < out.kept; k++) {
    const Row& row = rows[order[k].second];
    auto path = path_of(m, row.stack_id);
    pf.trim(path);
    uint32_t node = 0;
    for (size_t d = 0; d < path.size(); d++) {
      auto [it, added] = child.try_emplace({node, path[d]}, static_cast<uint32_t>(node_at.size()));
      if (added) node_at.emplace_back(k, d + 1);
      node = it->second;
    }
    Entry e{pf.frames(path, path.size()), row, {row.stack_id}};
    if (e.frames.empty()) e.frames.push_back(t.synthetic("[no stack]"));
    out.list.push_back(std::move(e));
    paths.push_back(std::move(path));
  }
  std::map<uint32_t, Entry> folds;  // by the trie node where the path leaves the kept ones
  for (size_t k = out.kept; k < rows.size(); k++) {
    const Row& row = rows[order[k].second];
    uint32_t node = 0;
    auto path = path_of(m, row.stack_id);
    pf.trim(path);
    for (uint64_t ip : path) {
      auto it = child.find({node, ip});
      if (it == child.end()) break;
      node = it->second;
    }
    Entry& f = folds[node];
    add(f.row, row);
    f.ids.push_back(row.stack_id);
  }
  std::vector<std::pair<double, uint32_t>> by_share;
  for (const auto& [node, f] : folds) by_share.emplace_back(share(f.row), node);
  std::sort(by_share.begin(), by_share.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (size_t i = cap > 0 ? cap - 1 : 0; i < by_share.size(); i++) {
    uint32_t node = by_share[i].second;
    if (!node) continue;
    Entry& root = folds[0];
    add(root.row, folds[node].row);
    root.ids.insert(root.ids.end(), folds[node].ids.begin(), folds[node].ids.end());
    folds.erase(node);
  }
  for (const auto& [s, node] : by_share) {
    auto it = folds.find(node);
    if (it == folds.end()) continue;
    Entry f = std::move(it->second);
    if (node) f.frames = pf.frames(paths[node_at[node].first], node_at[node].second);
    f.frames.push_back(t.synthetic("(" + std::to_string(f.ids.size()) + " other stacks)"));
    out.list.push_back(std::move(f));
  }
  if (auto it = folds.find(0); it != folds.end() && std::none_of(by_share.begin(), by_share.end(),
                                                                 [](const auto& b) { return b.second == 0; })) {
    Entry f = std::move(it->second);  // made only by the merging above
    f.frames.push_back(t.synthetic("(" + std::to_string(f.ids.size()) + " other stacks)"));
    out.list.push_back(std::move(f));
  }
  return out;
}

// Signed ns from origin (a fork's child's first points can come before its first event).
int64_t since(uint64_t ts, uint64_t origin) { return static_cast<int64_t>(ts) - static_cast<int64_t>(origin); }

json timeline_json(const heap::HeapModel& m, const heap::Process& p, uint64_t origin) {
  if (p.timeline.empty()) return nullptr;
  json ts = json::array(), in_use = json::array(), mapped = json::array(), pages = json::array();
  for (const auto& pt : p.timeline) {
    ts.push_back(since(pt.ts, origin));
    in_use.push_back(pt.in_use_bytes);
    mapped.push_back(pt.mapped_bytes);
    pages.push_back(pt.touched_pages);
  }
  json j = {{"ts", std::move(ts)}, {"step_ns", p.timeline_step_ns}, {"in_use", std::move(in_use)},
            {"mapped", std::move(mapped)}};
  if (m.faults_enabled()) j["touched_pages"] = std::move(pages);
  return j;
}

json lifetimes_json(const heap::Process& p) {
  return {{"freed", p.lifetimes.freed}, {"freed_bytes", p.lifetimes.freed_bytes},
          {"live_at_end", p.lifetimes.live_at_end}};
}

using SpanKey = std::pair<uint32_t, uint32_t>;  // alloc bucket, free bucket
using SpanSums = std::map<SpanKey, std::pair<uint64_t, uint64_t>>;  // bytes, count

void add_spans(SpanSums& to, const std::vector<heap::Span>& from) {
  for (const auto& sp : from) {
    auto& [bytes, count] = to[{sp.alloc_bucket, sp.free_bucket}];
    bytes += sp.bytes;
    count += sp.count;
  }
}

// Spans of the page's stacks (a fold: its stacks' merged): with more than
// max entries, buckets are merged in pairs (bucket_ns doubles) until they
// fit. Flat per stack: alloc bucket, free bucket, bytes, count, ...
json spans_json(const heap::Process& p, const std::vector<Entry>& entries, uint64_t origin, size_t max) {
  if (!p.span_bucket_ns) return nullptr;
  std::vector<SpanSums> lists(entries.size());
  size_t n = 0;
  for (size_t i = 0; i < entries.size(); i++)
    for (uint64_t id : entries[i].ids)
      if (auto it = p.spans.find(id); it != p.spans.end()) add_spans(lists[i], it->second);
  for (const auto& l : lists) n += l.size();
  uint64_t bucket_ns = p.span_bucket_ns;
  while (n > max && bucket_ns < (uint64_t(1) << 62)) {
    n = 0;
    for (auto& l : lists) {
      SpanSums half;
      for (const auto& [k, v] : l) {
        auto& [bytes, count] = half[{k.first >> 1, k.second == heap::kSpanLive ? k.second : k.second >> 1}];
        bytes += v.first;
        count += v.second;
      }
      l.swap(half);
      n += l.size();
    }
    bucket_ns <<= 1;
  }
  json by_stack = json::array();
  for (const auto& l : lists) {
    json flat = json::array();
    for (const auto& [k, v] : l) flat.insert(flat.end(), {k.first, k.second, v.first, v.second});
    by_stack.push_back(std::move(flat));
  }
  return {{"offset_ns", since(p.span_t0, origin)}, {"bucket_ns", bucket_ns}, {"live", heap::kSpanLive},
          {"by_stack", std::move(by_stack)}};
}

// jp: the image in the JSON report (its summary, how it ended, in the same words).
json image_json(const heap::HeapModel& m, const Resolver& r, Tables& t, const heap::Process& p, const json& jp,
                size_t cap, const HtmlOptions& ho) {
  json j = {{"pid", jp["pid"]},     {"ppid", jp["ppid"]},   {"comm", jp["comm"]},
            {"image", jp["exec_index"]}, {"ended", jp["ended"]}, {"exit_code", jp["exit_code"]},
            {"summary", jp["summary"]}, {"cgroup", jp["cgroup"]}, {"container", jp["container"]}};
  j["summary"]["temporary_allocs"] = p.s.temporary_allocs;
  if (m.faults_enabled()) j["summary"]["pages_first_touched"] = p.f.pages_first_touched;
  // Times are ns from the image's first event (t0_ns, the events' clock).
  uint64_t origin = p.first_ts ? p.first_ts : !p.timeline.empty() ? p.timeline.front().ts : p.span_t0;
  j["t0_ns"] = origin;
  j["duration_ns"] = p.last_ts > origin ? p.last_ts - origin : 0;
  if (p.s.peak_ts) j["peak_ts"] = since(p.s.peak_ts, origin);

  PathFrames pf(r, t, p);
  Entries es = entries_of(m, p, pf, t, cap);
  json stacks = json::array();
  for (auto& e : es.list) stacks.push_back(std::move(e.frames));
  json values = json::object();
  for (int c = 0; c < kCols; c++) {
    if (c == kPages && !m.faults_enabled()) continue;
    json col = json::array();
    for (const auto& e : es.list) col.push_back(e.row.v[c]);
    values[kColName[c]] = std::move(col);
  }
  j["stacks"] = std::move(stacks);
  j["stacks_total"] = es.stacks;
  j["kept_stacks"] = es.kept;
  j["other_stacks"] = es.folded;
  j["values"] = std::move(values);
  j["timeline"] = timeline_json(m, p, origin);
  j["spans"] = spans_json(p, es.list, origin, ho.max_spans);
  j["lifetimes"] = lifetimes_json(p);
  return j;
}

std::string now_text() {
  char b[64];
  time_t now = time(nullptr);
  struct tm tm {};
  localtime_r(&now, &tm);
  strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S %z", &tm);
  return b;
}

// Stacks kept whole per image (or group) when a page shows `parts` of them.
size_t stacks_cap(const HtmlOptions& ho, size_t parts) {
  return parts ? std::min(ho.max_stacks, std::max(ho.min_stacks, ho.max_stacks_total / parts)) : ho.max_stacks;
}

// The page with its data in it.
Result<void> write_page(std::ostream& os, const html_assets::Page& page, const json& data) {
  // In a <script> element only "</script" or "<!--" could end or confuse
  // the data: '<' appears in JSON text only inside strings, where \u003c
  // reads back as the same character.
  std::string text = json_text(data);
  std::string safe;
  safe.reserve(text.size() + text.size() / 64);
  for (char c : text) {
    if (c == '<') safe += "\\u003c";
    else safe += c;
  }
  os << page.head << safe << page.tail;
  os.flush();
  if (!os) return Error::msg("write failed");
  return {};
}

// ---- the diff page
// Its value columns (diff.js KINDS, and the tables' blocks).
struct DiffCol {
  const char* name;
  int64_t DiffCounts::*field;
  bool allocs;  // counted by stack only when the group's allocs_by_stack
};
constexpr DiffCol kDiffCols[] = {{"live_bytes", &DiffCounts::live_bytes, false},
                                 {"live_blocks", &DiffCounts::live_blocks, false},
                                 {"alloc_bytes", &DiffCounts::alloc_bytes, true},
                                 {"alloc_count", &DiffCounts::allocs, true}};
constexpr size_t kDiffColCount = std::size(kDiffCols);

// A row's frames for the page, outermost first.
json diff_frames(Tables& t, const DiffRow& r) {
  json out = json::array();
  if (r.truncated) out.push_back(t.synthetic("[truncated]"));
  for (auto f = r.frames.rbegin(); f != r.frames.rend(); ++f)
    out.push_back(t.frame(frame_label(*f), f->file, f->line, f->module, f->inlined));
  if (out.empty()) out.push_back(t.synthetic("[no stack]"));
  return out;
}

// Which of g's stacks the page keeps whole: every one a section lists, and
// up to `cap` with the largest share of a column's widths (the larger of A
// and B) or of its changes.
std::vector<bool> diff_kept(const DiffGroup& g, size_t cap) {
  const size_t n = g.stacks.size();
  if (n <= cap) return std::vector<bool>(n, true);
  // Per stack and column: its width, its change.
  auto part = [&](size_t i, size_t c, bool change) {
    int64_t a = g.stacks[i].a.*kDiffCols[c].field, b = g.stacks[i].b.*kDiffCols[c].field;
    return static_cast<double>(change ? std::abs(b - a) : std::max(a, b));
  };
  std::array<double, 2 * kDiffColCount> total{};
  for (size_t i = 0; i < n; i++)
    for (size_t c = 0; c < 2 * kDiffColCount; c++) total[c] += part(i, c / 2, c % 2);
  std::vector<std::pair<double, size_t>> order;
  for (size_t i = 0; i < n; i++) {
    double share = 0;
    for (size_t c = 0; c < 2 * kDiffColCount; c++)
      if (total[c] > 0) share = std::max(share, part(i, c / 2, c % 2) / total[c]);
    order.emplace_back(share, i);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<bool> kept(n, false);
  for (size_t i : g.shown) kept[i] = true;
  for (size_t k = 0; k < cap; k++) kept[order[k].second] = true;
  return kept;
}

// jg: the group as diff_json writes it.
json diff_group_json(Tables& t, const DiffGroup& g, json jg, size_t cap) {
  std::vector<bool> kept = diff_kept(g, cap);
  std::vector<size_t> at(g.stacks.size());
  json stacks = json::array();
  std::vector<const DiffRow*> rows;
  DiffRow other;
  size_t others = 0;
  for (size_t i = 0; i < g.stacks.size(); i++) {
    if (!kept[i]) {
      for (auto side : {&DiffRow::a, &DiffRow::b})
        for (const auto& col : kDiffCols) other.*side.*col.field += g.stacks[i].*side.*col.field;
      others++;
      continue;
    }
    at[i] = rows.size();
    rows.push_back(&g.stacks[i]);
    stacks.push_back(diff_frames(t, g.stacks[i]));
  }
  if (others) {
    rows.push_back(&other);
    stacks.push_back(json::array({t.synthetic("(" + std::to_string(others) + " other stacks)")}));
  }
  json values = json::object();
  for (const auto& col : kDiffCols) {
    if (col.allocs && !g.allocs_by_stack) continue;
    json a = json::array(), b = json::array();
    for (const DiffRow* r : rows) {
      a.push_back(r->a.*col.field);
      b.push_back(r->b.*col.field);
    }
    values[col.name] = {{"a", std::move(a)}, {"b", std::move(b)}};
  }
  // The sections' rows: their stack among the page's.
  size_t shown = 0;
  for (const char* sec : {"grew", "shrank", "churn"})
    for (auto& row : jg[sec]["stacks"]) row["stack"] = at[g.shown.at(shown++)];
  jg["stacks"] = std::move(stacks);
  jg["values"] = std::move(values);
  jg["stacks_total"] = g.stacks.size();
  jg["kept_stacks"] = g.stacks.size() - others;
  jg["other_stacks"] = others;
  return jg;
}

}  // namespace

json html_data(const heap::HeapModel& m, const Resolver& r, const Options& o, const HtmlOptions& ho) {
  // The JSON report's entries for the images it shows (the same ones), with
  // no stack in them (top 0: nothing to symbolize).
  Options brief = o;
  brief.top = 0;
  json base = to_json(m, r, brief, Drops{});
  std::vector<std::pair<const heap::Process*, const json*>> shown;
  for (const heap::Process* p : m.images())
    for (const auto& jp : base["processes"])
      if (jp["pid"] == p->pid && jp["exec_index"] == p->image) {
        shown.emplace_back(p, &jp);
        break;
      }
  size_t cap = stacks_cap(ho, shown.size());
  Tables t;
  json images = json::array();
  for (const auto& [p, jp] : shown) images.push_back(image_json(m, r, t, *p, *jp, cap, ho));
  long page = sysconf(_SC_PAGESIZE);
  return {
      {"format", "memtrace-bpf html"},
      {"version", 1},
      {"generated", now_text()},
      {"duration_ns", ho.duration_nanos},
      {"faults", m.faults_enabled()},
      {"page_size", page > 0 ? page : 4096},
      {"limits", {{"stacks_per_image", cap}}},
      {"strings", t.strings()},
      {"frames", t.frames()},
      {"images", std::move(images)},
  };
}

Result<void> write_html(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                        const HtmlOptions& ho) {
  return write_page(os, html_assets::report(), html_data(m, r, o, ho));
}

json diff_html_data(const Diff& d, const HtmlOptions& ho) {
  json jd = diff_json(d)["diff"];
  size_t cap = stacks_cap(ho, d.groups.size());
  Tables t;
  json groups = json::array();
  for (size_t i = 0; i < d.groups.size(); i++)
    groups.push_back(diff_group_json(t, d.groups[i], std::move(jd["groups"][i]), cap));
  return {
      {"format", "memtrace-bpf diff html"},
      {"version", 1},
      {"generated", now_text()},
      {"a", jd["a"]},
      {"b", jd["b"]},
      {"match", jd["match"]},
      {"notes", jd["notes"]},
      {"limits", {{"stacks_per_group", cap}}},
      {"strings", t.strings()},
      {"frames", t.frames()},
      {"groups", std::move(groups)},
  };
}

Result<void> write_diff_html(std::ostream& os, const Diff& d, const HtmlOptions& ho) {
  return write_page(os, html_assets::diff(), diff_html_data(d, ho));
}

}  // namespace memtrace::report
