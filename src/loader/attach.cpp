#include "loader/attach.h"

#include "loader/shared_uprobes.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <elf.h>
#include <linux/bpf.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cinttypes>
#include <cstdlib>
#include <cstdio>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace memtrace::loader {

static_assert(MT_ROLE_COUNT == static_cast<int>(probes::Role::kCount) &&
                  MT_ROLE_ALIGNED_NEW == static_cast<int>(probes::Role::kAlignedNew),
              "probes::Role and bpf/memtrace.h's mt_role agree");

const char* role_name(uint32_t role) {
  return probes::role_name(static_cast<probes::Role>(role));
}

ProbeSet& ProbeSet::operator=(ProbeSet&& o) noexcept {
  if (this != &o) {
    reset();
    links_ = std::move(o.links_);
    o.links_.clear();
  }
  return *this;
}

namespace {
std::mutex g_detach_mu;
std::vector<std::thread> g_detachers;  // one per BPF link fd (uprobe_multi)

// Perf-event uprobes are closed one at a time by one thread, and only while
// no attach is in progress: the kernel closes each under its event_mutex
// across an RCU grace period (perf_uprobe_destroy -> perf_trace_event_unreg
// -> tracepoint_synchronize_unregister: ~100 ms each in this VM), and
// perf_event_open of a uprobe takes the same mutex. Closed all at once, the
// 17 perf events of each exited process made the next process's attach wait
// for all of them (-c with short processes: attaches of 1 ms took seconds).
std::condition_variable g_perf_cv;
std::deque<Link> g_perf_queue;
int g_attaching = 0;
bool g_perf_stop = false;  // detach_wait: the thread ends after its current close
std::thread g_perf_thread;
// The kernel's time in the closes of perf_detacher (STATS uprobe_detach_us):
// a process's perf events, closed after it ended, while the run goes on.
std::atomic<uint64_t> g_detach_ns{0};
std::atomic<uint64_t> g_detach_sets{0};
// Probes that still fire (a live process's, system-wide ones): closed by
// detach_wait itself, before the tool exits, never left to the reaper: a
// system-wide uprobe left open for seconds after the exit made every process
// on the machine trap into the old session's programs.
std::vector<Link> g_perf_urgent;

void close_link(const Link& l) {
  if (l.fd >= 0) close(l.fd);
  if (l.perf_fd >= 0) close(l.perf_fd);
}

LinkSink g_sink;  // under g_detach_mu

// The links to the sink, then closed here (no longer the last reference:
// no detach waits here). False if the sink did not take them (left open).
bool to_sink(const std::vector<Link>& links) {
  if (!g_sink || links.empty()) return false;
  std::vector<int> fds;
  for (const Link& l : links) {
    if (l.fd >= 0) fds.push_back(l.fd);
    if (l.perf_fd >= 0) fds.push_back(l.perf_fd);
  }
  if (!g_sink(fds)) return false;
  for (const Link& l : links) close_link(l);
  return true;
}

void perf_detacher() {
  std::unique_lock<std::mutex> lk(g_detach_mu);
  for (;;) {
    g_perf_cv.wait(lk, [] { return g_perf_stop || (!g_perf_queue.empty() && g_attaching == 0); });
    if (g_perf_stop) return;
    Link l = g_perf_queue.front();
    g_perf_queue.pop_front();
    lk.unlock();
    auto t0 = std::chrono::steady_clock::now();
    close_link(l);
    g_detach_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    lk.lock();
  }
}
}  // namespace

AttachScope::AttachScope() {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  g_attaching++;
}
AttachScope::~AttachScope() {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  g_attaching--;
  g_perf_cv.notify_all();
}

void set_link_sink(LinkSink sink) {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  g_sink = std::move(sink);
}

DetachStats detach_stats() { return {g_detach_ns.load() / 1000, g_detach_sets.load()}; }

