// A snapshot in Prometheus' text exposition format 0.0.4, with the number of
// series bounded: at most `max_processes` processes get series of their own;
// the rest are summed into one series labelled pid="other", comm="other".
// A process keeps its series while it lives (no flapping between scrapes);
// a slot that frees goes to the process in `other` with the most bytes in
// use. A process that exited (or exec'd into another program) is shown with
// its final values in `retain_scrapes` more scrapes, then dropped.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "metrics/snapshot.h"

namespace memtrace::metrics {

struct ExpositionOptions {
  size_t max_processes = 200;
  int retain_scrapes = 2;
};

// Which processes get series of their own: the state kept from one scrape
// to the next (used by the server's thread only).
class Selection {
 public:
  explicit Selection(ExpositionOptions o) : o_(o) {}
  // The text of one scrape of s; age: how old s is.
  std::string render(const Snapshot& s, std::chrono::duration<double> age);

 private:
  using Key = std::pair<pid_t, std::string>;
  ExpositionOptions o_;
  std::set<Key> slots_;              // processes with series of their own
  std::map<Key, int> gone_scrapes_;  // exited ones: scrapes shown in since
};

}  // namespace memtrace::metrics
