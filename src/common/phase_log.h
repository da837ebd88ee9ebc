// MEMTRACE_TIMING=1: one line on stderr per phase of a run ("memtrace-bpf:
// timing +0.412 s load: BPF programs verified"), from the process's start:
// where a run's fixed cost goes (docs/startup-cost.md). Off: one getenv.
#pragma once
#include <time.h>

#include <cstdio>
#include <cstdlib>

namespace memtrace {

inline double phase_clock() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

inline void phase(const char* what) {
  static const bool on = getenv("MEMTRACE_TIMING") != nullptr;
  static const double t0 = phase_clock();
  if (on) fprintf(stderr, "memtrace-bpf: timing +%.3f s %s\n", phase_clock() - t0, what);
}

}  // namespace memtrace
