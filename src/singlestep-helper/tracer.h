// The ptrace side of the helper: attach to or launch the tracee, arm the
// regions (page protection or hardware watchpoints), turn every fault on a
// protected page into access records, restore everything on the way out.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/fd.h"
#include "common/result.h"
#include "arch.h"
#include "process_maps.h"
#include "report.h"

namespace memtrace::singlestep {

struct Options {
  pid_t pid = 0;                      // -p
  std::vector<std::string> command;   // -- PROGRAM ARGS
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // --addr/--len
  std::vector<std::string> symbols;   // --symbol
  uint64_t max = 0;                   // 0: unlimited
  double duration = 0;                // seconds, 0: unlimited
  std::string mode = "auto";          // auto | step | hw
  bool emulate = true;                // emulate plain mov loads/stores (no unprotect)
  int ready_fd = -1;                  // write one byte here once armed (C API)
  std::string track_allocs_from;      // --track-allocs-from FUNCTION
  uint64_t track_alloc_size = 0;      // --track-alloc-size N (0: any)
  double rearm_ms = 0;                // --rearm MS: page mode (see Report::rearm_ms)
};

// Set from signal handlers; the tracer polls them.
extern std::atomic<int> g_stop_signal;
extern std::atomic<bool> g_deadline_passed;

class HwWatch;

class Tracer {
 public:
  explicit Tracer(Options o);
  ~Tracer();

  Result<void> start();  // attach or launch, then arm
  void run();            // until the process exits, --max, --duration or a signal
  Report& report() { return report_; }
  bool launched() const { return launched_; }
  // Launch mode: wait for the (detached or exited) child and return its exit code.
  int wait_child_exit();
  // After a clean detach: tell the guardian it has nothing to do.
  void dismiss_guardian();

  // The guardian is a small process forked by the helper once armed. It reads
  // the helper's state (protected pages and their original protections, the
  // allocator breakpoints) from a pipe; if the pipe closes without a "clear"
  // line (the helper was SIGKILLed), it seizes the tracee and restores them.
  static int run_guardian(pid_t pid, int fd);

 private:
  struct Thread {
    bool stopped = false;
    bool group_stop = false;   // resume with PTRACE_LISTEN
    int resume_sig = 0;
    std::deque<int> queued;    // statuses seen while stopping the world
    // System call whose buffer argument was redirected to the scratch area.
    int redirect_slot = -1;
    bool redirect_in = false;  // kernel writes the buffer (read) vs reads it (write)
    uint64_t redirect_buf = 0, redirect_len = 0;
    // Any other system call with a pointer into a protected page: the call is
    // bracketed by two mprotect calls run from this same thread's syscall stops.
    enum class Open : uint8_t { kNone, kOpening, kRunning, kClosing } open = Open::kNone;
    Regs entry_regs{};  // at the entry of the program's system call
    Regs result_regs{}; // at its exit
    uint64_t open_lo = 0, open_len = 0;
    uint64_t stale_ip = 0, stale_addr = 0;  // last fault retried on an open page
    uint64_t retry_page = 0, retry_ip = 0;  // --rearm: page restored, access not yet re-run
    // aarch64: the last load-exclusive stepped on a tracked page (what the
    // thread's exclusive monitor would hold), for its store-exclusive.
    uint64_t excl_addr = 0;
    uint32_t excl_size = 0;
    uint8_t excl_bytes[16] = {};
  };
  struct Page {
    int orig_prot = 0;
    int cur_prot = 0;
  };
  struct IpInfo {
    uint8_t bytes[16] = {};
    size_t n = 0;
    Insn insn;
    uint32_t written_ops = 0;  // bit i: explicit operand i was seen writing (from the fault)
  };

  Result<void> attach();
  Result<void> start_guardian();
  Result<void> launch();
  Result<void> arm();
  Result<void> resolve_regions();
  void disarm_and_detach(const std::string& reason);

  Thread* thread(pid_t tid);
  void add_thread(pid_t tid, bool stopped);
  void handle(pid_t tid, int status);
  void handle_fault(pid_t tid, uint64_t fault_addr);
  void handle_page_access(pid_t tid, uint64_t fault_addr);  // --rearm
  void rearm_now();                                          // --rearm
  void finish_retries();                                     // --rearm
  uint64_t next_rearm_ns_ = 0;
  void handle_syscall(pid_t tid);
  bool step_over(pid_t tid, Regs& regs, IpInfo& info, uint64_t fault_addr, uint64_t now);
  bool emulate(pid_t tid, Regs& regs, const Insn& insn, uint64_t now);
  bool store_exclusive(pid_t tid, Regs& regs, const IpInfo& info, uint64_t now);
  void finish_exclusive(pid_t tid, uint64_t now);
  void record(pid_t tid, const Insn& insn, const MemOp& op, Access a, uint64_t now);
  void record_raw(pid_t tid, uint64_t ip, uint64_t addr, uint64_t size, Access a, uint64_t now,
                  const std::string& insn_text);
  void stop_world(pid_t except);
  void resume(pid_t tid);
  void resume_all();
  int wait_for(pid_t tid);  // status of this thread's next stop; others are queued

  // Injected system call from a stopped thread; registers restored afterwards.
  Result<long> inject(pid_t tid, long nr, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4 = 0,
                      uint64_t a5 = 0, uint64_t a6 = 0);
  Result<void> set_prot(pid_t tid, uint64_t page, uint64_t npages, int prot);
  Result<void> protect_all(pid_t tid, bool armed);
  bool page_armed(uint64_t page) const;
  bool mem_read(uint64_t addr, void* buf, size_t n);
  bool mem_write(uint64_t addr, const void* buf, size_t n);
  bool max_reached() const { return opt_.max && report_.records.size() >= opt_.max; }
  pid_t any_stopped() const;

  // --track-allocs-from
  Result<void> arm_alloc_tracking();
  void alloc_breakpoint(pid_t tid, Regs& regs);
  void disarm_alloc_tracking(pid_t tid);

 public:
  struct AllocState;  // allocs.h

 private:
  std::unique_ptr<AllocState> allocs_;

  Options opt_;
  pid_t pid_ = 0;
  bool launched_ = false;
  bool armed_ = false;
  bool hw_ = false;
  int exec_status_fd_ = -1;
  std::map<pid_t, Thread> threads_;
  std::map<uint64_t, Page> pages_;  // page address -> protections
  std::unordered_map<uint64_t, IpInfo> ips_;
  Fd mem_;
  uint64_t syscall_insn_ = 0;
  uint64_t scratch_ = 0;
  std::vector<bool> slot_busy_;
  NativeDecoder decoder_;
  std::unique_ptr<ProcessSymbols> symbols_;
  std::unique_ptr<HwWatch> hw_watch_;
  Report report_;
  std::string stop_reason_;
  int child_exit_ = -1;
  bool child_reaped_ = false;
};

uint64_t now_ns();
void guardian_note(const std::string& line);  // one line of state for the guardian

}  // namespace memtrace::singlestep