void detach_async(std::vector<Link> links, bool urgent) {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  if (!urgent && std::any_of(links.begin(), links.end(), [](const Link& l) { return l.perf_fd >= 0; }))
    g_detach_sets++;
  if (g_sink) {  // BPF links (uprobe_multi) to the sink at once; perf events as below
    std::vector<Link> bpf_links;
    for (const Link& l : links)
      if (l.perf_fd < 0 && l.fd >= 0) bpf_links.push_back(l);
    if (to_sink(bpf_links))
      links.erase(std::remove_if(links.begin(), links.end(), [](const Link& l) { return l.perf_fd < 0; }),
                  links.end());
  }
  for (Link l : links) {
    if (l.perf_fd >= 0 && urgent) {
      g_perf_urgent.push_back(l);
    } else if (l.perf_fd >= 0) {
      g_perf_queue.push_back(l);
      if (!g_perf_thread.joinable()) {
        g_perf_stop = false;
        g_perf_thread = std::thread(perf_detacher);
      }
    } else if (l.fd >= 0) {
      g_detachers.emplace_back([fd = l.fd] { close(fd); });
    }
  }
  g_perf_cv.notify_all();
}

void detach_wait() {
  std::vector<std::thread> ts;
  std::thread perf;
  {
    std::lock_guard<std::mutex> lk(g_detach_mu);
    ts.swap(g_detachers);
    g_perf_stop = true;
    perf.swap(g_perf_thread);
    g_perf_cv.notify_all();
  }
  for (auto& t : ts) t.join();
  if (perf.joinable()) perf.join();
  std::vector<Link> urgent;
  {
    std::lock_guard<std::mutex> lk(g_detach_mu);
    // The shared events' carriers after every process's filter (no attach
    // follows): closed in the background (a grace period each), last.
    std::vector<Link> carriers = shared_uprobes::take_carriers();
    g_perf_queue.insert(g_perf_queue.begin(), carriers.begin(), carriers.end());
    urgent.swap(g_perf_urgent);
    if (to_sink(urgent)) return;  // closed by the sink, first (they still fire)
  }
  for (const Link& l : urgent) close_link(l);
}

// The perf-event uprobes still open (detach_wait stopped their thread): a
// process of their own closes them (~100 ms each), so that the tool exits at
// once. It keeps no other fd (not the output, not a pipe someone waits on to
// see the tool go) and ignores the signals that stop the tool. The newest
// first: the probes of processes still running, queued at teardown.
void detach_in_background() {
  std::vector<Link> links;
  {
    std::lock_guard<std::mutex> lk(g_detach_mu);
    links.assign(g_perf_queue.rbegin(), g_perf_queue.rend());
    g_perf_queue.clear();
    if (to_sink(links)) return;  // the guardian closes them (guardian.h), then removes the shared events
  }
  if (links.empty()) return;
  const std::vector<std::string> removals = shared_uprobes::removal_lines();
  std::vector<int> keep;
  for (const Link& l : links) keep.insert(keep.end(), {l.fd, l.perf_fd});
  std::sort(keep.begin(), keep.end());
  std::vector<int> others;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      int fd = atoi(e->d_name);
      if (e->d_name[0] != '.' && fd != dirfd(d) && !std::binary_search(keep.begin(), keep.end(), fd))
        others.push_back(fd);
    }
    closedir(d);
  }
  pid_t pid = fork();
  if (pid == 0) {
    // Only syscalls from here (another thread may have held a lock at fork).
    setsid();
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    for (int fd : others) close(fd);
    int null = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3; fd++)
      if (null >= 0 && !std::binary_search(keep.begin(), keep.end(), fd)) dup2(null, fd);
    if (null > 2) close(null);
    for (const Link& l : links) close_link(l);
    shared_uprobes::remove_events(removals);
    _exit(0);
  }
  if (pid < 0) {  // no process: close them here, slowly
    for (const Link& l : links) close_link(l);
    shared_uprobes::remove_events(removals);
    return;
  }
  for (const Link& l : links) close_link(l);  // the reaper holds them now
}

void ProbeSet::reset() {
  if (!links_.empty()) detach_async(std::move(links_), false);
  links_.clear();
}

void ProbeSet::reset_before_exit() {
  if (!links_.empty()) detach_async(std::move(links_), true);
  links_.clear();
}

