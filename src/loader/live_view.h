// `memtrace-bpf top` / --live-view (issue 34): the heap model drawn in the
// terminal while the tracer runs, redrawn every second (and at each key).
//
//   processes   by bytes in use, growth over the last interval, or
//               allocation rate; one domain at a time (malloc, python)
//   a process   its stacks by bytes in use and by allocation rate
//
// Keys: u g a (sort by in use, growth, allocation rate), d (domain),
// j/k or the arrows (move), Enter (the process's stacks), b/Esc/Backspace
// (back), q (quit: the run ends as at Ctrl-C, its report written after the
// view). The screen is the terminal's alternate one (as less and top use),
// so the report and any message stay in the normal one. Reads keys from
// stdin: with -p, -c, --cgroup or system-wide (a launched program owns it).
#pragma once
#include <sys/types.h>
#include <termios.h>

#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "heap/heap_model.h"
#include "report/report.h"

namespace memtrace::loader {

class LiveView {
 public:
  struct Context {
    const heap::HeapModel* model = nullptr;
    report::Resolver resolve;
    std::function<void()> drain;  // what the rings hold, into the model
    std::ostream* screen = nullptr;
    int keys_fd = 0;
    double refresh_s = 1.0;
  };
  explicit LiveView(Context c);
  ~LiveView();  // the terminal as it was
  LiveView(const LiveView&) = delete;
  LiveView& operator=(const LiveView&) = delete;

  // From the run loop: keys, and a redraw when one is due. True: quit.
  bool tick();

  enum class Sort { InUse, Growth, AllocRate };
  enum class Domain { Malloc, Python };
  // One row of the process list (exposed for the unit test).
  struct Row {
    pid_t pid = 0;
    std::string comm;
    uint64_t in_use = 0, blocks = 0, allocs = 0;
    double growth = 0, alloc_rate = 0;  // bytes per second over the last interval
  };
  static std::vector<Row> rows(const heap::HeapModel& m, Domain d, Sort s,
                               const std::map<pid_t, std::pair<uint64_t, uint64_t>>& before, double dt);

 private:
  void key(char k);
  void draw();
  void draw_processes(std::ostream& o, size_t height);
  void draw_process(std::ostream& o, size_t height);

  Context c_;
  bool raw_ = false;
  termios saved_{};
  size_t cols_ = 80, lines_ = 24;
  Sort sort_ = Sort::InUse;
  Domain domain_ = Domain::Malloc;
  size_t cursor_ = 0;
  pid_t picked_ = 0;  // 0: the process list
  std::string esc_;   // an escape sequence being read
  uint64_t next_draw_ns_ = 0, last_ns_ = 0;
  double dt_ = 0;  // seconds between the last two samples
  // (in use, bytes allocated) per pid, and per (pid, stack), at the last sample
  std::map<pid_t, std::pair<uint64_t, uint64_t>> prev_, cur_;
  std::map<std::pair<pid_t, uint64_t>, uint64_t> prev_stack_bytes_, cur_stack_bytes_;
  size_t stack_samples_ = 0;  // of the picked process: rates from the second on
  std::vector<pid_t> shown_;  // pids of the rows drawn, in order
  bool quit_ = false;
};

}  // namespace memtrace::loader
