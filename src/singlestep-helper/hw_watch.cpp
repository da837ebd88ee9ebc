#include "hw_watch.h"

#include <linux/hw_breakpoint.h>
#include <linux/perf_event.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "arch.h"

namespace memtrace::singlestep {
namespace {
constexpr size_t kDataPages = 512;  // 2 MiB per thread
}

HwWatch::HwWatch(std::vector<Region> regions) : regions_(std::move(regions)) { paired_ = regions_.size() <= 2; }

HwWatch::~HwWatch() {
  for (auto& [tid, evs] : threads_)
    for (auto& e : evs)
      if (e.owner && e.ring) munmap(e.ring, e.ring_size);
}

bool HwWatch::eligible(const std::vector<Region>& regions) {
  if (regions.empty() || regions.size() > 4) return false;
  for (const auto& r : regions) {
    if (r.len != 1 && r.len != 2 && r.len != 4 && r.len != 8) return false;
    if (r.addr % r.len) return false;
  }
  return true;
}

Result<void> HwWatch::add_thread(pid_t tid) {
  if (threads_.count(tid)) return {};
  auto& evs = threads_[tid];
  int group_fd = -1;
  for (size_t i = 0; i < regions_.size(); i++) {
    for (int kind = 0; kind < (paired_ ? 2 : 1); kind++) {
      perf_event_attr a{};
      a.size = sizeof a;
      a.type = PERF_TYPE_BREAKPOINT;
      a.bp_type = kind == 0 ? HW_BREAKPOINT_RW : HW_BREAKPOINT_W;
      a.bp_addr = regions_[i].addr;
      a.bp_len = regions_[i].len;
      a.sample_period = 1;
      a.sample_type = PERF_SAMPLE_IDENTIFIER | PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_ADDR;
      a.exclude_kernel = 1;
      a.exclude_hv = 1;
      a.use_clockid = 1;
      a.clockid = CLOCK_MONOTONIC;
      a.watermark = 1;  // no wakeup per sample: the helper drains on its 50 ms tick
      a.wakeup_watermark = kDataPages * 4096 / 2;
      int fd = static_cast<int>(syscall(SYS_perf_event_open, &a, tid, -1, -1, PERF_FLAG_FD_CLOEXEC));
      if (fd < 0)
        return Error::sys("perf_event_open hardware breakpoint on thread " + std::to_string(tid));
      Event e;
      e.fd = Fd(fd);
      uint64_t id = 0;
      ioctl(fd, PERF_EVENT_IOC_ID, &id);
      ids_[id] = {i, kind == 1};
      if (group_fd < 0) {
        e.ring_size = (kDataPages + 1) * 4096;
        e.ring = mmap(nullptr, e.ring_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (e.ring == MAP_FAILED) return Error::sys("mmap perf ring buffer");
        e.owner = true;
        group_fd = fd;
      } else if (ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, group_fd) != 0) {
        return Error::sys("perf set output");
      }
      evs.push_back(std::move(e));
    }
  }
  return {};
}

void HwWatch::remove_thread(pid_t tid) {
  // Keep the ring buffers until the next drain; they still hold samples.
  (void)tid;
}

void HwWatch::drain(Report& report, ProcessSymbols& syms, uint64_t max, bool final) {
  std::vector<Sample> got = std::move(pending_);
  pending_.clear();
  for (auto& [tid, evs] : threads_) {
    for (auto& e : evs) {
      if (!e.owner) continue;
      auto* meta = static_cast<perf_event_mmap_page*>(e.ring);
      char* data = static_cast<char*>(e.ring) + 4096;
      uint64_t size = kDataPages * 4096;
      uint64_t head = __atomic_load_n(&meta->data_head, __ATOMIC_ACQUIRE);
      uint64_t tail = meta->data_tail;
      while (tail < head) {
        perf_event_header h;
        for (size_t k = 0; k < sizeof h; k++) reinterpret_cast<char*>(&h)[k] = data[(tail + k) % size];
        std::vector<char> rec(h.size);
        for (size_t k = 0; k < h.size; k++) rec[k] = data[(tail + k) % size];
        if (h.type == PERF_RECORD_SAMPLE) {
          const uint64_t* p = reinterpret_cast<const uint64_t*>(rec.data() + sizeof h);
          Sample s{};
          s.id = p[0];
          s.ip = p[1];
          s.tid = static_cast<uint32_t>(p[2] >> 32);
          s.time = p[3];
          s.addr = p[4];
          got.push_back(s);
        } else if (h.type == PERF_RECORD_LOST) {
          const uint64_t* p = reinterpret_cast<const uint64_t*>(rec.data() + sizeof h);
          report.dropped += p[1];
        }
        tail += h.size;
      }
      __atomic_store_n(&meta->data_tail, tail, __ATOMIC_RELEASE);
    }
  }
  std::stable_sort(got.begin(), got.end(), [](const Sample& a, const Sample& b) { return a.time < b.time; });
  // W and RW samples of one access come from the same debug exception: same tid and ip,
  // adjacent in time. Pair them.
  std::vector<bool> used(got.size(), false);
  std::map<uint32_t, size_t> last_of_tid;  // the partner of a thread's last sample may still be coming
  for (size_t i = 0; i < got.size(); i++) last_of_tid[got[i].tid] = i;
  for (size_t i = 0; i < got.size(); i++) {
    if (used[i]) continue;
    auto [reg, is_w] = ids_[got[i].id];
    Access acc = paired_ ? (is_w ? Access::kWrite : Access::kRead) : Access::kReadWrite;
    if (paired_) {
      bool found = false;
      for (size_t j = i + 1; j < got.size() && j < i + 8; j++) {
        if (used[j] || got[j].tid != got[i].tid || got[j].ip != got[i].ip) continue;
        auto [reg2, is_w2] = ids_[got[j].id];
        if (reg2 == reg && is_w2 != is_w) {
          used[j] = true;
          found = true;
          acc = Access::kWrite;
          break;
        }
      }
      // The partner of a sample at the end of this batch may not be in the ring yet:
      // keep the tail for the next drain.
      if (!found && !final && last_of_tid[got[i].tid] == i) {
        used[i] = true;
        pending_.push_back(got[i]);
        continue;
      }
    }
    used[i] = true;
    if (max && report.records.size() >= max) {
      report.dropped++;
      continue;
    }
    Record r;
    r.time_ns = got[i].time;
    r.tid = static_cast<pid_t>(got[i].tid);
    r.ip = got[i].ip;
    r.address = regions_[reg].addr;
    r.size = static_cast<uint32_t>(regions_[reg].len);
    r.access = acc;
    r.function = syms.function_of(r.ip);
    r.insn = arch::kWatchpointIp;
    report.records.push_back(std::move(r));
  }
}

}  // namespace memtrace::singlestep
