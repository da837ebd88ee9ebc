#include "report/outputs.h"

#include <time.h>

#include <algorithm>

#include "report/folded.h"
#include "report/html.h"
#include "report/pprof.h"

namespace memtrace::report {

const char* to_string(Format f) {
  switch (f) {
    case Format::Text: return "text";
    case Format::Json: return "json";
    case Format::Folded: return "folded";
    case Format::Pprof: return "pprof";
    case Format::Html: return "html";
  }
  return "?";
}

std::optional<Format> format_named(const std::string& n) {
  for (Format f : {Format::Text, Format::Json, Format::Folded, Format::Pprof, Format::Html})
    if (n == to_string(f)) return f;
  return std::nullopt;
}

std::optional<Format> format_of_extension(const std::string& path) {
  auto ends = [&](const char* ext) {
    std::string e(ext);
    return path.size() > e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (ends(".json")) return Format::Json;
  if (ends(".txt")) return Format::Text;
  if (ends(".folded")) return Format::Folded;
  if (ends(".pb.gz")) return Format::Pprof;
  if (ends(".html")) return Format::Html;
  return std::nullopt;
}

Result<std::vector<OutputSpec>> plan_outputs(const std::vector<std::string>& paths, const std::string& format) {
  std::optional<Format> given;
  if (!format.empty()) {
    given = format_named(format);
    if (!given) return Error::msg("--format " + format + ": not one of text, json, folded, pprof, html");
  }
  std::vector<OutputSpec> out;
  if (paths.empty()) {
    Format f = given.value_or(Format::Text);
    if (f == Format::Pprof) return Error::msg("--format pprof is binary (gzip): name a file with -o FILE.pb.gz");
    out.push_back({"", f});
    return out;
  }
  for (const auto& p : paths) {
    if (p.empty()) return Error::msg("-o: empty file name");
    auto ext = format_of_extension(p);
    Format f;
    if (given) {
      if (paths.size() > 1 && ext && *ext != *given)
        return Error::msg(p + ": --format " + format + " and the extension name different formats; without "
                          "--format each file's extension chooses its format");
      f = *given;
    } else if (ext) {
      f = *ext;
    } else if (paths.size() == 1) {
      f = Format::Text;
    } else {
      return Error::msg(p + ": unknown extension: several -o files need .json, .txt, .folded, .pb.gz or .html (or --format)");
    }
    out.push_back({p, f});
  }
  for (size_t i = 0; i < out.size(); i++)
    for (size_t j = 0; j < i; j++)
      if (out[i].path == out[j].path) return Error::msg("-o " + out[i].path + " given twice");
  return out;
}

std::optional<FoldedValue> folded_value_named(const std::string& n) {
  if (n == "live_bytes") return FoldedValue::LiveBytes;
  if (n == "alloc_bytes") return FoldedValue::AllocBytes;
  if (n == "alloc_count") return FoldedValue::AllocCount;
  if (n == "live_blocks") return FoldedValue::LiveBlocks;
  return std::nullopt;
}

const OutputSpec* primary_output(const std::vector<OutputSpec>& outs) {
  for (const auto& o : outs)
    if (o.format == Format::Text || o.format == Format::Json) return &o;
  return nullptr;
}

std::vector<StackCounts> stack_counts(const heap::Process& p) {
  // The model keeps each stack's live bytes and blocks beside its
  // allocations (heap::StackAllocs): one entry per stack, no pass over the
  // live blocks (a periodic profile of a process with 160,000 stacks spent
  // a quarter of its time in that pass and a std::map).
  std::vector<StackCounts> v;
  v.reserve(p.stack_allocs.size());
  for (const auto& [id, sa] : p.stack_allocs)
    if (sa.live_bytes || sa.live_blocks || sa.bytes || sa.allocs)
      v.push_back({id, sa.live_bytes, sa.live_blocks, sa.bytes, sa.allocs, sa.python});
  std::sort(v.begin(), v.end(), [](const StackCounts& a, const StackCounts& b) { return a.stack_id < b.stack_id; });
  return v;
}

Result<void> write_profile(std::ostream& os, Format f, const heap::HeapModel& m, const Resolver& r,
                           const Options& o, const ProfileOptions& po) {
  if (f == Format::Folded) {
    write_folded(os, m, r, o, po.folded);
  } else if (f == Format::Pprof) {
    PprofOptions pp;
    pp.build_id = po.build_id;
    pp.duration_nanos = po.duration_nanos;
    timespec now{};
    clock_gettime(CLOCK_REALTIME, &now);
    pp.time_nanos = now.tv_sec * 1000000000LL + now.tv_nsec;
    if (auto w = write_pprof(os, m, r, o, pp); !w) return w;
  } else if (f == Format::Html) {
    HtmlOptions ho;
    ho.duration_nanos = po.duration_nanos;
    if (auto w = write_html(os, m, r, o, ho); !w) return w;
  } else {
    return Error::msg(std::string("not a profile format: ") + to_string(f));
  }
  os.flush();
  if (!os) return Error::msg("write failed");
  return {};
}

}  // namespace memtrace::report
