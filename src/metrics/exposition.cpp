#include "metrics/exposition.h"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace memtrace::metrics {
namespace {

// A label value: \ " and line feeds escaped (the text format's rules).
void append_escaped(std::string& out, const std::string& v) {
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

// name{labels} value: labels already escaped, "" for none.
void sample(std::string& out, const char* name, const std::string& labels, uint64_t v) {
  out += name;
  if (!labels.empty()) {
    out += '{';
    out += labels;
    out += '}';
  }
  out += ' ';
  out += std::to_string(v);
  out += '\n';
}

std::string label(const char* key, const std::string& value) {
  std::string s = key;
  s += "=\"";
  append_escaped(s, value);
  s += '"';
  return s;
}

// One per-process family: one field, or two under a `by` label.
struct Part {
  const char* by;  // nullptr: no `by` label
  uint64_t ProcessSample::*field;
};
struct Family {
  const char* name;
  const char* type;
  const char* help;
  std::vector<Part> parts;
  bool faults = false;  // only with --faults
  bool summed = true;   // shown for pid="other" (a sum means something)
};

const std::vector<Family>& process_families() {
  static const std::vector<Family> f = {
      {"memtrace_heap_in_use_bytes", "gauge", "Bytes in live malloc-family blocks of the process.",
       {{nullptr, &ProcessSample::in_use_bytes}}},
      {"memtrace_heap_in_use_blocks", "gauge", "Live malloc-family blocks of the process.",
       {{nullptr, &ProcessSample::in_use_blocks}}},
      {"memtrace_heap_peak_in_use_bytes", "gauge", "The most bytes the process had in live blocks while traced.",
       {{nullptr, &ProcessSample::peak_bytes}}, false, false},
      {"memtrace_allocations_total", "counter", "malloc-family allocations (the report's allocs).",
       {{nullptr, &ProcessSample::allocs}}},
      {"memtrace_frees_total", "counter", "Frees of traced blocks (the report's frees).",
       {{nullptr, &ProcessSample::frees}}},
      {"memtrace_allocated_bytes_total", "counter", "Bytes allocated by malloc-family calls.",
       {{nullptr, &ProcessSample::bytes_allocated}}},
      {"memtrace_failed_allocations_total", "counter", "malloc-family calls that returned no memory.",
       {{nullptr, &ProcessSample::failed_allocs}}},
      {"memtrace_mapped_bytes", "gauge",
       "Bytes mapped now by mmap/mremap: by the allocator (inside an allocator call) or by the program.",
       {{"allocator", &ProcessSample::mapped_allocator}, {"program", &ProcessSample::mapped_program}}},
      {"memtrace_mmap_bytes_total", "counter", "Bytes mapped by mmap/mremap, by the allocator or by the program.",
       {{"allocator", &ProcessSample::mmap_allocator}, {"program", &ProcessSample::mmap_program}}},
      {"memtrace_domain_in_use_bytes", "gauge",
       "Bytes in live blocks by allocator domain: malloc's, or CPython's pymalloc (python).",
       {{"malloc", &ProcessSample::in_use_malloc}, {"python", &ProcessSample::in_use_python}}},
      {"memtrace_domain_allocations_total", "counter", "Allocations by allocator domain: malloc's, or pymalloc's (python).",
       {{"malloc", &ProcessSample::allocs_malloc}, {"python", &ProcessSample::allocs_python}}},
      {"memtrace_page_faults_total", "counter", "User page faults of the process (--faults).",
       {{nullptr, &ProcessSample::faults}}, true},
      {"memtrace_pages_touched_total", "counter", "Pages that faulted for the first time since mapped (--faults).",
       {{nullptr, &ProcessSample::pages_touched}}, true},
  };
  return f;
}

// The report's STATS with a metric of their own (the rest: memtrace_stat).
struct Stat {
  const char* key;
  const char* name;
  const char* type;
  const char* help;
  uint64_t scale;
};
const Stat kStats[] = {
    {"events", "memtrace_events_total", "counter", "Ring-buffer records applied to the heap model.", 1},
    {"tool_rings_kb", "memtrace_ringbuf_size_bytes", "gauge", "Size of the tool's ring buffers.", 1024},
    {"ringbuf_peak_kb", "memtrace_ringbuf_peak_bytes", "gauge",
     "The most bytes the events ring held when drained (what --ringbuf-mb must hold).", 1024},
    {"tool_rss_kb", "memtrace_tool_resident_bytes", "gauge", "Resident memory of memtrace-bpf itself.", 1024},
};

}  // namespace

std::string Selection::render(const Snapshot& s, std::chrono::duration<double> age) {
  // Which processes are shown: gone ones only for retain_scrapes scrapes.
  std::vector<const ProcessSample*> shown;
  std::set<Key> present;
  for (const auto& p : s.processes) {
    Key k{p.pid, p.comm};
    present.insert(k);
    if (!p.gone) {
      gone_scrapes_.erase(k);  // alive again: a pid reused under the same name
    } else if (auto it = gone_scrapes_.find(k); it != gone_scrapes_.end() && it->second >= o_.retain_scrapes) {
      continue;
    }
    shown.push_back(&p);
  }
  std::erase_if(gone_scrapes_, [&](const auto& e) { return !present.count(e.first); });
  std::set<Key> shown_keys;
  for (const auto* p : shown) shown_keys.insert({p->pid, p->comm});
  std::erase_if(slots_, [&](const Key& k) { return !shown_keys.count(k); });
  // Free slots to the unslotted processes with the most bytes in use.
  std::vector<const ProcessSample*> waiting;
  for (const auto* p : shown)
    if (!slots_.count({p->pid, p->comm})) waiting.push_back(p);
  std::stable_sort(waiting.begin(), waiting.end(), [](const ProcessSample* a, const ProcessSample* b) {
    return a->in_use_bytes != b->in_use_bytes ? a->in_use_bytes > b->in_use_bytes
                                              : a->bytes_allocated > b->bytes_allocated;
  });
  for (const auto* p : waiting) {
    if (slots_.size() >= o_.max_processes) break;
    slots_.insert({p->pid, p->comm});
  }
  std::vector<const ProcessSample*> own;
  ProcessSample other;
  size_t over = 0;
  for (const auto* p : shown) {
    if (p->gone) gone_scrapes_[{p->pid, p->comm}]++;
    if (slots_.count({p->pid, p->comm})) {
      own.push_back(p);
      continue;
    }
    over++;
    for (const auto& f : process_families())
      for (const auto& part : f.parts) other.*part.field += p->*part.field;
  }

  std::string out;
  out.reserve(256 + own.size() * 900);
  for (const auto& f : process_families()) {
    if (f.faults && !s.faults) continue;
    header(out, f.name, f.type, f.help);
    auto emit = [&](const std::string& who, const ProcessSample& p) {
      for (const auto& part : f.parts)
        sample(out, f.name, part.by ? who + "," + label("by", part.by) : who, p.*part.field);
    };
    for (const auto* p : own) {
      std::string who = label("pid", std::to_string(p->pid)) + "," + label("comm", p->comm);
      if (!p->cgroup.empty()) who += "," + label("cgroup", p->cgroup);
      if (!p->container_id.empty()) who += "," + label("container_id", p->container_id);
      emit(who, *p);
    }
    if (over && f.summed) emit(label("pid", "other") + "," + label("comm", "other"), other);
  }

  header(out, "memtrace_processes_exported", "gauge", "Processes with series of their own.");
  sample(out, "memtrace_processes_exported", "", own.size());
  header(out, "memtrace_processes_over_cap", "gauge",
         "Processes summed into the pid=\"other\" series (over --metrics-max-processes).");
  sample(out, "memtrace_processes_over_cap", "", over);
  header(out, "memtrace_dropped_total", "counter",
         "What was lost, by cause: the report's DROPPED line (events, or attaches for attach_failed).");
  for (const auto& [k, v] : s.drops.dropped) sample(out, "memtrace_dropped_total", label("kind", k), v);
  for (const auto& st : kStats) {
    auto it = s.drops.stats.find(st.key);
    if (it == s.drops.stats.end()) continue;
    header(out, st.name, st.type, st.help);
    sample(out, st.name, "", it->second * st.scale);
  }
  header(out, "memtrace_stat", "untyped", "The report's other STATS counters, by name (units as in the name).");
  for (const auto& [k, v] : s.drops.stats) {
    if (std::any_of(std::begin(kStats), std::end(kStats), [&](const Stat& st) { return k == st.key; })) continue;
    sample(out, "memtrace_stat", label("name", k), v);
  }
  header(out, "memtrace_snapshot_age_seconds", "gauge",
         "How old the data of this scrape is (the drain thread takes it when asked).");
  char age_text[32];
  snprintf(age_text, sizeof age_text, "%.6f", age.count());
  out += "memtrace_snapshot_age_seconds ";
  out += age_text;
  out += '\n';
  return out;
}

}  // namespace memtrace::metrics
