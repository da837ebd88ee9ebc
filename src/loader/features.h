// Tools the older tracers offered, on top of the tracer's run loop:
//   --console      seed 004's interactive console (status/report/monitor/clear/live/help/quit)
//   --trace        seed 001's allocation trace: one line per allocator/mmap event
//   --live         seed 001's active allocations / seed 002's "list used": every live block
//   --dump-bytes N the first N bytes of each live block (process_vm_readv)
//   --record FILE  every ring-buffer record to a file, for `memtrace-bpf replay FILE`
// The tracer lends its model, symbolizer and output (FeatureContext) and calls
// the hooks; everything else lives here and in recording.{h,cpp}.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "heap/heap_model.h"
#include "procfs/proc_maps.h"
#include "report/diff.h"
#include "report/outputs.h"
#include "report/report.h"

namespace memtrace::loader {

struct FeatureOptions {
  bool console = false;
  bool trace = false;
  bool live = false;
  size_t live_max = 1000;   // live blocks listed per process
  size_t dump_bytes = 0;    // bytes of each live block shown (0: none)
  std::string record;       // --record FILE
  bool live_view = false;   // `top` / --live-view (live_view.h)
  bool any() const { return console || trace || live || dump_bytes || !record.empty() || live_view; }
};

// Checks the combinations main() cannot express with CLI11 alone; "" if fine.
std::string check_feature_options(const FeatureOptions& f, bool launch_mode);

// ---- live blocks (shared by the tracer and `replay`)
struct LiveOptions {
  size_t max = 1000;
  size_t dump_bytes = 0;
  bool readable = true;     // false: replay, memory not available
  uint64_t now_ns = 0;      // CLOCK_MONOTONIC reference for ages (bpf_ktime_get_ns clock)
};
// Live blocks of p, grouped by allocation stack (largest group first, oldest
// block first inside a group), at most o.max of them.
void write_live_text(std::ostream& os, const heap::HeapModel& m, const report::Resolver& r, const heap::Process& p,
                     const LiveOptions& o);
// {"live": [...], "live_total": N, "live_omitted": N} merged into a process object.
void add_live_json(nlohmann::json& jp, const heap::HeapModel& m, const report::Resolver& r, const heap::Process& p,
                   const LiveOptions& o);
uint64_t monotonic_ns();

// What the tracer lends to the features.
struct FeatureContext {
  heap::HeapModel* model = nullptr;
  report::Resolver resolve;
  std::function<std::ostream&()> out;          // the report output
  std::function<report::Drops()> drops;
  std::function<void()> drain;                 // consume what the ring buffers hold now
  bool json = false;
  size_t top = 10;
  bool system_wide = false;
  bool include_idle = true;
  std::vector<std::string> command;            // launch mode (recorded in the header)
  size_t max_images = 256;                     // --max-images (recorded: replay merges as the trace did)
  // The perf maps read (pid, their text): the recording keeps them (JIT code names).
  std::function<std::vector<std::pair<pid_t, std::string>>()> perf_maps;
};

class Recorder;
class LiveView;

class Features {
 public:
  // Opens the recording file, if any; null and *err on failure.
  static std::unique_ptr<Features> create(const FeatureOptions& o, FeatureContext ctx, std::string* err);
  ~Features();

  // The tracer's read of a process's /proc/PID/maps for this record (null:
  // not read, or the process is gone); made on first call.
  using MapsOf = std::function<const std::vector<procfs::Mapping>*()>;
  // After the model applied an events-ring record; maps: the tracer's read
  // for it if it made one (null: read here when needed).
  void on_event(const void* data, size_t len, const std::vector<procfs::Mapping>* maps = nullptr);
  // A Python frame the stacks from now on name (recording: REC_PYFRAME).
  void python_frame(uint32_t id, const std::string& function, const std::string& file, int line);
  // After the tracer handled a proc-events record (the process may still be stopped).
  void on_proc_event(const void* data, size_t len, const MapsOf& maps);
  // From the run loop: console input and `monitor`. True: the user said quit.
  bool tick();
  // The run loop ended: the live view gives the terminal back (before any
  // message of the teardown and the report).
  void end_view();
  // Before the final report: the recording's end record.
  void finish(const report::Drops& d, const std::vector<std::string>& errors);
  // Additions to the final report.
  void add_json(nlohmann::json& j);
  void write_text(std::ostream& os);
  // --record: pid's executable mappings (read now if maps is null) not written yet.
  void snapshot_maps(pid_t pid, const std::vector<procfs::Mapping>* maps);

 private:
  Features(const FeatureOptions& o, FeatureContext ctx);
  void trace_line(const mt_event& e);
  void command(const std::string& line);
  void status(std::ostream& os);
  void full_report(std::ostream& os);
  void live(std::ostream& os);
  void prompt();
  LiveOptions live_options() const;

  FeatureOptions o_;
  FeatureContext c_;
  std::unique_ptr<Recorder> rec_;
  std::unique_ptr<LiveView> view_;
  bool view_done_ = false;
  // console
  void diff(std::ostream& os);
  std::unique_ptr<report::HeapSnapshot> snapshot_;  // `snapshot`, for `diff`
  std::string inbuf_;
  bool stdin_open_ = true;
  bool tty_ = false;
  double monitor_s_ = 0;
  uint64_t next_monitor_ns_ = 0;
  // trace
  uint64_t trace_lines_ = 0;
  uint64_t trace_write_errors_ = 0;
  int64_t realtime_offset_ns_ = 0;  // CLOCK_REALTIME - CLOCK_MONOTONIC
  bool finished_ = false;
  std::set<pid_t> seen_pids_;  // recording: mappings captured at a process's first event
};

// `memtrace-bpf replay FILE ...`: the report of a recording. Returns the exit code.
struct ReplayOptions {
  std::string file;
  std::string format = "text";  // of the primary output (report/outputs.h)
  std::vector<report::OutputSpec> outputs;  // -o FILEs; empty: stdout
  report::FoldedValue folded_value = report::FoldedValue::LiveBytes;
  size_t top = 10;
  bool live = false;
  size_t live_max = 1000;
  std::vector<std::string> symbol_dirs;
  bool dwarf = true;
  bool verbose = false;  // -v: the text report's STATS line
};
int replay(const ReplayOptions& o);

}  // namespace memtrace::loader
