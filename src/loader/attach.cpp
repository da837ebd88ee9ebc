#include "loader/attach.h"

#include <bpf/libbpf.h>
#include <elf.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/sysmacros.h>

#include <climits>
#include <cinttypes>
#include <cstdlib>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

namespace memtrace::loader {

const char* role_name(uint32_t role) {
  static const char* names[] = {"malloc",         "calloc",        "realloc",  "reallocarray",
                                "free",           "posix_memalign", "aligned_alloc",
                                "memalign",       "valloc",        "pvalloc"};
  return role < MT_ROLE_COUNT ? names[role] : "?";
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
std::vector<std::thread> g_detachers;
}  // namespace

void detach_async(std::vector<Link> links) {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  for (Link l : links)
    g_detachers.emplace_back([l] {
      if (l.link) bpf_link__destroy(l.link);
      if (l.fd >= 0) close(l.fd);
    });
}

void detach_wait() {
  std::vector<std::thread> ts;
  {
    std::lock_guard<std::mutex> lk(g_detach_mu);
    ts.swap(g_detachers);
  }
  for (auto& t : ts) t.join();
}

void ProbeSet::reset() {
  if (!links_.empty()) detach_async(std::move(links_));
  links_.clear();
}

Result<const AllocatorObject*> Attacher::analyze(const std::string& open_path, const MapEntry& m) {
  auto key = std::make_pair(static_cast<uint64_t>(makedev(m.dev_major, m.dev_minor)), m.inode);
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
  if (auto a = probes::find_allocator_symbols(*elf, dopt)) {
    obj = std::make_unique<AllocatorObject>();
    obj->path = m.path;
    obj->dev = key.first;
    obj->inode = key.second;
    obj->family = probes::family_name(a->family);
    for (const auto& sym : a->symbols) {
      ProbeSite site;
      site.role = static_cast<uint32_t>(sym.role);
      site.symbol = sym.symbol;
      site.file_offset = sym.file_offset;
      site.vaddr = sym.vaddr;
      site.placement = sym.placement;
      site.retprobe = probes::has_return_probe(sym.role);
      site.alias_of = sym.alias_of;
      obj->sites.push_back(std::move(site));
    }
    obj->alloc = std::move(*a);
  }
  const AllocatorObject* raw = obj.get();
  objects_[key] = std::move(obj);
  return raw;
}

Result<const AllocatorObject*> Attacher::object_at(pid_t pid, const MapEntry& m) {
  if (!m.exec() || !m.file() || m.path.find("/ld-linux") != std::string::npos || !object_matches(m.path))
    return static_cast<const AllocatorObject*>(nullptr);
  return analyze(openable_path(pid, m), m);
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
    if (seen[{makedev(m.dev_major, m.dev_minor), m.inode}]) continue;
    seen[{makedev(m.dev_major, m.dev_minor), m.inode}] = true;
    auto r = analyze(openable_path(pid, m), m);
    if (!r) {
      last_err = r.error().message;
      continue;
    }
    if (!*r) continue;
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

// A perf-event uprobe (uprobe PMU) for one offset, with the cookie carried by
// a BPF link (kernel >= 5.15).
Result<bpf_link*> perf_uprobe(bpf_program* prog, const std::string& path, pid_t pid, uint64_t offset,
                              uint64_t cookie, bool ret) {
  LIBBPF_OPTS(bpf_uprobe_opts, o, .bpf_cookie = cookie, .retprobe = ret);
  bpf_link* l = bpf_program__attach_uprobe_opts(prog, pid > 0 ? pid : -1, path.c_str(), offset, &o);
  if (!l) {
    int err = errno;
    return Error::sys(std::string("attach ") + (ret ? "uretprobe" : "uprobe") + " at +" + std::to_string(offset) +
                          " in " + path + (pid > 0 ? " for pid " + std::to_string(pid) : ""),
                      err);
  }
  return l;
}

}  // namespace

void prepare_programs(bpf_program* enter, bpf_program* exit, AttachMode mode) {
  if (mode != AttachMode::UprobeMulti) return;
  bpf_program__set_expected_attach_type(enter, static_cast<bpf_attach_type>(kTraceUprobeMulti));
  bpf_program__set_expected_attach_type(exit, static_cast<bpf_attach_type>(kTraceUprobeMulti));
}

Result<ProbeSet> Attacher::attach(const AllocatorObject& obj, pid_t pid, const std::string& open_path) {
  // Entry probes: offset, cookie (role | ret_at << 8), program; the same at
  // the function's entry for a kernel that refuses the chosen offset.
  struct Probe {
    uint64_t off, cookie, off0, cookie0;
    bpf_program* prog;
  };
  std::vector<Probe> entry;
  std::vector<uint64_t> roff, rcookie;
  for (const ProbeSite& s : obj.sites) {
    if (!s.alias_of.empty()) continue;
    int32_t ret_at = s.placement.rsp_adjust;
    uint64_t off = s.file_offset + s.placement.offset;
    bpf_program* prog = enter_[0];
    if (mode_ == AttachMode::PerfEventPerRole) {
      // No cookie to carry ret_at: the role's program assumes the return
      // address at [rsp], so a placement after a push goes back to +0.
      if (ret_at != 0) off = s.file_offset, ret_at = 0;
      prog = s.role < enter_.size() ? enter_[s.role] : nullptr;
      if (!prog) return Error::msg(std::string("no BPF program for ") + role_name(s.role));
    }
    uint64_t cookie = s.role | (static_cast<uint64_t>(static_cast<uint32_t>(ret_at)) << 8);
    if (mode_ == AttachMode::PerfEventPerRole) {
      // (libbpf refuses a cookie where the kernel cannot carry one)
      entry.push_back({off, 0, s.file_offset, 0, prog});
    } else {
      entry.push_back({off, cookie, s.file_offset, s.role, prog});
    }
    if (s.retprobe) {
      roff.push_back(s.file_offset + probes::return_probe_offset(s.placement));
      rcookie.push_back(mode_ == AttachMode::PerfEventPerRole ? 0 : s.role);
    }
  }
  ProbeSet set;
  if (mode_ != AttachMode::UprobeMulti) {
    // One uprobe per offset; a refused chosen offset falls back to the
    // function's entry for that probe alone.
    for (const Probe& p : entry) {
      auto e = perf_uprobe(p.prog, open_path, pid, p.off, p.cookie, false);
      if (!e && p.off != p.off0) {
        notes_.push_back("kernel refused the chosen probe offset +" + std::to_string(p.off) + " in " + obj.path +
                         " (" + e.error().message + "): using the function's entry");
        e = perf_uprobe(p.prog, open_path, pid, p.off0, p.cookie0, false);
      }
      if (!e) return e.error();
      set.add_link(*e);
    }
    for (size_t i = 0; i < roff.size(); i++) {
      auto r = perf_uprobe(exit_, open_path, pid, roff[i], rcookie[i], true);
      if (!r) return r.error();
      set.add_link(*r);
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
  auto e = uprobe_multi(enter_[0], open_path, pid, eoff, ecookie, false);
  if (!e && eoff != eoff0) {
    notes_.push_back("kernel refused the chosen probe offsets in " + obj.path + " (" +
                     e.error().message + "): using offset 0");
    e = uprobe_multi(enter_[0], open_path, pid, eoff0, ecookie0, false);
  }
  if (!e) return e.error();
  set.add_fd(*e);
  if (!roff.empty()) {
    auto r = uprobe_multi(exit_, open_path, pid, roff, rcookie, true);
    if (!r) return r.error();
    set.add_fd(*r);
  }
  return set;
}

std::string Attacher::explain(const AllocatorObject& obj) {
  std::ostringstream os;
  os << probes::explain(obj.alloc, obj.path);
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
