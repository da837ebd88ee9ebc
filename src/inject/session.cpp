#include "inject/session.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>

#include "common/fd.h"
#include "common/self_path.h"
#include "memtrace.h"

namespace memtrace::inject {
namespace {

uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}

// Whether records may carry the TSC: the kernel keeps CLOCK_MONOTONIC by it
// (it chose it as its clocksource: constant, synchronized across CPUs).
bool tsc_is_clock() {
#if defined(__x86_64__)
  Fd fd(open("/sys/devices/system/clocksource/clocksource0/current_clocksource", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return false;
  char buf[32] = {0};
  ssize_t n = read(fd.get(), buf, sizeof buf - 1);
  return n >= 3 && strncmp(buf, "tsc", 3) == 0 && (n == 3 || buf[3] == '\n');
#else
  return false;
#endif
}

// The TSC and CLOCK_MONOTONIC at (nearly) the same instant: the pair whose
// two TSC reads are closest, of a few tries.
void tsc_and_ns(uint64_t* tsc, uint64_t* ns) {
#if defined(__x86_64__)
  uint64_t best = UINT64_MAX;
  for (int i = 0; i < 5; i++) {
    uint64_t a = __builtin_ia32_rdtsc();
    uint64_t n = monotonic_ns();
    uint64_t b = __builtin_ia32_rdtsc();
    if (b - a < best) {
      best = b - a;
      *tsc = a + (b - a) / 2;
      *ns = n;
    }
  }
#else
  *tsc = 0;
  *ns = monotonic_ns();
#endif
}

// The agent into a chroot's /dev/shm (0644: the process reads it as itself).
Result<void> copy_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, ec);
  if (ec) return Error::msg("copy the agent " + from + " to " + to + ": " + ec.message());
  if (chmod(to.c_str(), 0644) != 0) return Error::sys("chmod " + to);
  return {};
}

}  // namespace

std::string agent_path() {
  if (const char* e = getenv("MEMTRACE_AGENT"); e && *e) return e;
  std::string beside = self_dir() + "libmemtrace_agent.so";  // the build tree
  if (access(beside.c_str(), R_OK) == 0) return beside;
  // Installed (cmake --install, the .deb): BINDIR/../LIBDIR/memtrace-bpf/.
  char real[PATH_MAX];
  std::string installed = self_dir() + MEMTRACE_AGENT_INSTALLED;
  return realpath(installed.c_str(), real) ? std::string(real) : installed;
}

