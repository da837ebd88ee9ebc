// Debug files by build-id from the servers in DEBUGINFOD_URLS, as gdb, perf
// and valgrind fetch them: through elfutils' libdebuginfod, with its cache
// (DEBUGINFOD_CACHE_PATH, else ~/.cache/debuginfod_client) and its other
// variables (DEBUGINFOD_MAXSIZE, DEBUGINFOD_VERBOSE, ...).
//
// Each query runs in a child process, memtrace-debuginfod (tools/
// debuginfod_helper.cpp), next to the tool: a small dynamically linked program
// that dlopens libdebuginfod.so.1. Not in this process: memtrace-bpf is one
// static binary, Debian ships no libdebuginfod.a, and libdebuginfod's libcurl
// starts a resolver thread per host name, which crashes a static program that
// dlopen'ed it (a second glibc). Without the helper or the library the tool
// runs as before, with one warning when DEBUGINFOD_URLS asks for downloads.
//
// Bounds, enforced by killing the child: a server that does not answer, or a
// download that makes no progress, for DEBUGINFOD_TIMEOUT seconds (default
// here 15, not libdebuginfod's 90) is abandoned; a server that is down,
// refuses or stalls costs one warning, and no further queries are made in
// this run. A download running longer than 2 s prints one line on stderr.
#pragma once
#include <cstddef>
#include <functional>
#include <string>

#include "common/fd.h"

namespace memtrace::symbolize {

struct DebuginfodSettings {
  bool enabled = true;            // --no-debuginfod: false
  double progress_after_s = 2.0;  // one progress line for a download running longer
  int stall_timeout_s = 0;        // 0: DEBUGINFOD_TIMEOUT if set, else 15
  // The helper program; "": memtrace-debuginfod next to this program's
  // binary, else the one of this build tree.
  std::string helper;
  // Where warnings and the progress line go (one line each, no newline);
  // default: stderr, prefixed "memtrace-bpf: ".
  std::function<void(const std::string&)> log;
};

class Debuginfod {
 public:
  // The process-wide client (one cache, one warning per run).
  static Debuginfod& get();
  // Replace the settings (the CLI, tests). Resets the "server failed" state.
  void configure(DebuginfodSettings s);

  // Whether queries would be made: enabled, DEBUGINFOD_URLS non-empty, and
  // no failure yet in this run.
  bool active() const;

  // The debug file (kind "debuginfo") or executable (kind "executable") with
  // this build-id (raw bytes), downloaded or from the cache: an open fd and
  // its path; an invalid Fd when no server has it or none could be asked.
  // `what` names the module in messages.
  struct Found {
    Fd fd;
    std::string path;
  };
  Found find(const std::string& build_id, const char* kind, const std::string& what);

  struct Stats {
    size_t queries = 0, found = 0, not_found = 0, failed = 0;
  };
  Stats stats() const { return stats_; }

 private:
  Debuginfod();
  void warn(const std::string& msg);
  std::string helper_path() const;

  DebuginfodSettings s_;
  bool failed_ = false;
  Stats stats_;
};

}  // namespace memtrace::symbolize