Result<const AllocatorObject*> Attacher::analyze(const std::string& open_path, const MapEntry& m) {
  auto key = std::make_pair(static_cast<uint64_t>(m.dev), m.inode);
  auto it = objects_.find(key);
  if (it != objects_.end()) return static_cast<const AllocatorObject*>(it->second.get());

  auto elf = elf::ElfFile::open(open_path);
  if (!elf) {
    objects_[key] = nullptr;
    return elf.error();
  }
  probes::DetectOptions dopt;
  dopt.symbol_prefix = choice_.prefix;
  std::unique_ptr<AllocatorObject> obj;
  auto add_sites = [](AllocatorObject& o, const probes::Allocator& a) {
    for (const auto& sym : a.symbols) {
      ProbeSite site;
      site.role = static_cast<uint32_t>(sym.role);
      site.symbol = sym.symbol;
      site.file_offset = sym.file_offset;
      site.vaddr = sym.vaddr;
      site.placement = sym.placement;
      site.retprobe = probes::has_return_probe(sym.role);
      site.alias_of = sym.alias_of;
      o.sites.push_back(std::move(site));
    }
  };
  auto make = [&] {
    obj = std::make_unique<AllocatorObject>();
    obj->path = m.path;
    obj->dev = key.first;
    obj->inode = key.second;
  };
  if (auto a = probes::find_allocator_symbols(*elf, dopt)) {
    make();
    obj->family = probes::family_name(a->family);
    add_sites(*obj, *a);
    // Its own C++ new/delete, mallocx, sdallocx...: under a preloaded
    // tcmalloc or mimalloc the program's new and delete are these and never
    // reach its malloc.
    for (const auto& sym : a->extras) {
      probes::Allocator one;
      one.symbols = {sym};
      add_sites(*obj, one);
    }
    obj->alloc = std::move(*a);
  }
  // libstdc++ rounds the size of an aligned new up before aligned_alloc: the
  // size the program asked for is its operator new's argument.
  if (auto c = probes::find_cxx_aligned_new(*elf, dopt)) {
    if (!obj) {
      make();
      obj->family = probes::family_name(probes::Family::kCxx);
    }
    add_sites(*obj, *c);
    obj->cxx = std::move(*c);
  }
  const AllocatorObject* raw = obj.get();
  objects_[key] = std::move(obj);
  return raw;
}

Result<const AllocatorObject*> Attacher::object_at(pid_t pid, const MapEntry& m) {
  if (!m.exec() || !m.file() || m.path.find("/ld-linux") != std::string::npos)
    return static_cast<const AllocatorObject*>(nullptr);
  auto r = analyze(openable_path(pid, m), m);
  if (r && *r && (*r)->allocator() && !object_matches(m.path)) return static_cast<const AllocatorObject*>(nullptr);
  return r;
}

std::vector<std::pair<const AllocatorObject*, MapEntry>> Attacher::cxx_runtimes(pid_t pid,
                                                                                const std::vector<MapEntry>& maps) {
  std::vector<std::pair<const AllocatorObject*, MapEntry>> out;
  std::set<std::pair<uint64_t, uint64_t>> seen;
  for (const MapEntry& m : maps) {
    if (!m.exec() || !m.file() || !seen.insert({m.dev, m.inode}).second) continue;
    auto r = object_at(pid, m);
    if (r && *r && !(*r)->allocator()) out.emplace_back(*r, m);
  }
  return out;
}

bool Attacher::object_matches(const std::string& path) const {
  const std::string& want = choice_.object;
  if (want.empty()) return true;
  if (want.find('/') != std::string::npos) {
    // /proc/PID/maps shows the file the symlink resolves to (libfoo.so.2 -> libfoo.so.2.1.0).
    char real[PATH_MAX];
    return path == want || (realpath(want.c_str(), real) && path == real);
  }
  std::string base = path.substr(path.rfind('/') + 1);
  return base == want || base.rfind(want, 0) == 0;  // "libjemalloc.so" matches libjemalloc.so.2
}

Result<const AllocatorObject*> Attacher::find_allocator(pid_t pid, const std::vector<MapEntry>& maps,
                                                        MapEntry* where) {
  const AllocatorObject* glibc = nullptr;
  const AllocatorObject* other = nullptr;
  MapEntry glibc_m, other_m;
  std::string last_err;
  std::map<std::pair<uint64_t, uint64_t>, bool> seen;
  for (size_t i = 0; i < maps.size(); i++) {
    const MapEntry& m = maps[i];
    if (!m.exec() || !m.file()) continue;
    if (m.path.find("/ld-linux") != std::string::npos) continue;
    if (!object_matches(m.path)) continue;
    if (seen[{m.dev, m.inode}]) continue;
    seen[{m.dev, m.inode}] = true;
    auto r = analyze(openable_path(pid, m), m);
    if (!r) {
      last_err = r.error().message;
      continue;
    }
    if (!*r || !(*r)->allocator()) continue;  // nothing, or only a C++ runtime (cxx_runtimes)
    if (!choice_.object.empty() || choice_.prefix) {
      // Named by the user: the first object that matches is the allocator.
      if (where) *where = m;
      return *r;
    }
    if ((*r)->family == "glibc") {
      if (!glibc) glibc = *r, glibc_m = m;
    } else if (!other) {
      other = *r, other_m = m;
    }
  }
  if (other) {
    if (where) *where = other_m;
    return other;
  }
  if (glibc) {
    if (where) *where = glibc_m;
    return glibc;
  }
  return static_cast<const AllocatorObject*>(nullptr);
}

