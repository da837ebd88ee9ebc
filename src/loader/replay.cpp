// `memtrace-bpf replay FILE`: the report of a --record file, symbolized
// against the files on disk (matched by build-id where the recording has one),
// the --symbols DIRs and, for binaries and debug files missing here, the
// debuginfod servers in DEBUGINFOD_URLS.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "heap/heap_model.h"
#include "loader/features.h"
#include "loader/output_file.h"
#include "loader/recording.h"
#include "loader/resolver.h"
#include "memtrace.h"
#include "report/report.h"
#include "symbolize/debuginfod.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {
namespace {

// "0a1b..." -> raw bytes (recordings keep build-ids in hex); "" if not hex.
std::string unhex(const std::string& h) {
  auto nib = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    int a = nib(h[i]), b = nib(h[i + 1]);
    if (a < 0 || b < 0) return "";
    out += static_cast<char>(a * 16 + b);
  }
  return out;
}

class ReplayResolver {
 public:
  ReplayResolver(const symbolize::Options& o, bool open_files)
      : sym_(o), dirs_(o.symbol_dirs), open_files_(open_files), debuginfod_(o.debuginfod) {}

  void add(pid_t pid, const nlohmann::json& m) {
    std::string path = m.value("path", "");
    uint64_t start = m.value("start", 0ull), end = m.value("end", 0ull), off = m.value("offset", 0ull);
    if (!added_[pid].insert({start, end, off, path}).second) return;
    SpaceNode& n = node(pid);
    if (path.empty() || path[0] != '/') return;  // anonymous code: left unknown
    symbolize::MappingInfo mi;
    mi.start = start;
    mi.end = end;
    mi.offset = off;
    mi.dev = m.value("dev", 0ull);
    mi.inode = m.value("inode", 0ull);
    mi.perms = m.value("perms", "");
    mi.path = path;
    sym_.add_mapping(n.as, mi, locate(path, m.value("build_id", ""), mi.dev, mi.inode));
  }
  // The child's addresses not in its own recorded mappings are its parent's.
  void inherit(pid_t parent, pid_t child) {
    node(parent);
    node(child).parent = spaces_[parent];
  }

  // A piece of pid's perf map (REC_PERFMAP), in order.
  void perf_text(pid_t pid, const std::string& text) { jit_[pid].feed(text); }

  std::vector<report::FrameOut> resolve(const heap::Process& p, uint64_t addr, const heap::Loc* loc, bool ret) {
    if (addr & heap::kPyFrameTag) return {python_frame(&py_, addr)};
    auto jit = jit_.find(p.pid);
    auto named = [&](uint64_t at) -> std::optional<report::FrameOut> {
      if (jit == jit_.end()) return std::nullopt;
      jit->second.finish();
      return jit_frame(jit->second, at, ret, "/tmp/perf-" + std::to_string(p.pid) + ".map");
    };
    if (loc) {
      if (sym_.is_anonymous_module(loc->module))
        if (auto f = named(loc->offset)) return {*f};
      return location_frames(sym_, *loc, addr, ret);
    }
    auto it = spaces_.find(p.pid);
    auto out = resolve_frames(sym_, it == spaces_.end() ? nullptr : it->second.get(), addr, ret,
                              "process mappings not in the recording");
    if (jit_candidate(out))
      if (auto f = named(addr)) return {*f};
    return out;
  }
  report::Resolver fn() {
    return [this](const heap::Process& p, uint64_t a, const heap::Loc* l, bool r) { return resolve(p, a, l, r); };
  }
  heap::Locator locator() {
    return [this](const heap::Process& p) {
      auto it = spaces_.find(p.pid);
      heap::ImageMap m = image_map(sym_, it == spaces_.end() ? nullptr : it->second.get());
      if (auto j = jit_.find(p.pid); j != jit_.end() && (j->second.finish(), j->second.size())) mark_jit(sym_, m);
      return m;
    };
  }
  const std::vector<std::string>& notes() const { return notes_; }
  python::FrameTable py_;  // REC_PYFRAME records

