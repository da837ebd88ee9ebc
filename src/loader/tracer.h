// The attach-and-drain loop: loads bpf/memtrace.bpf.c, attaches allocator
// probes per process, follows exec/fork/exit, drains the ring buffers into
// the heap model and prints reports.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "common/result.h"
#include "heap/heap_model.h"
#include "loader/attach.h"
#include "loader/launcher.h"
#include "loader/resolver.h"
#include "report/report.h"

struct memtrace_bpf;
struct ring_buffer;

namespace memtrace::loader {

struct Options {
  std::vector<pid_t> pids;
  std::vector<std::string> comms;
  std::vector<std::string> command;  // launch mode
  double duration = 0;               // seconds, 0 = until the end
  double interval = 0;               // periodic summaries
  std::string output;                // -o FILE
  std::string format = "text";
  size_t top = 10;
  bool stacks = true;
  size_t ringbuf_mb = 64;
  std::vector<std::string> symbol_dirs;
  bool dwarf = true;
  bool explain_probes = false;
  bool verbose = false;
};

class Tracer {
 public:
  explicit Tracer(Options o);
  ~Tracer();
  // Runs until the traced program exits, the last traced process exits (-p),
  // --duration, or SIGINT/SIGTERM/SIGHUP. Returns the tool's exit code.
  int run();

  // For the ring buffer callbacks.
  int on_event(void* data, size_t len);
  int on_proc_event(void* data, size_t len);

 private:
  struct Proc {
    pid_t pid = 0;
    ProbeSet probes;
    bool attached = false;  // through its own probes, or system-wide ones
    bool exited = false;
  };

  Result<void> load();
  Result<void> setup_targets();
  Result<void> attach_process(pid_t pid, bool required);
  void set_target_state(pid_t pid, uint32_t state, uint32_t follow);
  void resume(pid_t pid);
  void scan_system_allocators(pid_t only = -1);
  void report_final(int exit_code);
  report::Drops drops();
  std::ostream& out();
  void teardown();
  void log(const std::string& s);

  Options o_;
  struct memtrace_bpf* skel_ = nullptr;
  struct ring_buffer* rb_ = nullptr;
  std::unique_ptr<Attacher> attacher_;
  heap::HeapModel model_;
  Resolver resolver_;
  std::map<pid_t, Proc> procs_;
  std::map<std::pair<uint64_t, uint64_t>, ProbeSet> system_probes_;  // system-wide mode
  std::set<pid_t> stopped_;  // processes BPF stopped that we must resume
  std::optional<Launcher> launcher_;
  std::optional<int> child_status_;
  std::unique_ptr<std::ostream> file_out_;
  std::vector<std::string> errors_;  // non-fatal, shown in the report
  uint64_t attach_failures_ = 0;
  bool system_wide_ = false;
  bool torn_down_ = false;
};

}  // namespace memtrace::loader