namespace {

// BPF_LINK_CREATE for BPF_TRACE_UPROBE_MULTI (kernel >= 6.6). Debian's
// libbpf 1.1 predates it, so the attr is laid out here, as in the kernel's
// uapi union bpf_attr (link_create.uprobe_multi).
constexpr uint32_t kTraceUprobeMulti = 48;  // BPF_TRACE_UPROBE_MULTI
constexpr uint32_t kUprobeMultiReturn = 1;  // BPF_F_UPROBE_MULTI_RETURN

struct LinkCreateUprobeMulti {
  uint32_t prog_fd;
  uint32_t target_fd;
  uint32_t attach_type;
  uint32_t flags;
  uint64_t path;
  uint64_t offsets;
  uint64_t ref_ctr_offsets;
  uint64_t cookies;
  uint32_t cnt;
  uint32_t um_flags;
  uint32_t pid;
  uint32_t pad;
  uint64_t tail[8];  // rest of union bpf_attr: zero
};

Result<int> uprobe_multi(bpf_program* prog, const std::string& path, pid_t pid,
                         const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& cookies,
                         bool ret) {
  LinkCreateUprobeMulti a{};
  a.prog_fd = bpf_program__fd(prog);
  a.attach_type = kTraceUprobeMulti;
  a.path = reinterpret_cast<uint64_t>(path.c_str());
  a.offsets = reinterpret_cast<uint64_t>(offsets.data());
  a.cookies = reinterpret_cast<uint64_t>(cookies.data());
  a.cnt = offsets.size();
  a.um_flags = ret ? kUprobeMultiReturn : 0;
  a.pid = pid > 0 ? pid : 0;
  int fd = syscall(__NR_bpf, BPF_LINK_CREATE, &a, sizeof a);
  if (fd < 0) return Error::sys(std::string("attach ") + (ret ? "uretprobes" : "uprobes") + " in " + path +
                                (pid > 0 ? " for pid " + std::to_string(pid) : ""));
  return fd;
}

// The uprobe PMU's type and the bit of its config that makes a return probe
// (/sys/bus/event_source/devices/uprobe: "8" and "config:0" here).
struct UprobePmu {
  int type = -1;
  int ret_bit = 0;
};
const UprobePmu& uprobe_pmu() {
  static UprobePmu pmu = [] {
    UprobePmu p;
    if (FILE* f = fopen("/sys/bus/event_source/devices/uprobe/type", "r")) {
      if (fscanf(f, "%d", &p.type) != 1) p.type = -1;
      fclose(f);
    }
    if (FILE* f = fopen("/sys/bus/event_source/devices/uprobe/format/retprobe", "r")) {
      if (fscanf(f, "config:%d", &p.ret_bit) != 1) p.ret_bit = 0;
      fclose(f);
    }
    return p;
  }();
  return pmu;
}

// A perf-event uprobe (uprobe PMU) at one offset, for one process (pid > 0)
// or all, with prog attached: through a BPF link that carries the cookie
// (5.15), or with PERF_EVENT_IOC_SET_BPF where there are no cookies (5.10).
// The fds are ours, not libbpf's: a reaper process closes them at exit
// (detach_in_background).
Result<Link> perf_uprobe(bpf_program* prog, const std::string& path, pid_t pid, uint64_t offset, uint64_t cookie,
                         bool ret, bool with_cookie) {
  auto fail = [&](const char* what, int err) {
    return Error::sys(std::string(what) + " " + (ret ? "uretprobe" : "uprobe") + " at +" + std::to_string(offset) +
                          " in " + path + (pid > 0 ? " for pid " + std::to_string(pid) : ""),
                      err);
  };
  const UprobePmu& pmu = uprobe_pmu();
  if (pmu.type < 0) return Error::msg("no uprobe PMU (/sys/bus/event_source/devices/uprobe)");
  perf_event_attr attr{};
  attr.size = sizeof(attr);
  attr.type = pmu.type;
  attr.config = ret ? 1ULL << pmu.ret_bit : 0;
  attr.config1 = reinterpret_cast<uint64_t>(path.c_str());
  attr.config2 = offset;
  // A per-process uprobe follows the task, not its mm: gone at the task's
  // next exec (5.13), not left firing in the new image until it is closed
  // (the full BPF programs also ignore it there, by its cookie).
  attr.remove_on_exec = pid > 0;
  int pfd = static_cast<int>(syscall(__NR_perf_event_open, &attr, pid > 0 ? pid : -1, pid > 0 ? -1 : 0, -1,
                                     PERF_FLAG_FD_CLOEXEC));
  if (pfd < 0 && errno == EINVAL && attr.remove_on_exec) {  // before 5.13
    attr.remove_on_exec = 0;
    pfd = static_cast<int>(syscall(__NR_perf_event_open, &attr, pid, -1, -1, PERF_FLAG_FD_CLOEXEC));
  }
  if (pfd < 0) return fail("perf_event_open", errno);
  auto l = attach_to_perf_event(prog, pfd, cookie, with_cookie);
  if (!l) return fail("attach BPF program to", l.error().err);
  return l;
}

}  // namespace

