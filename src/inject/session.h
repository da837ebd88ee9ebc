// The loader's side of --inject: the shared-memory ring of one target
// (ring.h), the agent loaded into it (injector.h), the records drained in
// order. The records are bpf/memtrace.h's (mt_event, mt_stack): the caller
// feeds them to the heap model as it does the BPF ring's.
//
//   auto s = inject::Session::start(pid, {.agent = inject::agent_path()});
//   while (...) { s->drain([&](const void* d, size_t n) { model.apply(d, n); }); }
//   s->detach();   // hooks call straight through from now on; drain once more
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/result.h"
#include "inject/injector.h"
#include "inject/ring.h"

namespace memtrace::inject {

// libmemtrace_agent.so beside this program (or $MEMTRACE_AGENT).
std::string agent_path();

struct SessionOptions {
  std::string agent;                         // path of libmemtrace_agent.so
  size_t ring_mb = 64;                       // data area, MiB (a power of two)
  int stack_mode = MT_INJ_STACK_LIBUNWIND;   // enum mt_inj_stack_mode
  int timeout_ms = 10000;                    // for the dlopen call
};

// The ring, mapped in this process too; the file's name is removed once the
// agent has mapped it (or when the session goes).
class Ring {
 public:
  static Result<std::unique_ptr<Ring>> create(pid_t pid, size_t data_bytes, int stack_mode);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Every complete record in order, at most max; fn(record, bytes). The
  // number of records (pads not counted).
  size_t drain(const std::function<void(const void*, size_t)>& fn, size_t max = SIZE_MAX);
  void heartbeat();             // the agent's check that the loader lives (MT_INJ_STALE_NS)
  void set_state(uint32_t s);   // enum mt_inj_state
  void unlink_name();
  const volatile mt_inj_hdr& hdr() const { return *hdr_; }
  uint64_t backlog() const;     // bytes written and not drained
  uint64_t malformed() const { return malformed_; }
  bool tsc() const { return tsc_; }

 private:
  Ring() = default;
  mt_inj_hdr* hdr_ = nullptr;
  char* data_ = nullptr;
  size_t map_bytes_ = 0;
  uint64_t mask_ = 0;
  uint64_t malformed_ = 0;
  // ts_mode MT_INJ_TS_TSC: the TSC and CLOCK_MONOTONIC read together at
  // creation and at the latest drain; ticks per ns between them (refined
  // at every drain, the span growing: 1e-5 after a second).
  bool tsc_ = false;
  uint64_t tsc0_ = 0, ns0_ = 0, tsc1_ = 0, ns1_ = 0;
  double ticks_per_ns_ = 0;
  void calibrate();
  uint64_t ns_of(uint64_t tsc) const;
  std::string path_;
};

class Session {
 public:
  static Result<std::unique_ptr<Session>> start(pid_t pid, const SessionOptions& o);
  ~Session();  // detach()
  pid_t pid() const { return pid_; }
  Ring& ring() { return *ring_; }
  const LoadStats& load_stats() const { return load_; }
  size_t drain(const std::function<void(const void*, size_t)>& fn, size_t max = SIZE_MAX) {
    ring_->heartbeat();
    return ring_->drain(fn, max);
  }
  // The hooks stop writing; records already reserved are committed within
  // a few microseconds: drain after this.
  void detach();

 private:
  Session() = default;
  pid_t pid_ = 0;
  std::unique_ptr<Ring> ring_;
  LoadStats load_;
};

}  // namespace memtrace::inject