 private:
  // The file to read for a recorded mapping: one with the recorded build-id
  // (--symbols DIR first, then the recorded path); without a build-id, the
  // recorded path. "" (left unsymbolized) when missing or changed.
  std::string locate(const std::string& path, const std::string& bid, uint64_t dev, uint64_t inode) {
    std::string base = path.substr(path.rfind('/') + 1);
    if (!open_files_) return "/nonexistent/" + base;
    auto memo = located_.find(path + "\n" + bid);
    if (memo != located_.end()) return memo->second;
    std::vector<std::string> cands;
    for (const auto& d : dirs_) {
      if (bid.size() > 2) cands.push_back(d + "/.build-id/" + bid.substr(0, 2) + "/" + bid.substr(2));
      cands.push_back(d + path);
      cands.push_back(d + "/" + base);
    }
    cands.push_back(path);
    std::string found, note;
    struct stat st;
    if (!bid.empty()) {
      for (const auto& c : cands)
        if (::stat(c.c_str(), &st) == 0 && S_ISREG(st.st_mode) && build_id_of(c) == bid) {
          found = c;
          break;
        }
      if (found.empty() && open_files_ && debuginfod_)
        if (auto got = symbolize::Debuginfod::get().find(unhex(bid), "executable", path); got.fd.valid() &&
            build_id_of(got.path) == bid)
          found = got.path;
      if (found.empty()) {
        if (::stat(path.c_str(), &st) == 0)
          note = path + " changed since the recording (build-id " + build_id_of(path) + ", recorded " + bid +
                 "): its frames are left unsymbolized; give the original with --symbols DIR";
        else
          note = path + " (build-id " + bid + ") is missing: its frames are left unsymbolized; give it with --symbols DIR";
      } else if (found != path) {
        note = path + ": symbolized with " + found + " (same build-id)";
      }
    } else {
      for (const auto& c : cands)
        if (::stat(c.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
          found = c;
          break;
        }
      if (found.empty())
        note = path + " is missing (no build-id recorded): its frames are left unsymbolized";
      else if (found == path && (static_cast<uint64_t>(st.st_ino) != inode || static_cast<uint64_t>(st.st_dev) != dev))
        note = path + " has no build-id and is not the recorded file (device/inode differ): symbolized as is, "
                      "frames may be wrong";
    }
    if (!note.empty()) notes_.push_back(note);
    located_[path + "\n" + bid] = found.empty() ? "/nonexistent/" + base : found;
    return located_[path + "\n" + bid];
  }

  symbolize::Symbolizer sym_;
  std::vector<std::string> dirs_;
  bool open_files_;
  bool debuginfod_;
  SpaceNode& node(pid_t pid) {
    auto& n = spaces_[pid];
    if (!n) n = std::make_shared<SpaceNode>();
    return *n;
  }

  AddressSpaces spaces_;
  std::map<pid_t, std::set<std::tuple<uint64_t, uint64_t, uint64_t, std::string>>> added_;
  std::map<std::string, std::string> located_;
  std::vector<std::string> notes_;
  std::map<pid_t, symbolize::PerfMap> jit_;  // JIT code names (REC_PERFMAP)
};

}  // namespace

