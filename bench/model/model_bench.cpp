// The heap model's cost per record, without BPF or the drain: every event
// and stack record of a --record file is read into memory once, then applied
// to a fresh HeapModel several times; the best run and the median are
// reported (the machine is shared: compare medians of builds run in turn).
//
//   model_bench FILE [RUNS]
//
// Prints: records, processes, best and median CPU ns per record (this
// thread's CPU time) and every run's, the model's live blocks, stacks, spans and timeline points at the
// end, the bench's max RSS (the records are in memory too). Lifecycle records (exec, fork, exit) are not applied: the
// recording should be of one program without forks (W1: PYTHONMALLOC=malloc
// python3 bench/workloads/w1_json_dicts.py). See bench/model/RESULTS.md.
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "heap/heap_model.h"
#include "loader/recording.h"

using namespace memtrace;

static double cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static long max_rss_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: model_bench FILE.mtr [RUNS]\n");
    return 2;
  }
  int runs = argc > 2 ? atoi(argv[2]) : 5;
  // One buffer, each record at an 8-byte aligned offset (as the ring buffer has them).
  std::vector<uint64_t> buf;
  std::vector<std::pair<size_t, size_t>> recs;  // offset in buf (words), bytes
  auto rf = loader::read_recording(argv[1], [](const nlohmann::json&) {}, [&](const loader::Record& r) {
    if (r.type != loader::REC_EVENT) return;
    size_t at = buf.size();
    buf.resize(at + (r.payload.size() + 7) / 8);
    memcpy(buf.data() + at, r.payload.data(), r.payload.size());
    recs.emplace_back(at, r.payload.size());
  });
  if (!rf.header_ok() || !rf.error.empty()) {
    fprintf(stderr, "model_bench: %s: %s\n", argv[1], rf.error.c_str());
    return 2;
  }
  double best = 1e18;
  std::vector<double> per_record;
  size_t procs = 0, live = 0, stacks = 0, spans = 0, points = 0;
  for (int i = 0; i < runs; i++) {
    heap::HeapModel m;
    // CPU time of this thread: the machine is shared, time spent descheduled is not the model's.
    double t0 = cpu_ns();
    for (const auto& [at, len] : recs) m.apply(buf.data() + at, len);
    double ns = cpu_ns() - t0;
    best = std::min(best, ns);
    per_record.push_back(ns / recs.size());
    procs = m.images().size();
    live = stacks = spans = points = 0;
    for (const auto* p : m.images()) {
      live += p->live.size();
      stacks += p->stack_allocs.size();
      for (const auto& [id, v] : p->spans) spans += v.size();
      points += p->timeline.size();
    }
  }
  std::string all;
  for (double r : per_record) all += (all.empty() ? "" : " ") + std::to_string(static_cast<int>(r + 0.5));
  std::sort(per_record.begin(), per_record.end());
  double median = per_record.empty() ? 0 : per_record[per_record.size() / 2];
  printf("records %zu processes %zu best %.1f ms CPU, %.1f ns/record, median %.1f (runs: %s); live blocks %zu, "
         "stacks %zu, spans %zu, timeline points %zu; max RSS %ld MB\n",
         recs.size(), procs, best / 1e6, best / recs.size(), median, all.c_str(), live, stacks, spans, points,
         max_rss_mb());
  return 0;
}