Result<std::unique_ptr<Ring>> Ring::create(pid_t pid, size_t data_bytes, int stack_mode, const CfiRows* cfi,
                                           const std::string& root) {
  if (data_bytes < 4096 || (data_bytes & (data_bytes - 1)))
    return Error::msg("ring size " + std::to_string(data_bytes) + " is not a power of two of at least 4096");
  char name[64];
  snprintf(name, sizeof name, MT_INJ_PATH_FMT, static_cast<int>(pid));
  std::string in_root = root + name;  // the agent opens name, in its root
  const char* path = in_root.c_str();
  struct stat st {};
  std::string proc = "/proc/" + std::to_string(pid);
  if (stat(proc.c_str(), &st) != 0) return Error::sys("stat " + proc);
  ::unlink(path);  // a dead session's
  Fd fd(open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) return Error::sys(std::string("create ") + path);
  std::unique_ptr<Ring> r(new Ring());
  r->path_ = path;
  // The target opens it as itself: its owner.
  if (fchown(fd.get(), st.st_uid, st.st_gid) != 0) return Error::sys(std::string("chown ") + path);
  r->map_bytes_ = MT_INJ_HDR_BYTES + data_bytes;
  size_t cfi_off = 0;
  if (cfi && !cfi->mods.empty()) {
    cfi_off = r->map_bytes_;
    r->map_bytes_ += (cfi->bytes() + 4095) & ~size_t(4095);
  }
  if (ftruncate(fd.get(), static_cast<off_t>(r->map_bytes_)) != 0) return Error::sys(std::string("size ") + path);
  // Its pages allocated (and zeroed) here, now, not by the target's first
  // lap of writes: perf had clear_page_erms at up to 37% of python3's
  // samples on W1. tmpfs without fallocate: the target's writes do it.
  (void)posix_fallocate(fd.get(), 0, static_cast<off_t>(r->map_bytes_));
  void* m = mmap(nullptr, r->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (m == MAP_FAILED) return Error::sys(std::string("map ") + path);
  r->hdr_ = static_cast<mt_inj_hdr*>(m);
  r->data_ = static_cast<char*>(m) + MT_INJ_HDR_BYTES;
  r->mask_ = data_bytes - 1;
  mt_inj_hdr& h = *r->hdr_;
  h.version = MT_INJ_VERSION;
  h.hdr_bytes = MT_INJ_HDR_BYTES;
  h.data_bytes = data_bytes;
  h.pid = static_cast<uint32_t>(pid);
  h.loader_pid = static_cast<uint32_t>(getpid());
  h.state = MT_INJ_ATTACHED;
  h.stack_mode = static_cast<uint32_t>(stack_mode);
  if (cfi_off) {
    char* at = static_cast<char*>(m) + cfi_off;
    memcpy(at, cfi->mods.data(), cfi->mods.size() * sizeof(mt_inj_cfi_mod));
    memcpy(at + cfi->mods.size() * sizeof(mt_inj_cfi_mod), cfi->rows.data(), cfi->rows.size() * sizeof(mt_unwind_row));
    h.cfi_off = cfi_off;
    h.cfi_mods = static_cast<uint32_t>(cfi->mods.size());
    h.cfi_rows = static_cast<uint32_t>(cfi->rows.size());
  }
  h.heartbeat_ns = monotonic_ns();
  if (tsc_is_clock()) {
    // A first rate over ~2 ms; every drain refines it.
    r->tsc_ = true;
    tsc_and_ns(&r->tsc0_, &r->ns0_);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    r->calibrate();
    h.ts_mode = MT_INJ_TS_TSC;
  }
  __atomic_store_n(&h.magic, MT_INJ_MAGIC, __ATOMIC_RELEASE);
  return r;
}

Ring::~Ring() {
  unlink_name();
  if (hdr_) munmap(hdr_, map_bytes_);
}

void Ring::unlink_name() {
  if (!path_.empty()) ::unlink(path_.c_str());
  path_.clear();
}

void Ring::heartbeat() { __atomic_store_n(&hdr_->heartbeat_ns, monotonic_ns(), __ATOMIC_RELAXED); }

void Ring::set_state(uint32_t s) { __atomic_store_n(&hdr_->state, s, __ATOMIC_RELEASE); }

uint64_t Ring::backlog() const {
  return __atomic_load_n(&hdr_->head, __ATOMIC_ACQUIRE) - __atomic_load_n(&hdr_->tail, __ATOMIC_RELAXED);
}

void Ring::calibrate() {
  tsc_and_ns(&tsc1_, &ns1_);
  if (ns1_ > ns0_ && tsc1_ > tsc0_) ticks_per_ns_ = static_cast<double>(tsc1_ - tsc0_) / static_cast<double>(ns1_ - ns0_);
}

// A record's TSC as CLOCK_MONOTONIC ns: back from the latest pair (records
// are recent, so the rate's error barely counts).
uint64_t Ring::ns_of(uint64_t tsc) const {
  if (ticks_per_ns_ <= 0) return ns1_;
  double d = static_cast<double>(static_cast<int64_t>(tsc - tsc1_)) / ticks_per_ns_;
  return static_cast<uint64_t>(static_cast<int64_t>(ns1_) + static_cast<int64_t>(d));
}

namespace {

// A compact record as the mt_event the model takes (ts already in ns).
void expand_rec(const mt_inj_rec& c, uint32_t pid, mt_event* ev) {
  ev->h.kind = c.w & 0xff;
  ev->h.flags = (c.w >> 16) & 0x7fff;
  ev->h.pid = pid;
  ev->h.tid = c.tid;
  ev->h.ts = c.ts;
  ev->addr = c.addr;
  ev->size = c.size;
  ev->old_addr = c.old_addr;
  ev->old_size = 0;
  ev->stack_id = c.stack_id;
  ev->role = (c.w >> 8) & 0xff;
  ev->aux = 0;
}

}  // namespace

size_t Ring::drain(const std::function<void(const void*, size_t)>& fn, size_t max, bool expand) {
  uint64_t t = __atomic_load_n(&hdr_->tail, __ATOMIC_RELAXED);
  uint64_t size = mask_ + 1;
  size_t n = 0, since_store = 0;
  if (tsc_) calibrate();
  mt_event ev{};
  while (n < max) {
    uint64_t off = t & mask_;
    uint64_t word = __atomic_load_n(reinterpret_cast<uint64_t*>(data_ + off), __ATOMIC_ACQUIRE);
    if ((word & MT_INJ_POS_MASK) != (t & MT_INJ_POS_MASK)) break;  // not committed yet
    uint64_t len = word >> 48;
    // The untouched ring's zeros at position 0 carry pos 0 too: no record
    // has length 0 (the copier drains from the start, before the first).
    if (len == 0) break;
    if (len < MT_INJ_REC_HDR || (len & 7) || off + len > size) {
      // Cannot happen with our agent; stop rather than read garbage.
      malformed_++;
      break;
    }
    if (!(word & MT_INJ_PAD)) {
      const char* body = data_ + off + MT_INJ_REC_HDR;
      size_t bytes = len - MT_INJ_REC_HDR;
      uint32_t w;
      memcpy(&w, body, sizeof w);
      if (w & MT_INJ_COMPACT) {
        // A compact record (ring.h): expanded to the mt_event the model takes.
        if (bytes != MT_INJ_REC_FREE_BYTES && bytes != MT_INJ_REC_ALLOC_BYTES && bytes != MT_INJ_REC_REALLOC_BYTES) {
          malformed_++;
          break;
        }
        mt_inj_rec c{};
        memcpy(&c, body, bytes);
        if (tsc_) c.ts = ns_of(c.ts);
        if (expand) {
          expand_rec(c, hdr_->pid, &ev);
          fn(&ev, sizeof ev);
        } else {
          fn(&c, bytes);
        }
      } else {
        fn(body, bytes);
      }
      n++;
    }
    t += len;
    // Give the space back every so often, not per record (the producers
    // read tail in every reservation).
    if (++since_store == 256) {
      __atomic_store_n(&hdr_->tail, t, __ATOMIC_RELEASE);
      since_store = 0;
    }
  }
  __atomic_store_n(&hdr_->tail, t, __ATOMIC_RELEASE);
  return n;
}

Result<std::unique_ptr<Session>> Session::start(pid_t pid, const SessionOptions& o) {
  if (access(o.agent.c_str(), R_OK) != 0) return Error::sys("agent library " + o.agent);
  if (auto r = can_inject(pid); !r) return r.error();
  // One snapshot of the maps for every step below.
  ProcessView view = o.view;
  if (view.maps.empty()) {
    auto v = ProcessView::read(pid);
    if (!v) return v.error();
    view.maps = std::move(v->maps);
  }
  // MT_INJ_STACK_CFI: the rows of every executable file mapped now, built
  // while the process runs untouched.
  CfiRows cfi;
  if (o.stack_mode == MT_INJ_STACK_CFI) {
    unwind::TableStore store;
    cfi = build_cfi_rows(pid, view.maps, &store);
  }
  // A chroot's process (agent_root): the ring and a copy of the agent in
  // its /dev/shm, the agent loaded by the name it has there.
  auto root = agent_root(pid);
  if (!root) return root.error();
  auto ring = Ring::create(pid, o.ring_mb << 20, o.stack_mode, &cfi, *root);
  if (!ring) return ring.error();
  std::string agent = o.agent;
  struct Unlink {
    std::string path;
    ~Unlink() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  } agent_copy;  // (its name only: the process keeps the mapping)
  // MEMTRACE_INJECT_GOT=0, MEMTRACE_INJECT_ENTRIES=0: one of the two ways
  // in alone (bench/inject measures them apart).
  auto env_off = [](const char* n) {
    const char* v = getenv(n);
    return v && strcmp(v, "0") == 0;
  };
  bool got = o.got && !env_off("MEMTRACE_INJECT_GOT"), entries = o.entries && !env_off("MEMTRACE_INJECT_ENTRIES");
  if (!got) (*ring)->mutable_hdr()->hook_flags |= MT_INJ_NO_GOT;
  if (o.verify_stacks) (*ring)->mutable_hdr()->hook_flags |= MT_INJ_CFI_VERIFY;
  (*ring)->mutable_hdr()->sample_bytes = o.sample_bytes;
  if (o.py) {
    (*ring)->mutable_hdr()->py = *o.py;
    (*ring)->mutable_hdr()->py_frames = 1;
  }
  std::unique_ptr<Session> s(new Session());
  s->pid_ = pid;
  s->cfi_ = {cfi.mods.size(), cfi.rows.size(), cfi.bytes(), cfi.mappings_without, cfi.build_ms, cfi.first_error};
  s->ring_ = std::move(*ring);
  // The program's allocator, when not glibc's: its functions for the
  // agent to hook (GOT slots by name, entries by address).
  std::vector<uint64_t> fns;
  {
    mt_inj_hdr* h = s->ring_->mutable_hdr();
    uint32_t n = 0;
    for (const auto& f : o.allocator) {
      if (n == MT_INJ_FN_MAX) {
        fprintf(stderr, "memtrace-bpf: --inject: pid %d: more than %d allocator functions: %s and those after it not hooked\n",
                static_cast<int>(pid), MT_INJ_FN_MAX, f.name.c_str());
        break;
      }
      if (f.name.size() >= sizeof h->fns[n].name) continue;
      h->fns[n].addr = f.addr;
      h->fns[n].role = f.role | (f.primary ? MT_INJ_FN_PRIMARY : 0u);
      memcpy(h->fns[n].name, f.name.c_str(), f.name.size() + 1);
      fns.push_back(f.addr);
      n++;
    }
    h->fn_count = n;
  }
  // An earlier --inject left the agent in the process (its hooks calling
  // straight through): its attach function maps this ring, as its
  // constructor did the first time.
  // The files the entry trampolines need read now, while the process runs
  // untouched (trampoline.h).
  EntryFilesPtr files = entries ? prepare_entries(pid, &view.maps, fns) : nullptr;
  auto mapped = agent_mapped(view.maps);
  s->load_.reattached = mapped.has_value();
  if (!root->empty() && !mapped) {
    std::string name = "/dev/shm/libmemtrace_agent." + std::to_string(getpid()) + ".so";
    if (auto c = copy_file(o.agent, *root + name); !c) return c.error();
    agent_copy.path = *root + name;
    agent = name;
  }
  // The entries patched while the call's thread is still stopped (the
  // others stopped for it too): it runs on with the hooks and the
  // trampolines both in place.
  std::optional<Result<PatchReport>> patched;
  auto after = [&](StoppedProcess& sp) {
    if (!entries || s->ring_->hdr().agent_state != MT_INJ_AGENT_HOOKED) return;
    patched = patch_entries(pid, s->ring_->mutable_hdr(), &sp, files.get(), &view.maps);
  };
  auto h = mapped ? attach_agent(pid, *mapped, &s->load_, o.timeout_ms, o.held, after, &view)
                  : load_library(pid, agent, &s->load_, o.timeout_ms, o.held, after, &view);
  if (!h) return h.error();
  // The constructor ran inside dlopen: the agent has said how it went.
  const volatile mt_inj_hdr& hd = s->ring_->hdr();
  uint32_t st = hd.agent_state;
  if (st == MT_INJ_AGENT_NONE) {
    // Loaded by something else than --inject, which made it map no ring.
    return Error::msg("pid " + std::to_string(pid) + ": the agent did not map the ring (" +
                      (mapped ? *mapped : agent) + " loaded before, not by --inject?)");
  }
  if (st == MT_INJ_AGENT_FAILED) {
    char why[sizeof hd.agent_error + 1] = {0};
    for (size_t i = 0; i < sizeof hd.agent_error; i++) why[i] = hd.agent_error[i];
    return Error::msg("pid " + std::to_string(pid) + ": agent: " + why);
  }
  // The allocator's own entries jump to the hooks too (x86-64): calls that
  // bypass the GOT. A function that cannot be patched keeps its GOT hooks
  // and is named, one line each.
  if (patched) {
    auto& pr = *patched;
    if (!pr) {
      fprintf(stderr, "memtrace-bpf: --inject: pid %d: the allocator's entries not patched (%s): its calls that bypass the GOT are not seen\n",
              static_cast<int>(pid), pr.error().message.c_str());
    } else {
      s->patch_ = std::move(*pr);
      for (const auto& why : s->patch_.refused)
        fprintf(stderr, "memtrace-bpf: --inject: pid %d: entry not patched: %s: its calls that bypass the GOT are not seen\n",
                static_cast<int>(pid), why.c_str());
    }
  }
  s->ring_->unlink_name();
  return s;
}

void Session::start_copier(size_t max_backlog) {
  if (copier_.joinable()) return;
  max_backlog_ = max_backlog;
  copier_ = std::thread([this] { copier(); });
}

void Session::copier() {
  // Under ring_mu_, as is everything that touches cur_: a flushing drain
  // holds it, and so sees every record taken out of the ring either in
  // chunks_ or in cur_, never in between (in flight here, applied later:
  // after its process's exit, into a new image of the same pid).
  auto push = [&] {
    if (cur_.empty()) return;
    size_t b = cur_.size();
    std::lock_guard<std::mutex> g(mu_);
    chunks_.push_back(std::move(cur_));
    size_t q = queued_.fetch_add(b, std::memory_order_relaxed) + b;
    if (q > backlog_peak_) backlog_peak_ = q;
    cur_.clear();
    if (!spare_.empty()) {
      cur_ = std::move(spare_.back());
      spare_.pop_back();
    }
  };
  while (!stop_.load(std::memory_order_relaxed)) {
    ring_->heartbeat();  // also while the backlog is at its cap: the writers wait, not drop
    size_t got = 0;
    {
      std::lock_guard<std::mutex> g(ring_mu_);
      if (queued_.load(std::memory_order_relaxed) < max_backlog_) {
        if (cur_.capacity() < kChunkBytes) cur_.reserve(kChunkBytes);
        // At most a chunk's worth at a time (records of 32-1064 bytes).
        got = ring_->drain(
            [&](const void* d, size_t n) {
              uint32_t len = static_cast<uint32_t>(n);
              size_t at = cur_.size();
              cur_.resize(at + sizeof len + n);
              memcpy(cur_.data() + at, &len, sizeof len);
              memcpy(cur_.data() + at + sizeof len, d, n);
            },
            kChunkBytes / 64, false);
      }
      if (cur_.size() >= kChunkBytes / 2 || (got == 0 && !cur_.empty())) push();
    }
    // Nothing there, or the model that far behind: 0.5 ms (a 64 MiB ring
    // takes ~1 M records, ~0.2 s of W1's fastest writing).
    if (got == 0) std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  std::lock_guard<std::mutex> g(ring_mu_);
  push();
}

void Session::stop_copier() {
  if (!copier_.joinable()) return;
  stop_ = true;
  copier_.join();
}

size_t Session::drain(const std::function<void(const void*, size_t)>& fn, size_t max, bool flush) {
  if (!copier_.joinable() && chunks_.empty()) {
    ring_->heartbeat();
    return ring_->drain(fn, max);
  }
  // flush: the copier copies nothing more while the queue and the ring's
  // rest go out, in order.
  std::unique_lock<std::mutex> rl(ring_mu_, std::defer_lock);
  if (flush) rl.lock();
  size_t n = 0;
  mt_event ev{};
  uint32_t pid = ring_->hdr().pid;
  auto emit = [&](const std::vector<char>& c) {
    for (size_t at = 0; at + sizeof(uint32_t) <= c.size();) {
      uint32_t len;
      memcpy(&len, c.data() + at, sizeof len);
      const char* body = c.data() + at + sizeof len;
      uint32_t w;
      memcpy(&w, body, sizeof w);
      if (w & MT_INJ_COMPACT) {
        mt_inj_rec r{};
        memcpy(&r, body, std::min<size_t>(len, sizeof r));
        expand_rec(r, pid, &ev);
        fn(&ev, sizeof ev);
      } else {
        fn(body, len);
      }
      n++;
      at += sizeof len + len;
    }
  };
  for (size_t taken = 0; flush || taken < kChunksPerDrain; taken++) {
    std::vector<char> c;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (chunks_.empty()) break;
      c = std::move(chunks_.front());
      chunks_.pop_front();
    }
    emit(c);
    size_t b = c.size();
    c.clear();
    std::lock_guard<std::mutex> g(mu_);
    queued_.fetch_sub(b, std::memory_order_relaxed);
    // Chunks kept for reuse (a new one's pages fault in and are zeroed:
    // 15% of the tool's samples with 8 kept).
    if (spare_.size() < 64) spare_.push_back(std::move(c));
  }
  if (flush) {
    // The copier's chunk in the making (taken out of the ring after every
    // chunk above, before the ring's rest), then the ring's rest.
    emit(cur_);
    cur_.clear();
    ring_->heartbeat();
    n += ring_->drain(fn);
  }
  return n;
}

void Session::detach() {
  if (!ring_) return;
  if (ring_->hdr().state == MT_INJ_DETACHED) {
    stop_copier();
    return;
  }
  // Best effort: the process may be gone.
  if (kill(pid_, 0) == 0) {
    (void)end_in_target(pid_, ring_->mutable_hdr());
  } else {
    ring_->set_state(MT_INJ_DETACHED);
  }
  stop_copier();
}

Result<uint32_t> end_in_target(pid_t pid, mt_inj_hdr* hdr) {
  __atomic_store_n(&hdr->state, uint32_t{MT_INJ_DETACHED}, __ATOMIC_RELEASE);
  // A hook that passed its check before the store commits within
  // microseconds; give it that.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // The allocator's entries as they were (a later uprobe on them would
  // break the patched process, and the hooks' calls through the stubs
  // pass its probes); the hooks left in the GOT slots call straight
  // through.
  return unpatch_entries(pid, hdr);
}

namespace {

// A ring header of pid's, mapped here shared (the agent's view of it).
struct MappedHdr {
  mt_inj_hdr* hdr = nullptr;
  MappedHdr() = default;
  MappedHdr(const MappedHdr&) = delete;
  MappedHdr& operator=(const MappedHdr&) = delete;
  MappedHdr(MappedHdr&& o) noexcept : hdr(std::exchange(o.hdr, nullptr)) {}
  MappedHdr& operator=(MappedHdr&& o) noexcept {
    if (this != &o) {
      reset();
      hdr = std::exchange(o.hdr, nullptr);
    }
    return *this;
  }
  ~MappedHdr() { reset(); }
  void reset() {
    if (hdr) munmap(hdr, MT_INJ_HDR_BYTES);
    hdr = nullptr;
  }
};

// Whether pid is a running memtrace-bpf: there, not a zombie (killed, its
// parent has not reaped it yet), and memtrace-bpf by its name or its
// executable's (not another program the pid was given to since).
bool is_live_tool(pid_t pid) {
  if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) return false;
  std::string dir = "/proc/" + std::to_string(pid);
  char buf[512];
  Fd stat(open((dir + "/stat").c_str(), O_RDONLY | O_CLOEXEC));
  ssize_t n = stat.valid() ? read(stat.get(), buf, sizeof buf - 1) : -1;
  if (n <= 0) return false;
  buf[n] = 0;
  const char* close = strrchr(buf, ')');
  if (!close || close[1] != ' ' || close[2] == 'Z' || close[2] == 'X') return false;
  const std::string name = "memtrace-bpf";
  Fd comm(open((dir + "/comm").c_str(), O_RDONLY | O_CLOEXEC));
  n = comm.valid() ? read(comm.get(), buf, sizeof buf - 1) : -1;
  if (n > 0 && std::string(buf, static_cast<size_t>(n)) == name + "\n") return true;
  n = readlink((dir + "/exe").c_str(), buf, sizeof buf - 1);
  if (n <= 0) return false;
  std::string exe(buf, static_cast<size_t>(n));
  if (exe.size() > 10 && exe.compare(exe.size() - 10, 10, " (deleted)") == 0) exe.resize(exe.size() - 10);
  return exe.substr(exe.rfind('/') + 1) == name;
}

// Whether the session of ring header h still has its tool: attached, its
// process a live memtrace-bpf (is_live_tool) and its heartbeat younger
// than MT_INJ_STALE_MAX_NS (the agent's own limit for a tool that is
// there, agent.c loader_alive). A tool whose process is gone is dead at
// once, before its heartbeat goes stale (MT_INJ_STALE_NS): the agent
// would find that within 3 s.
bool tool_alive(const mt_inj_hdr& h) {
  if (__atomic_load_n(&h.state, __ATOMIC_ACQUIRE) != MT_INJ_ATTACHED) return false;
  uint64_t now = monotonic_ns(), beat = __atomic_load_n(&h.heartbeat_ns, __ATOMIC_RELAXED);
  uint64_t age = now > beat ? now - beat : 0;
  return age <= MT_INJ_STALE_MAX_NS && is_live_tool(static_cast<pid_t>(h.loader_pid));
}

}  // namespace