int replay_model(std::istream& in, const ReplayOptions& o, std::ostream& err, bool open_files,
                 const std::function<int(const Replayed&)>& use) {
  symbolize::Options so;
  so.symbol_dirs = o.symbol_dirs;
  so.dwarf = o.dwarf;
  if (!open_files) {  // no debug-file lookups either
    so.debug_root = "/nonexistent";
    so.debuginfod = false;
  }
  ReplayResolver res(so, open_files);
  heap::HeapModel model;
  nlohmann::json meta, end;
  bool system_wide = false;
  uint64_t last_ts = 0;
  std::vector<pid_t> exit_order;
  // cgroups from mappings records whose process the model has not met yet
  // (given to it at its first event or fork/exec record).
  std::map<pid_t, std::string> cgroup_of;
  auto give_cgroup = [&](pid_t pid) {
    auto it = cgroup_of.find(pid);
    if (it == cgroup_of.end()) return;
    if (heap::Process* p = model.find(pid)) {
      if (p->cgroup.empty()) p->cgroup = it->second;
      cgroup_of.erase(it);
    }
  };
  // Ended images sealed and merged past the cap as the tracer did (at the
  // end: an exit in the recording may precede its process's last records,
  // which the tracer ordered by the events ring's position).
  model.set_locator(res.locator(), o.live);
  auto on_meta = [&](const nlohmann::json& m) {
    system_wide = m.value("system_wide", false);
    model.set_image_cap(m.value("max_images", size_t{256}));
  };
  // read_recording checked each record's size, kinds and JSON fields.
  auto rf = read_recording(in, on_meta, [&](const Record& r) {
    const std::vector<char>& p = r.payload;
    switch (r.type) {
      case REC_EVENT: {
        mt_hdr h;
        memcpy(&h, p.data(), sizeof h);
        last_ts = std::max<uint64_t>(last_ts, h.ts);
        model.apply(p.data(), p.size());
        if (!cgroup_of.empty()) give_cgroup(h.pid);
        break;
      }
      case REC_PROC: {
        mt_proc_event e;
        memcpy(&e, p.data(), sizeof e);
        pid_t pid = e.h.pid;
        std::string comm(e.comm, strnlen(e.comm, sizeof e.comm));
        // As the tracer applied them (Tracer::on_proc_event).
        if (e.h.kind == MT_EV_EXEC) {
          model.on_exec(pid, e.addr ? e.addr : e.h.ts);  // nothing if the events stream's MT_EV_EXEC started it
          model.process(pid).comm = comm;
          give_cgroup(pid);
        } else if (e.h.kind == MT_EV_FORK) {
          model.on_fork(e.ppid, pid);
          res.inherit(e.ppid, pid);
          model.process(pid).comm = comm;
          give_cgroup(pid);
        } else if (e.h.kind == MT_EV_EXIT) {
          if (e.exit_code >= 0 && (model.find(pid) || system_wide)) {
            model.on_exit(pid, e.exit_code);
            exit_order.push_back(pid);
          }
        }
        break;
      }
      case REC_MAPS: {
        pid_t pid = r.json["pid"].get<pid_t>();
        for (const auto& m : r.json["maps"]) res.add(pid, m);
        if (auto cg = r.json.find("cgroup"); cg != r.json.end()) {
          cgroup_of[pid] = cg->get<std::string>();
          give_cgroup(pid);
        }
        break;
      }
      case REC_PERFMAP:
        res.perf_text(r.json["pid"].get<pid_t>(), r.json["text"].get<std::string>());
        break;
      case REC_PYFRAME:
        res.py_.put(r.json["id"].get<uint32_t>(), python::PyFrame{r.json["function"].get<std::string>(),
                                                                  r.json["file"].get<std::string>(),
                                                                  r.json["line"].get<int>()});
        break;
      case REC_END:
        end = r.json;
        break;
    }
  });
  meta = rf.meta;
  if (!rf.header_ok()) {
    err << "memtrace-bpf: replay " << o.file << ": " << rf.error << "\n";
    return 2;
  }
  if (end.is_object()) {
    // The final state the tracer knew (comm from /proc, the launched program's waitpid status).
    for (const auto& jp : end.value("processes", nlohmann::json::array())) {
      heap::Process& p = model.process(jp["pid"].get<pid_t>());
      p.comm = jp.value("comm", p.comm);
      if (p.cgroup.empty()) p.cgroup = jp.value("cgroup", std::string());
      if (jp.value("ppid", 0)) p.ppid = jp["ppid"].get<pid_t>();
      if (jp.value("exited", false)) {
        p.exited = true;
        if (auto st = jp.find("exit_status"); st != jp.end() && st->is_number_integer()) p.exit_code = st->get<int>();
      }
    }
  }
  // Every process that exited ends its image, as in the tracer's final
  // report, except those the end record lists (the tracer kept them current:
  // the launched program, its waitpid status the report's). A recording cut
  // short keeps them all (which ones the tracer kept is not known).
  if (end.is_object()) {
    std::set<pid_t> kept;
    for (const auto& jp : end.value("processes", nlohmann::json::array())) kept.insert(jp["pid"].get<pid_t>());
    for (pid_t pid : exit_order)  // in the order they exited: merging takes the oldest first, as live
      if (!kept.count(pid)) model.retire(pid, !system_wide);  // (false: the pid's later process lives on)
  }
  model.finish_seals();
  report::Drops d;
  if (end.is_object()) {
    for (auto& [k, v] : end["dropped"].items()) d.dropped[k] = v.get<uint64_t>();
    for (auto& [k, v] : end["stats"].items()) d.stats[k] = v.get<uint64_t>();
  } else {
    // What the recording itself says; the BPF-side counters were in the end record.
    d.dropped["stack_record_missing"] = model.missing_stacks();
    d.dropped["malformed"] = model.malformed_records();
    d.stats["events"] = model.event_count();
  }
  d.stats["replay_records"] = rf.records;
  return use(Replayed{model, res.fn(), d, rf, meta, end, res.notes(), last_ts});
}

