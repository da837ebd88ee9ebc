#include "common/hex.h"
#include "common/self_path.h"
#include "loader/faults.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "report/report.h"
#include "procfs/proc_maps.h"

namespace memtrace::loader {
namespace {

uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

heap::FaultHit classify_mapping(const symbolize::MappingInfo& m) {
  heap::FaultHit h;
  h.start = m.start;
  h.end = m.end;
  h.path = m.path;
  if (m.path == "[heap]") h.kind = heap::Hit::Heap;
  else if (m.path == "[stack]") h.kind = heap::Hit::Stack;
  else if (m.path.rfind("[stack:", 0) == 0) h.kind = heap::Hit::ThreadStack;
  else if (m.path.empty()) h.kind = heap::Hit::Anon;
  else if (m.path[0] == '/') h.kind = heap::Hit::File;
  else h.kind = heap::Hit::Other;  // [vdso], [vvar], [anon:name], memfd:...
  if (h.kind == heap::Hit::Anon) h.path.clear();
  if (m.path.rfind("[anon:", 0) == 0) {
    h.kind = heap::Hit::Anon;
    h.path = m.path.substr(6, m.path.size() - 7);
  }
  return h;
}

std::optional<heap::FaultHit> MapsCache::lookup(pid_t pid, uint64_t addr, uint64_t ts, uint32_t generation) {
  auto find = [&](const Snap& s) -> std::optional<heap::FaultHit> {
    auto it = std::upper_bound(s.maps.begin(), s.maps.end(), addr,
                               [](uint64_t a, const symbolize::MappingInfo& m) { return a < m.start; });
    if (it == s.maps.begin()) return std::nullopt;
    --it;
    if (addr >= it->end) return std::nullopt;
    return classify_mapping(*it);
  };
  auto sit = snaps_.find(pid);
  if (sit != snaps_.end() && sit->second.generation != generation) {
    snaps_.erase(sit);
    sit = snaps_.end();
  }
  // A snapshot taken after the fault shows its mapping (unless it is gone
  // since); an older one may not, or may show an earlier mapping there.
  if (sit != snaps_.end() && sit->second.taken_ns >= ts) return find(sit->second);
  uint64_t now = mono_ns();
  auto maps = procfs::read_maps(pid);
  if (!maps) {  // gone: the last snapshot is all there is
    if (sit != snaps_.end()) return find(sit->second);
    return std::nullopt;
  }
  reads_++;
  Snap& s = snaps_[pid];
  s.maps = std::move(*maps);
  std::sort(s.maps.begin(), s.maps.end(),
            [](const symbolize::MappingInfo& a, const symbolize::MappingInfo& b) { return a.start < b.start; });
  s.taken_ns = now;
  s.generation = generation;
  return find(s);
}

// ---------------------------------------------------------------- trace lines

void FaultTrace::header() {
  std::ostream& os = out_();
  if (json_) return;
  os << "# TIME(s)           COMM             PID     TID   RW IP                  FUNCTION                "
         "ADDRESS             HIT\n";
  os.flush();
}

std::string FaultTrace::function_at(const heap::Process& p, uint64_t addr, bool return_address) {
  auto fs = r_.resolve(p, addr, nullptr, return_address);
  if (fs.empty() || fs[0].function.empty()) return "";
  std::string s = fs[0].function;
  if (!fs[0].inlined && fs[0].offset) s += "+" + hex(fs[0].offset);
  return s;
}

void FaultTrace::line(const heap::Process& p, const mt_event& e, const heap::FaultHit& h) {
  std::ostream& os = out_();
  const char* rw = (e.h.flags & MT_F_FAULT_INSTR) ? "X" : (e.h.flags & MT_F_FAULT_WRITE) ? "W" : "R";
  uint64_t ip = e.old_addr;
  std::string fn = function_at(p, ip, false);
  // What was hit: the block and the function that allocated it.
  std::string alloc_fn;
  if (h.stack_id)
    if (const heap::Stack* st = m_.stack(h.stack_id); st && !st->ips.empty())
      alloc_fn = function_at(p, st->ips[0], true);
  char ts[32];
  snprintf(ts, sizeof ts, "%" PRIu64 ".%06" PRIu64, static_cast<uint64_t>(e.h.ts / 1000000000ull),
           static_cast<uint64_t>((e.h.ts % 1000000000ull) / 1000));
  bool access_error = e.h.flags & MT_F_FAULT_ACCESS_ERR;
  if (json_) {
    nlohmann::json j = {{"time", ts},
                        {"comm", p.comm},
                        {"pid", p.pid},
                        {"tid", e.h.tid},
                        {"access", rw},
                        {"ip", hex(ip)},
                        {"function", fn},
                        {"address", hex(e.addr)},
                        {"error_code", e.old_size},
                        {"first_touch", h.first_touch},
                        {"access_error", access_error}};
    nlohmann::json hit = {{"kind", heap::to_string(h.kind)}};
    if (h.kind != heap::Hit::Unmapped) {
      hit["start"] = hex(h.start);
      hit["size"] = h.end - h.start;
    }
    if (!h.path.empty()) hit["path"] = h.path;
    if (h.kind != heap::Hit::Block && h.kind != heap::Hit::Unmapped) hit["region"] = heap::region_label(h);
    if (!alloc_fn.empty()) hit["alloc_function"] = alloc_fn;
    j["hit"] = std::move(hit);
    os << report::json_text(j) << "\n";
  } else {
    char b[256];
    snprintf(b, sizeof b, "%-18s  %-16s %7d %7u  %s  %-18s  %-22s  %-18s  ", ts, p.comm.c_str(), p.pid, e.h.tid, rw,
             hex(ip).c_str(), fn.empty() ? "?" : fn.c_str(), hex(e.addr).c_str());
    os << b;
    if (h.kind == heap::Hit::Block) {
      os << "block " << hex(h.start) << "+" << (h.end - h.start);
      if (!alloc_fn.empty()) os << " from " << alloc_fn;
    } else {
      os << heap::region_label(h);
      if (h.kind == heap::Hit::Mmap || h.kind == heap::Hit::AllocatorMap || h.kind == heap::Hit::ThreadStack)
        os << " " << hex(h.start) << "+" << (h.end - h.start);
      if (!alloc_fn.empty()) os << " from " << alloc_fn;
    }
    if (h.first_touch) os << " (first touch)";
    if (access_error) os << " (SIGSEGV: rearmed page or crash)";
    os << "\n";
  }
}

// ---------------------------------------------------------------- --range / --rearm

Result<AddrRange> parse_range(const std::string& spec) {
  auto num = [&](const std::string& s, uint64_t& v) {
    if (s.empty()) return false;
    char* end = nullptr;
    errno = 0;
    v = strtoull(s.c_str(), &end, 0);
    return errno == 0 && end && *end == 0;
  };
  AddrRange r;
  r.spec = spec;
  size_t dash = spec.find('-');
  if (dash == std::string::npos) {
    if (!num(spec, r.start)) return Error::msg("--range " + spec + ": expected START-END or ADDR (hex with 0x)");
    r.end = 0;  // a live block, resolved later
    return r;
  }
  if (!num(spec.substr(0, dash), r.start) || !num(spec.substr(dash + 1), r.end))
    return Error::msg("--range " + spec + ": expected START-END or ADDR (hex with 0x)");
  if (r.end <= r.start) return Error::msg("--range " + spec + ": END must be above START");
  return r;
}

Result<void> check_mapped(pid_t pid, const AddrRange& r) {
  auto maps = procfs::read_maps(pid);
  if (!maps) return maps.error();
  uint64_t a = r.start & ~4095ull;
  std::sort(maps->begin(), maps->end(), [](const auto& x, const auto& y) { return x.start < y.start; });
  while (a < r.end) {
    auto it = std::find_if(maps->begin(), maps->end(), [&](const auto& m) { return a >= m.start && a < m.end; });
    if (it == maps->end())
      return Error::msg("--range " + r.spec + " is not mapped in process " + std::to_string(pid) + " (" + hex(a) +
                        " is outside every mapping)");
    if (it->perms.size() < 3 || (it->perms[0] != 'r' && it->perms[1] != 'w'))
      return Error::msg("--range " + r.spec + " is not accessible in process " + std::to_string(pid) + " (" +
                        it->perms + " " + it->path + ")");
    a = it->end;
  }
  return {};
}

std::string singlestep_helper_path() {
  std::string dir = self_dir();
  std::string helper = dir + "memtrace-singlestep";
  if (access(helper.c_str(), X_OK) == 0) return helper;
  std::string alt = dir + "../singlestep-helper/memtrace-singlestep";
  if (access(alt.c_str(), X_OK) == 0) return alt;
  return helper;
}

RearmHelper::~RearmHelper() { (void)stop(); }

Result<void> RearmHelper::start(pid_t pid, const std::vector<AddrRange>& ranges, double interval_ms) {
  std::string helper = singlestep_helper_path();
  if (access(helper.c_str(), X_OK) != 0) return Error::sys("--rearm needs " + helper);
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return Error::sys("pipe");
  char tmpl[] = "/tmp/memtrace-rearm-XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd >= 0) close(fd);
  report_path_ = tmpl;
  std::vector<std::string> args = {helper, "-p", std::to_string(pid), "--rearm", std::to_string(interval_ms),
                                   "--format", "json", "-o", report_path_, "--ready-fd", std::to_string(ready[1])};
  for (const auto& r : ranges) {
    uint64_t lo = r.start & ~4095ull, hi = (r.end + 4095) & ~4095ull;
    args.insert(args.end(), {"--addr", hex(lo), "--len", std::to_string(hi - lo)});
  }
  pid_t c = fork();
  if (c < 0) return Error::sys("fork memtrace-singlestep");
  if (c == 0) {
    // Our Ctrl-C must not reach it before we ask it to stop (it restores first).
    setpgid(0, 0);
    fcntl(ready[1], F_SETFD, 0);
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    execv(helper.c_str(), argv.data());
    _exit(127);
  }
  close(ready[1]);
  pid_ = c;
  // Its byte once armed; EOF if it ended first (a signal to us must not cut the wait short).
  pollfd pf{ready[0], POLLIN, 0};
  int n;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    n = left.count() <= 0 ? 0 : poll(&pf, 1, static_cast<int>(left.count()) + 1);
  } while (n < 0 && errno == EINTR);
  char b = 0;
  ssize_t got;
  do got = n > 0 ? read(ready[0], &b, 1) : 0;
  while (got < 0 && errno == EINTR);
  close(ready[0]);
  if (got != 1) {
    int st = 0;
    bool ended = waitpid(pid_, &st, WNOHANG) == pid_;
    if (!ended) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
    }
    pid_ = -1;
    unlink(report_path_.c_str());
    std::string how = !ended ? "no answer in 30 s"
                      : WIFSIGNALED(st) ? std::string("killed by signal ") + strsignal(WTERMSIG(st))
                                        : "it exited with status " + std::to_string(WEXITSTATUS(st));
    return Error::msg("memtrace-singlestep --rearm did not arm the ranges (" + how + "; its message, if any, above)");
  }
  return {};
}

nlohmann::json RearmHelper::stop() {
  if (pid_ <= 0) return report_;
  kill(pid_, SIGINT);
  int st = 0;
  while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  std::ifstream f(report_path_);
  std::stringstream ss;
  ss << f.rdbuf();
  report_ = nlohmann::json::parse(ss.str(), nullptr, false);
  unlink(report_path_.c_str());
  if (report_.is_discarded()) report_ = nlohmann::json::object();
  return report_;
}

}  // namespace memtrace::loader