Result<uint32_t> restore_left_patched(pid_t pid, const std::vector<procfs::Mapping>& maps) {
  std::string who = "pid " + std::to_string(pid);
  // The agent's rings: every session's stays mapped; the current one (the
  // agent's g_view) is the one beaten last.
  char name[64];
  snprintf(name, sizeof name, MT_INJ_PATH_FMT, static_cast<int>(pid));
  std::string want = name;
  MappedHdr cur;
  for (const auto& m : maps) {
    if (m.offset != 0 || !m.shared() || m.end - m.start < MT_INJ_HDR_BYTES) continue;
    if (m.path != want && m.path != want + " (deleted)") continue;
    char mf[96];
    snprintf(mf, sizeof mf, "/proc/%d/map_files/%llx-%llx", static_cast<int>(pid),
             static_cast<unsigned long long>(m.start), static_cast<unsigned long long>(m.end));
    Fd fd(open(mf, O_RDWR | O_CLOEXEC));
    if (!fd.valid())
      return Error::sys(who + ": open the ring an earlier --inject session left (" + std::string(mf) + ")");
    void* p = mmap(nullptr, MT_INJ_HDR_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) return Error::sys(who + ": map " + mf);
    MappedHdr h;
    h.hdr = static_cast<mt_inj_hdr*>(p);
    const mt_inj_hdr& r = *h.hdr;
    if (r.magic != MT_INJ_MAGIC || r.version != MT_INJ_VERSION || r.pid != static_cast<uint32_t>(pid) ||
        __atomic_load_n(&r.agent_state, __ATOMIC_ACQUIRE) != MT_INJ_AGENT_HOOKED)
      continue;
    if (!cur.hdr || r.heartbeat_ns > cur.hdr->heartbeat_ns) cur = std::move(h);
  }
  if (!cur.hdr) return 0u;
  mt_inj_hdr& h = *cur.hdr;
  uint32_t count = std::min<uint32_t>(h.entry_count, MT_INJ_ENTRY_MAX), patched = 0;
  for (uint32_t i = 0; i < count; i++) patched += h.entries[i].stub != 0;
  if (static_cast<pid_t>(h.loader_pid) == getpid()) return 0u;  // this tool's own session
  if (tool_alive(h)) {
    if (!patched) return 0u;
    return Error::msg(who + ": memtrace-bpf --inject (pid " + std::to_string(h.loader_pid) +
                      ") records this process: its " + std::to_string(patched) + " allocator entries stay patched");
  }
  if (!patched) {
    // A clean end before, or nothing patched: the hooks call the originals.
    __atomic_store_n(&h.state, uint32_t{MT_INJ_DETACHED}, __ATOMIC_RELEASE);
    return 0u;
  }
  auto n = end_in_target(pid, &h);
  std::string not_restored = who + ": " + std::to_string(patched) +
                             " allocator entries left patched by an earlier --inject session not restored: ";
  if (!n) return Error::msg(not_restored + n.error().message);
  uint32_t left = 0;
  for (uint32_t i = 0; i < count; i++) left += h.entries[i].stub != 0;
  if (left) return Error::msg(not_restored + std::to_string(left) + " of them still patched");
  return *n;
}

void Session::ended() {
  if (!ring_) return;
  ring_->set_state(MT_INJ_DETACHED);
  stop_copier();
}

Session::~Session() { detach(); }

}  // namespace memtrace::inject