namespace {

// replay's reports (text, JSON, profiles) of a replayed recording.
int write_reports(const Replayed& r, const ReplayOptions& o, std::ostream& os, std::ostream& err, bool open_files,
                  const MoreOutputs& more) {
  // Plain references, not a structured binding: clang 14 (the fuzzer's)
  // does not let the lambdas below capture those.
  heap::HeapModel& model = r.model;
  const report::Resolver& rfn = r.resolve;
  const report::Drops& d = r.drops;
  const RecordedFile& rf = r.file;
  const nlohmann::json &meta = r.meta, &end = r.end;
  const std::vector<std::string>& notes = r.notes;
  const uint64_t last_ts = r.last_ts;
  report::Options ro;
  ro.top = o.top;
  ro.at_exit = true;
  ro.include_idle = meta.value("include_idle", true);
  ro.stats = o.verbose;
  LiveOptions lo;
  lo.max = o.live_max;
  lo.readable = false;
  lo.now_ns = end.is_object() ? end.value("mono_ns", last_ts) : last_ts;
  std::vector<std::string> errors;
  if (end.is_object())
    for (const auto& e : end.value("errors", nlohmann::json::array())) errors.push_back(e.get<std::string>());
  std::optional<nlohmann::json> j;
  auto write_report = [&](std::ostream& os, bool json) {
    if (json) {
      if (!j) {
        j = report::to_json(model, rfn, ro, d);
        if (o.live)
          for (auto& jp : (*j)["processes"])
            if (auto* p = model.find(jp["pid"].get<pid_t>())) add_live_json(jp, model, rfn, *p, lo);
        (*j)["errors"] = errors;
        (*j)["notes"] = notes;
        (*j)["replay"] = {{"file", o.file}, {"records", rf.records}, {"complete", rf.error.empty()}};
        if (!rf.error.empty()) {
          (*j)["replay"]["error"] = rf.error;
          (*j)["replay"]["error_offset"] = rf.error_offset;
        }
        if (meta.contains("command")) (*j)["replay"]["command"] = meta["command"];
      }
      // comms and symbol names are bytes, not always UTF-8.
      os << report::json_text(*j, 2) << "\n";
    } else {
      report::write_text(os, model, rfn, ro, d);
      if (o.live)
        for (const auto& [pid, p] : model.processes())
          if (!p->live.empty()) write_live_text(os, model, rfn, *p, lo);
      for (const auto& e : errors) os << "error: " << e << "\n";
      for (const auto& n : notes) os << "note: " << n << "\n";
      os << "REPLAY: " << o.file << ", " << rf.records << " records";
      if (!rf.error.empty()) os << " (incomplete: stopped at offset " << rf.error_offset << ")";
      os << "\n";
    }
    os.flush();
  };
  // The primary output (text or JSON) unless only profiles were asked for;
  // then every other -o file from the same model (report/outputs.h).
  if (o.outputs.empty() || report::primary_output(o.outputs)) write_report(os, o.format == "json");
  report::ProfileOptions po;
  po.folded = o.folded_value;
  if (open_files) po.build_id = [](const std::string& path) { return build_id_of(path); };
  uint64_t start_ns = meta.is_object() ? meta.value("start_mono_ns", uint64_t(0)) : 0;
  if (start_ns && lo.now_ns > start_ns) po.duration_nanos = static_cast<int64_t>(lo.now_ns - start_ns);
  int code = 0;
  for (const auto& [spec, out] : more) {
    if (spec.format == report::Format::Text || spec.format == report::Format::Json) {
      write_report(*out, spec.format == report::Format::Json);
    } else if (auto w = report::write_profile(*out, spec.format, model, rfn, ro, po); !w) {
      err << "memtrace-bpf: replay: cannot write " << spec.path << ": " << w.error().message << "\n";
      code = 2;
    }
  }
  if (!rf.error.empty()) {
    err << "memtrace-bpf: replay " << o.file << ": " << rf.error << "; the report covers the " << rf.records
        << " records before it\n";
    return 1;
  }
  return code;
}

}  // namespace

int replay_recording(std::istream& in, const ReplayOptions& o, std::ostream& os, std::ostream& err,
                     bool open_files, const MoreOutputs& more) {
  return replay_model(in, o, err, open_files,
                      [&](const Replayed& r) { return write_reports(r, o, os, err, open_files, more); });
}

int replay(const ReplayOptions& o) {
  std::ifstream in;
  struct stat st;
  if (::stat(o.file.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) errno = EISDIR;
  else in.open(o.file, std::ios::binary);
  if (!in.is_open()) {
    std::cerr << "memtrace-bpf: replay " << o.file << ": cannot open: " << strerror(errno) << "\n";
    return 2;
  }
  // Every -o file through output_file.h (never through a symbolic link).
  std::unique_ptr<std::ofstream> primary_file;
  std::vector<std::unique_ptr<std::ofstream>> files;
  MoreOutputs more;
  const report::OutputSpec* primary = report::primary_output(o.outputs);
  for (const auto& spec : o.outputs) {
    bool text = spec.format == report::Format::Text || spec.format == report::Format::Json;
    if (spec.path.empty()) {  // no -o: stdout
      if (!text) more.emplace_back(spec, &std::cout);
      continue;
    }
    auto f = open_output(spec.path, Privacy::Shared, text ? std::ios::out : std::ios::out | std::ios::binary);
    if (!f) {
      std::cerr << "memtrace-bpf: " << f.error().message << "\n";
      return 2;
    }
    if (&spec == primary) {
      primary_file = std::move(*f);
    } else {
      more.emplace_back(spec, f->get());
      files.push_back(std::move(*f));
    }
  }
  return replay_recording(in, o, primary_file ? *primary_file : std::cout, std::cerr, true, more);
}

}  // namespace memtrace::loader
