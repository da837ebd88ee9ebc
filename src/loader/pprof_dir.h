// Continuous profiles (issue 19): --pprof-dir DIR --pprof-every S writes a
// pprof (report/pprof.h, the -o .pb.gz format) per traced process every S
// seconds while tracing and once at the end, for Pyroscope, Parca or any
// uploader that picks files up from DIR.
//
// * One file per process image and round, "COMM-PID-TIME.pb.gz" (an image
//   after an exec: "COMM-PID.N-TIME.pb.gz"; TIME is the round's UTC time,
//   20261124T174801.123Z; COMM keeps [A-Za-z0-9._], the rest is '_', and
//   never starts with a dot). Running images get one every round; an image that ended (exit,
//   exec) gets its last one in the next round, and none after.
// * inuse_* are the image's live blocks at the round (the last file's equal
//   the final report's); alloc_* are the allocations since the image's
//   previous file (what continuous profilers sum over time, as Go's delta
//   profiles): over every file of an image they add up to its totals.
// * Files are written atomically (output_file.h: a temporary, then rename);
//   the files of the newest --pprof-keep rounds are kept, older ones this run
//   wrote are removed (nothing else in DIR is touched).
// * The drain thread writes them (the model is its own): the ring is drained
//   before each round and after each file; the STATS pprof_dir_* say how
//   long rounds and files took.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/result.h"
#include "heap/heap_model.h"
#include "loader/output_file.h"
#include "report/report.h"

namespace memtrace::loader {

struct PprofDirOptions {
  std::string dir;     // --pprof-dir
  double every = 10;   // --pprof-every, seconds
  size_t keep = 10;    // --pprof-keep: rounds of files kept
};

class PprofDir {
 public:
  // DIR created if missing and proven writable (output_file.h); the error
  // is one line ("--pprof-dir /x: ...").
  static Result<std::unique_ptr<PprofDir>> open(const PprofDirOptions& o);

  // One round: a file per running image with anything to show, and the last
  // file of each image that ended since (final: the end of tracing, every
  // image's last file). between() runs after each file (the drain).
  // What one round did (-v logs it).
  struct RoundStats {
    uint64_t files = 0, bytes = 0;
    uint64_t us = 0;                                  // the whole round
    uint64_t profile_us = 0, gzip_us = 0, write_us = 0;  // its files: encode (symbolize), compress, write
    uint64_t between_us = 0;                          // in between() (draining)
  };
  RoundStats round(const heap::HeapModel& m, const report::Resolver& r, const report::Options& ro, bool final,
                   const std::function<void()>& between = {});

  const PprofDirOptions& options() const { return o_; }
  // pprof_dir_* counters for the report's STATS.
  void add_stats(std::map<std::string, uint64_t>& stats) const;
  // Write failures, one per distinct message (for the report's errors).
  const std::vector<std::string>& errors() const { return errors_; }

  // "COMM-PID[.IMAGE]-TIME.pb.gz" (exposed for tests).
  static std::string file_name(const std::string& comm, pid_t pid, uint32_t image, int64_t unix_ns);

 private:
  explicit PprofDir(PprofDirOptions o, OutputDir d) : o_(std::move(o)), dir_(std::move(d)) {}
  using Key = std::tuple<pid_t, uint32_t, uint64_t>;  // pid, image, first_ts: one image
  struct Image {
    // Allocations and bytes counted by its files so far, by stack (the
    // stack's frames, hashed: they survive the sealing of an ended image).
    std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> base;
    int64_t last_ns = 0;  // CLOCK_REALTIME of its previous file
  };
  static Key key_of(const heap::Process& p) { return {p.pid, p.image, p.first_ts}; }
  void write(const heap::HeapModel& m, const report::Resolver& r, const report::Options& ro,
             const heap::Process& p, int64_t now_ns, bool last, RoundStats& rs);
  void rotate();
  void error(const std::string& e);

  PprofDirOptions o_;
  OutputDir dir_;
  int64_t started_ns_ = 0;                      // the first round's period starts here
  uint64_t round_ = 0;                          // rounds done
  std::map<Key, Image> images_;                 // images written while running
  std::set<Key> done_;                          // images whose last file is written
  std::deque<std::pair<uint64_t, std::string>> files_;  // (round, name) of the files kept, oldest first
  std::set<std::string> round_names_;           // written in this round
  std::unordered_map<std::string, std::string> build_ids_;  // module -> build-id (read once)
  std::vector<std::string> errors_;
  std::set<std::string> error_set_;
  // STATS
  uint64_t files_written_ = 0, bytes_written_ = 0, files_removed_ = 0, write_errors_ = 0;
  uint64_t round_us_max_ = 0, round_us_total_ = 0, file_us_max_ = 0;
  uint64_t file_bytes_max_ = 0;

 public:
  PprofDir(const PprofDir&) = delete;
  PprofDir& operator=(const PprofDir&) = delete;
};

}  // namespace memtrace::loader
