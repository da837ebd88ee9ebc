#include "loader/pprof_dir.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <iostream>

#include "loader/recording.h"  // build_id_of
#include "report/pprof.h"

namespace memtrace::loader {
namespace {

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

uint64_t us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

// Did the image allocate, free or map anything itself? (A fork's child that
// only holds its parent's blocks until its exec is not a profile of its own;
// nor is the tool's own code in the launched child before the exec.)
bool has_own_activity(const heap::Process& p) {
  return !p.prelude && (p.s.allocs || p.s.frees || p.s.failed_allocs || p.s.mmap_calls || p.s.unknown_frees ||
                        p.f.total);
}

constexpr size_t kMaxErrors = 10;  // distinct write errors kept for the report

// The key of a stack's alloc base: its frames as addresses in p, hashed.
// Stack ids do not last: an image that ends is sealed (heap_model.h), its
// stacks get other ids, while its frames keep their addresses
// (report::for_each_frame gives the same for a raw and a sealed stack).
uint64_t frames_key(const heap::HeapModel& m, const heap::Process& p, uint64_t id) {
  const heap::Stack* st = id ? m.stack(id) : nullptr;
  if (!st) return id;  // no stack, or one never received: the id stays as it is
  uint64_t h = 0x9e3779b97f4a7c15ull ^ st->truncated;
  report::for_each_frame(p, *st, [&](uint64_t addr, const heap::Loc*) {
    h = (h ^ addr) * 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  });
  return h;
}

}  // namespace

Result<std::unique_ptr<PprofDir>> PprofDir::open(const PprofDirOptions& o) {
  auto d = open_output_dir(o.dir);
  if (!d) return Error::msg("--pprof-dir " + o.dir + ": " + d.error().message);
  auto p = std::unique_ptr<PprofDir>(new PprofDir(o, std::move(*d)));
  p->started_ns_ = realtime_ns();
  return p;
}

std::string PprofDir::file_name(const std::string& comm, pid_t pid, uint32_t image, int64_t unix_ns) {
  std::string c;
  for (char ch : comm)
    c += (isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_') ? ch : '_';  // safe in a URL too
  if (c.empty()) c = "unknown";
  if (c[0] == '.') c[0] = '_';  // never a hidden file (uploaders' *.pb.gz skip those, and our temporaries)
  time_t secs = static_cast<time_t>(unix_ns / 1000000000LL);
  tm t{};
  gmtime_r(&secs, &t);
  char when[40];
  snprintf(when, sizeof when, "%04d%02d%02dT%02d%02d%02d.%03dZ", t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour,
           t.tm_min, t.tm_sec, static_cast<int>(unix_ns / 1000000 % 1000));
  std::string id = std::to_string(pid);
  if (image) id += "." + std::to_string(image);
  return c + "-" + id + "-" + when + ".pb.gz";
}

void PprofDir::error(const std::string& e) {
  write_errors_++;
  if (write_errors_ == 1) std::cerr << "memtrace-bpf: --pprof-dir: " << e << "\n";
  if (errors_.size() < kMaxErrors && error_set_.insert(e).second) errors_.push_back("--pprof-dir: " + e);
}

void PprofDir::write(const heap::HeapModel& m, const report::Resolver& r, const report::Options& ro,
                     const heap::Process& p, int64_t now_ns, bool last, RoundStats& rs) {
  auto t0 = std::chrono::steady_clock::now();
  Key k = key_of(p);
  Image& img = images_[k];
  report::PprofOptions po;
  po.build_id = [this](const std::string& module) -> std::string {
    auto [it, added] = build_ids_.try_emplace(module);
    if (added) it->second = build_id_of(module);
    return it->second;
  };
  po.time_nanos = now_ns;
  po.duration_nanos = now_ns - (img.last_ns ? img.last_ns : started_ns_);
  po.only = &p;
  // The previous file's counts, by this image's stack ids now.
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> base;
  struct Now {
    uint64_t key, allocs, bytes;
  };
  std::vector<Now> now;
  now.reserve(p.stack_allocs.size());
  for (const auto& [id, sa] : p.stack_allocs) {
    uint64_t key = frames_key(m, p, id);
    now.push_back({key, sa.allocs, sa.bytes});
    if (auto b = img.base.find(key); b != img.base.end()) base.emplace(id, b->second);
  }
  po.alloc_base = &base;
  std::string first = file_name(p.comm, p.pid, p.image, now_ns), name = first;
  // Two images with one name in a round (a pid reused under the same name
  // within S seconds): the second is "...Z_2.pb.gz".
  for (int n = 2; round_names_.count(name); n++)
    name = first.substr(0, first.size() - 6) + "_" + std::to_string(n) + ".pb.gz";
  bool ok = false;
  std::string profile = report::pprof_profile(m, r, ro, po);
  auto t1 = std::chrono::steady_clock::now();
  rs.profile_us += std::chrono::duration_cast<std::chrono::microseconds>(t1 - t0).count();
  auto z = report::gzip(profile);
  profile = std::string();
  rs.gzip_us += us_since(t1);
  auto t2 = std::chrono::steady_clock::now();
  if (!z) {
    error(dir_.path + "/" + name + ": " + z.error().message);
  } else if (auto w = write_output_atomic(dir_, name, *z, Privacy::Shared); !w) {
    error(w.error().message);
  } else {
    ok = true;
    rs.files++;
    rs.bytes += z->size();
    round_names_.insert(name);
    files_.emplace_back(round_, name);
    files_written_++;
    bytes_written_ += z->size();
    file_bytes_max_ = std::max<uint64_t>(file_bytes_max_, z->size());
  }
  if (last) {
    done_.insert(k);
    images_.erase(k);
  } else if (ok) {
    // The next file counts the allocations from here (a file that failed
    // leaves its allocations to the next one).
    for (const Now& n : now) img.base[n.key] = {n.allocs, n.bytes};
    img.last_ns = now_ns;
  }
  rs.write_us += us_since(t2);
  file_us_max_ = std::max(file_us_max_, us_since(t0));
}

void PprofDir::rotate() {
  while (!files_.empty() && files_.front().first + o_.keep <= round_) {
    // The name only: a link put in its place is removed, never followed.
    if (unlinkat(dir_.fd.get(), files_.front().second.c_str(), 0) == 0) files_removed_++;
    files_.pop_front();
  }
}

PprofDir::RoundStats PprofDir::round(const heap::HeapModel& m, const report::Resolver& r, const report::Options& ro,
                                     bool final, const std::function<void()>& between) {
  auto t0 = std::chrono::steady_clock::now();
  RoundStats rs;
  int64_t now_ns = realtime_ns();
  round_++;
  round_names_.clear();
  // Running: the current image of each pid that has not exited. Every other
  // image gets its last file, once (at the end: every image).
  std::vector<pid_t> running;
  std::set<const heap::Process*> current;
  if (!final)
    for (const auto& [pid, p] : m.processes())
      if (!p->exited) {
        running.push_back(pid);
        current.insert(p.get());
      }
  // (A merged entry, --max-images, sums images that had files of their own.)
  for (const heap::Process* p : m.images())
    if (!current.count(p) && !p->merged && has_own_activity(*p) && !done_.count(key_of(*p)))
      write(m, r, ro, *p, now_ns, true, rs);
  for (pid_t pid : running) {
    // Looked up again: between() may have applied its exit or exec (then
    // the next round writes its last file).
    auto it = m.processes().find(pid);
    if (it == m.processes().end() || it->second->exited || !has_own_activity(*it->second)) continue;
    write(m, r, ro, *it->second, now_ns, false, rs);
    if (between) {
      auto tb = std::chrono::steady_clock::now();
      between();
      rs.between_us += us_since(tb);
    }
  }
  // An image the model no longer lists (merged past --max-images, or gone
  // with its sealing) has no file to come: its key goes too (a daemon over
  // short processes added one a process, for good).
  {
    std::set<Key> listed;
    for (const heap::Process* p : m.images()) listed.insert(key_of(*p));
    for (auto it = done_.begin(); it != done_.end();) it = listed.count(*it) ? std::next(it) : done_.erase(it);
  }
  rotate();
  uint64_t us = us_since(t0);
  round_us_max_ = std::max(round_us_max_, us);
  round_us_total_ += us;
  rs.us = us;
  return rs;
}

void PprofDir::add_stats(std::map<std::string, uint64_t>& s) const {
  s["pprof_dir_rounds"] = round_;
  s["pprof_dir_files"] = files_written_;
  s["pprof_dir_files_removed"] = files_removed_;
  s["pprof_dir_bytes"] = bytes_written_;
  s["pprof_dir_file_bytes_max"] = file_bytes_max_;
  s["pprof_dir_write_errors"] = write_errors_;
  s["pprof_dir_round_us_max"] = round_us_max_;
  s["pprof_dir_round_us_total"] = round_us_total_;
  s["pprof_dir_file_us_max"] = file_us_max_;
}

}  // namespace memtrace::loader
