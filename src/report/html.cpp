#include "report/html.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
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

// Frame indexes of a stack, outermost first.
json stack_frames(const heap::HeapModel& m, const Resolver& r, Tables& t, pid_t pid, uint64_t stack_id) {
  json out = json::array();
  if (!stack_id) {
    out.push_back(t.synthetic("[no stack]"));
    return out;
  }
  bool trunc = false;
  auto fs = frames_of(m, r, pid, stack_id, &trunc);
  if (trunc) out.push_back(t.synthetic("[truncated]"));
  for (auto it = fs.rbegin(); it != fs.rend(); ++it)
    out.push_back(t.frame(frame_label(*it), it->file, it->line, it->module, it->inlined));
  if (fs.empty()) out.push_back(t.synthetic("[no stack]"));
  return out;
}

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

// The rows with the largest share of any column first (ties: by stack id).
void rank(std::vector<Row>& rows) {
  std::array<double, kCols> total{};
  for (const auto& r : rows)
    for (int c = 0; c < kCols; c++) total[c] += static_cast<double>(r.v[c]);
  auto score = [&](const Row& r) {
    double s = 0;
    for (int c = 0; c < kCols; c++)
      if (total[c] > 0) s = std::max(s, static_cast<double>(r.v[c]) / total[c]);
    return s;
  };
  std::vector<std::pair<double, size_t>> order;
  order.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); i++) order.emplace_back(score(rows[i]), i);
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : rows[a.second].stack_id < rows[b.second].stack_id;
  });
  std::vector<Row> sorted;
  sorted.reserve(rows.size());
  for (const auto& [s, i] : order) sorted.push_back(rows[i]);
  rows.swap(sorted);
}

json summary_json(const heap::HeapModel& m, const heap::Process& p) {
  const auto& s = p.s;
  json j = {
      {"allocs", s.allocs},
      {"frees", s.frees},
      {"bytes_allocated", s.bytes_allocated},
      {"in_use_bytes", s.in_use_bytes},
      {"in_use_blocks", s.in_use_blocks},
      {"peak_in_use_bytes", s.peak_in_use_bytes},
      {"failed_allocs", s.failed_allocs},
      {"mmap_bytes_direct", s.mmap_bytes_direct},
      {"mmap_bytes_allocator", s.mmap_bytes_allocator},
      {"temporary_allocs", s.temporary_allocs},
  };
  if (m.faults_enabled()) j["pages_first_touched"] = p.f.pages_first_touched;
  return j;
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

// Spans of the page's stacks (one list per row, "other" merged): with more
// than max entries, buckets are merged in pairs (bucket_ns doubles) until
// they fit. Flat per stack: alloc bucket, free bucket, bytes, count, ...
json spans_json(const heap::Process& p, const std::vector<Row>& kept, const std::vector<Row>& folded,
                uint64_t origin, size_t max) {
  if (!p.span_bucket_ns) return nullptr;
  std::vector<SpanSums> lists(kept.size() + (folded.empty() ? 0 : 1));
  size_t n = 0;
  for (size_t i = 0; i < kept.size(); i++)
    if (auto it = p.spans.find(kept[i].stack_id); it != p.spans.end()) add_spans(lists[i], it->second);
  for (const auto& row : folded)
    if (auto it = p.spans.find(row.stack_id); it != p.spans.end()) add_spans(lists.back(), it->second);
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

json image_json(const heap::HeapModel& m, const Resolver& r, Tables& t, const heap::Process& p, size_t cap,
                const HtmlOptions& ho) {
  json j;
  j["pid"] = p.pid;
  j["ppid"] = p.ppid;
  j["comm"] = p.comm.empty() ? "?" : p.comm;
  j["image"] = p.image;
  j["ended"] = p.ended_by_exec ? "exec" : p.exited ? "exit" : "running";
  j["exit_code"] = nullptr;
  if (p.exited && p.exit_code && !p.ended_by_exec) {
    int st = *p.exit_code;
    j["exit_code"] = (st & 0x7f) ? 128 + (st & 0x7f) : (st >> 8) & 0xff;
  }
  j["summary"] = summary_json(m, p);
  // Times are ns from the image's first event (t0_ns, the events' clock).
  uint64_t origin = p.first_ts ? p.first_ts : !p.timeline.empty() ? p.timeline.front().ts : p.span_t0;
  j["t0_ns"] = origin;
  j["duration_ns"] = p.last_ts > origin ? p.last_ts - origin : 0;
  if (p.s.peak_ts) j["peak_ts"] = since(p.s.peak_ts, origin);

  std::vector<Row> rows = rows_of(m, p);
  rank(rows);
  size_t kept = std::min(rows.size(), cap);
  std::vector<Row> folded(rows.begin() + static_cast<ptrdiff_t>(kept), rows.end());
  rows.resize(kept);
  json stacks = json::array();
  for (const auto& row : rows) stacks.push_back(stack_frames(m, r, t, p.pid, row.stack_id));
  std::vector<Row> shown = rows;
  if (!folded.empty()) {
    stacks.push_back(json::array({t.synthetic("(other " + std::to_string(folded.size()) + " stacks)")}));
    Row other;
    for (const auto& row : folded)
      for (int c = 0; c < kCols; c++) other.v[c] += row.v[c];
    shown.push_back(other);
  }
  json values = json::object();
  for (int c = 0; c < kCols; c++) {
    if (c == kPages && !m.faults_enabled()) continue;
    json col = json::array();
    for (const auto& row : shown) col.push_back(row.v[c]);
    values[kColName[c]] = std::move(col);
  }
  j["stacks"] = std::move(stacks);
  j["stacks_total"] = kept + folded.size();
  j["other_stacks"] = folded.size();
  j["values"] = std::move(values);
  j["timeline"] = timeline_json(m, p, origin);
  j["spans"] = spans_json(p, rows, folded, origin, ho.max_spans);
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

}  // namespace

json html_data(const heap::HeapModel& m, const Resolver& r, const Options& o, const HtmlOptions& ho) {
  std::vector<const heap::Process*> shown;
  for (const heap::Process* p : m.images())
    if (o.include_idle || active(*p)) shown.push_back(p);
  size_t cap = ho.max_stacks;
  if (!shown.empty()) cap = std::min(cap, std::max(ho.min_stacks, ho.max_stacks_total / shown.size()));
  Tables t;
  json images = json::array();
  for (const heap::Process* p : shown) images.push_back(image_json(m, r, t, *p, cap, ho));
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
  // In a <script> element only "</script" or "<!--" could end or confuse
  // the data: '<' appears in JSON text only inside strings, where \u003c
  // reads back as the same character.
  std::string text = json_text(html_data(m, r, o, ho));
  std::string safe;
  safe.reserve(text.size() + text.size() / 64);
  for (char c : text) {
    if (c == '<') safe += "\\u003c";
    else safe += c;
  }
  os << html_assets::head() << safe << html_assets::tail();
  os.flush();
  if (!os) return Error::msg("write failed");
  return {};
}

}  // namespace memtrace::report
