#include "loader/attach.h"

#include <bpf/libbpf.h>
#include <elf.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/sysmacros.h>

#include <cinttypes>
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

void detach_async(std::vector<int> links) {
  std::lock_guard<std::mutex> lk(g_detach_mu);
  for (int fd : links) g_detachers.emplace_back([fd] { close(fd); });
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

namespace {

// What each role's BPF program reads: arguments (bit per register) and the
// return address at [rsp] plus rbp for the frame-pointer walk.
probes::Needs needs_of(uint32_t role) {
  probes::Needs n;
  switch (role) {
    case MT_ROLE_FREE: n.arg_mask = 0x1; break;
    case MT_ROLE_CALLOC: n.arg_mask = 0x3; break;
    case MT_ROLE_REALLOC: n.arg_mask = 0x3; break;
    case MT_ROLE_REALLOCARRAY: n.arg_mask = 0x7; break;
    case MT_ROLE_POSIX_MEMALIGN: n.arg_mask = 0x5; break;
    case MT_ROLE_ALIGNED_ALLOC:
    case MT_ROLE_MEMALIGN: n.arg_mask = 0x2; break;
    default: n.arg_mask = 0x1; break;
  }
  n.reads_rsp = true;
  n.reads_rbp = true;
  return n;
}

}  // namespace

Result<const AllocatorObject*> Attacher::analyze(const std::string& open_path, const MapEntry& m) {
  auto key = std::make_pair(static_cast<uint64_t>(makedev(m.dev_major, m.dev_minor)), m.inode);
  auto it = objects_.find(key);
  if (it != objects_.end()) return static_cast<const AllocatorObject*>(it->second.get());

  auto elf = elf::ElfFile::open(open_path);
  if (!elf) {
    objects_[key] = nullptr;
    return elf.error();
  }
  std::unique_ptr<AllocatorObject> obj;
  auto malloc_sym = elf->find_function("malloc");
  auto free_sym = elf->find_function("free");
  if (malloc_sym && free_sym) {
    obj = std::make_unique<AllocatorObject>();
    obj->path = m.path;
    obj->dev = key.first;
    obj->inode = key.second;
    obj->family = elf->find_function("__libc_malloc") ? "glibc" : "other";
    std::map<uint64_t, std::string> by_addr;  // aliases share one probe
    for (uint32_t role = 0; role < MT_ROLE_COUNT; role++) {
      auto sym = elf->find_function(role_name(role));
      if (!sym || sym->type == STT_GNU_IFUNC) continue;
      ProbeSite site;
      site.role = role;
      site.symbol = role_name(role);
      site.file_offset = sym->file_offset;
      site.vaddr = sym->vaddr;
      site.retprobe = role != MT_ROLE_FREE;
      auto [ai, fresh] = by_addr.emplace(sym->vaddr, site.symbol);
      if (!fresh) site.alias_of = ai->second;
      auto code = elf->read_vaddr(sym->vaddr, 64);
      site.placement = probes::choose_entry_offset(code, sym->vaddr, needs_of(role));
      obj->sites.push_back(std::move(site));
    }
  }
  const AllocatorObject* raw = obj.get();
  objects_[key] = std::move(obj);
  return raw;
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
    if (seen[{makedev(m.dev_major, m.dev_minor), m.inode}]) continue;
    seen[{makedev(m.dev_major, m.dev_minor), m.inode}] = true;
    auto r = analyze(openable_path(pid, m), m);
    if (!r) {
      last_err = r.error().message;
      continue;
    }
    if (!*r) continue;
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

}  // namespace

void prepare_programs(bpf_program* enter, bpf_program* exit) {
  bpf_program__set_expected_attach_type(enter, static_cast<bpf_attach_type>(kTraceUprobeMulti));
  bpf_program__set_expected_attach_type(exit, static_cast<bpf_attach_type>(kTraceUprobeMulti));
}

Result<ProbeSet> Attacher::attach(const AllocatorObject& obj, pid_t pid, const std::string& open_path) {
  std::vector<uint64_t> eoff, ecookie, roff, rcookie, eoff0, ecookie0;
  for (const ProbeSite& s : obj.sites) {
    if (!s.alias_of.empty()) continue;
    int32_t ret_at = s.placement.rsp_adjust;
    eoff.push_back(s.file_offset + s.placement.offset);
    ecookie.push_back(s.role | (static_cast<uint64_t>(static_cast<uint32_t>(ret_at)) << 8));
    eoff0.push_back(s.file_offset);
    ecookie0.push_back(s.role);
    if (s.retprobe) {
      roff.push_back(s.file_offset);
      rcookie.push_back(s.role);
    }
  }
  ProbeSet set;
  auto e = uprobe_multi(enter_, open_path, pid, eoff, ecookie, false);
  if (!e && eoff != eoff0) {
    notes_.push_back("kernel refused the chosen probe offsets in " + obj.path + " (" +
                     e.error().message + "): using offset 0");
    e = uprobe_multi(enter_, open_path, pid, eoff0, ecookie0, false);
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
  os << obj.path << " (" << obj.family << ")\n";
  for (const auto& s : obj.sites) {
    char b[512];
    if (!s.alias_of.empty()) {
      snprintf(b, sizeof b, "  %-15s alias of %s (same address, one probe)\n", s.symbol.c_str(),
               s.alias_of.c_str());
    } else {
      snprintf(b, sizeof b, "  %-15s +%-3" PRIu64 " %-28s %s%s\n", s.symbol.c_str(),
               s.placement.offset, s.placement.insn.c_str(), s.placement.reason.c_str(),
               s.retprobe ? "; return probe at +0" : "");
    }
    os << b;
  }
  return os.str();
}

}  // namespace memtrace::loader