Result<Link> attach_to_perf_event(bpf_program* prog, int pfd, uint64_t cookie, bool with_cookie) {
  Link l{-1, pfd};
  bool ok;
  if (with_cookie) {
    LIBBPF_OPTS(bpf_link_create_opts, o, .perf_event = {.bpf_cookie = cookie});
    l.fd = bpf_link_create(bpf_program__fd(prog), pfd, BPF_PERF_EVENT, &o);
    ok = l.fd >= 0;
  } else {
    ok = !ioctl(pfd, PERF_EVENT_IOC_SET_BPF, bpf_program__fd(prog)) && !ioctl(pfd, PERF_EVENT_IOC_ENABLE, 0);
  }
  if (!ok) {
    int err = errno;
    close(pfd);
    return Error::sys("attach BPF program to a perf event", err);
  }
  return l;
}

void prepare_programs(bpf_program* enter, bpf_program* exit, AttachMode mode) {
  if (mode != AttachMode::UprobeMulti) return;
  bpf_program__set_expected_attach_type(enter, static_cast<bpf_attach_type>(kTraceUprobeMulti));
  bpf_program__set_expected_attach_type(exit, static_cast<bpf_attach_type>(kTraceUprobeMulti));
}

Result<ProbeSet> Attacher::attach(const AllocatorObject& obj, pid_t pid, const std::string& open_path,
                                  uint32_t image) {
  if (ready_)
    if (auto r = ready_(); !r) return r.error();
  const uint64_t img = static_cast<uint64_t>(image) << MT_COOKIE_IMAGE_SHIFT;
  AttachScope scope;  // pending perf-event closes wait
  // Entry probes: offset, cookie (role | ret_at << 8 | image), program; the same at
  // the function's entry for a kernel that refuses the chosen offset.
  struct Probe {
    uint64_t off, cookie, off0, cookie0;
    bpf_program* prog;
  };
  std::vector<Probe> entry;
  std::vector<uint64_t> roff, rcookie;
  const bool cookies = mode_ != AttachMode::PerfEventPerRole;
  for (const ProbeSite& s : obj.sites) {
    if (!s.alias_of.empty()) continue;
    int32_t ret_at = s.placement.rsp_adjust;
    uint64_t off = s.file_offset + s.placement.offset;
    bpf_program* prog = enter_[0];
    if (!cookies) {
      // No cookie to carry the role and ret_at: the role's own program
      // assumes the return address at [rsp], so a placement after a push
      // goes back to +0 (and the kernel gets no cookie: it could not carry one).
      if (ret_at != 0) off = s.file_offset;
      prog = s.role < enter_.size() ? enter_[s.role] : nullptr;
      if (!prog) return Error::msg(std::string("no BPF program for ") + role_name(s.role));
      entry.push_back({off, 0, s.file_offset, 0, prog});
    } else {
      uint64_t cookie = s.role | (static_cast<uint64_t>(static_cast<uint32_t>(ret_at)) << 8) | img;
      entry.push_back({off, cookie, s.file_offset, s.role | img, prog});
    }
    if (s.retprobe) {
      roff.push_back(s.file_offset + probes::return_probe_offset(s.placement));
      rcookie.push_back(cookies ? s.role | img : 0);
    }
  }
  // Return probes before entry probes: a call that enters between the two
  // attaches must not leave a record whose return never fires (counted as
  // missed_returns, and its allocation lost). Attaching to a file that many
  // processes map takes long (every mm gets its breakpoints): system-wide on
  // a busy host, hundreds of calls fell into that window.
  ProbeSet set;
  if (mode_ != AttachMode::UprobeMulti) {
    // One uprobe per offset; a refused chosen offset falls back to the
    // function's entry for that probe alone. A process's probes are its
    // filters on events shared by every process (shared_uprobes.h: no
    // grace period at its detach); a system-wide probe is the PMU's own.
    const bool shared = pid > 0 && shared_uprobes::available();
    auto one = [&](bpf_program* prog, uint64_t off, uint64_t cookie, bool ret) -> Result<Link> {
      if (shared) {
        // Every process's image in one program's cookie: none is old.
        uint64_t c = cookie & ((1ULL << MT_COOKIE_IMAGE_SHIFT) - 1);
        if (cookies) c |= static_cast<uint64_t>(MT_COOKIE_IMAGE_SHARED) << MT_COOKIE_IMAGE_SHIFT;
        auto r = shared_uprobes::open_for(pid, open_path, obj.dev, obj.inode, off, ret, prog, c, cookies);
        if (r || r.error().err != 0) return r;  // the process's own open: as the PMU's
        if (shared_fallbacks_++ == 0) notes_.push_back(r.error().message + ": perf-event uprobes of its own");
      }
      return perf_uprobe(prog, open_path, pid, off, cookie, ret, cookies);
    };
    for (size_t i = 0; i < roff.size(); i++) {
      auto r = one(exit_, roff[i], rcookie[i], true);
      if (!r) return r.error();
      set.add(*r);
    }
    for (const Probe& p : entry) {
      auto e = one(p.prog, p.off, p.cookie, false);
      if (!e && p.off != p.off0) {
        notes_.push_back("kernel refused the chosen probe offset +" + std::to_string(p.off) + " in " + obj.path +
                         " (" + e.error().message + "): using the function's entry");
        e = one(p.prog, p.off0, p.cookie0, false);
      }
      if (!e) return e.error();
      set.add(*e);
    }
    return set;
  }
  std::vector<uint64_t> eoff, ecookie, eoff0, ecookie0;
  for (const Probe& p : entry) {
    eoff.push_back(p.off);
    ecookie.push_back(p.cookie);
    eoff0.push_back(p.off0);
    ecookie0.push_back(p.cookie0);
  }
  if (!roff.empty()) {
    auto r = uprobe_multi(exit_, open_path, pid, roff, rcookie, true);
    if (!r) return r.error();
    set.add_fd(*r);
  }
  auto e = uprobe_multi(enter_[0], open_path, pid, eoff, ecookie, false);
  if (!e && eoff != eoff0) {
    notes_.push_back("kernel refused the chosen probe offsets in " + obj.path + " (" +
                     e.error().message + "): using offset 0");
    e = uprobe_multi(enter_[0], open_path, pid, eoff0, ecookie0, false);
  }
  if (!e) return e.error();
  set.add_fd(*e);
  return set;
}

std::string Attacher::explain(const AllocatorObject& obj) {
  std::ostringstream os;
  if (obj.allocator()) os << probes::explain(obj.alloc, obj.path);
  if (obj.cxx) os << probes::explain(*obj.cxx, obj.path);
  for (const auto& s : obj.sites)
    if (s.retprobe && s.alias_of.empty())
      os << "  " << s.symbol << " return probe at +" << probes::return_probe_offset(s.placement)
         << (probes::return_probe_offset(s.placement) == s.placement.offset
                 ? " (same instruction as the entry probe: one trap for both)"
                 : " (the return address moved before the entry probe)")
         << "\n";
  return os.str();
}

}  // namespace memtrace::loader
